"""Tiny random-weight llama / qwen2 / qwen3 models built with transformers (the oracle), in seconds.

The tokenizer here is a byte-level test double (ids 0..255 are bytes, 256 = EOS): the tests that use
tiny models are about token ids, logits and KV, not about text.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ternlm.models.config import ModelConfig
from ternlm.models.loaded import LoadedModel

VOCAB = 300
EOS = 256


class ByteTokenizer:
    vocab_size = VOCAB
    bos_id = None
    eos_id = EOS
    bos_token = None
    eos_token = "<eos>"
    add_bos = False
    stop_ids = frozenset({EOS})
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's spelling (a draft model's tokenizer must spell every id the same)."""
        return f"<{token_id}>" if 0 <= token_id < self.vocab_size else None


def hf_tiny(arch: str, seed: int = 0, layers: int = 2, max_pos: int = 2048, vocab: int = VOCAB,
            head_dim: int | None = None):
    """A transformers model with random weights, fp32, eval mode (`vocab`: another tokenizer's size, for tests
    that put a real tokenizer on a tiny model; `head_dim`: another than 16, e.g. 32 for --kv-dtype q8_0, whose
    rows need a multiple of 32)."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=(arch != "llama"))
    if head_dim is not None:
        common["head_dim"] = head_dim
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**{"head_dim": 16, **common})
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    # random init leaves norms at 1 and biases at 0: perturb them so those code paths are exercised
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(4.0)  # sharper distributions: greedy decoding is less degenerate
    return model


def tiny_loaded(arch: str, seed: int = 0, **kw) -> tuple[object, LoadedModel]:
    hf = hf_tiny(arch, seed, **kw)
    c = hf.config
    cfg = ModelConfig(arch=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                      intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
                      num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      rope_theta=10000.0, rms_norm_eps=c.rms_norm_eps,
                      max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings, qkv_bias=(arch == "qwen2"),
                      qk_norm=(arch == "qwen3"))
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    sha = hashlib.sha256(f"{arch}:{seed}".encode()).hexdigest()
    return hf, LoadedModel(cfg, weights, ByteTokenizer(), None, sha, Path("tiny"))


def tiny_engine(arch: str = "llama", seed: int = 0, head_dim: int | None = None, **engine_kw):
    """`head_dim`: hf_tiny's; engine_kw: Engine's (kv_dtype="q8_0" wants head_dim=32)."""
    from ternlm.engine.core import Engine
    hf, loaded = tiny_loaded(arch, seed, **({} if head_dim is None else {"head_dim": head_dim}))
    engine_kw.setdefault("dtype", torch.float32)
    return hf, Engine(loaded, **engine_kw)
