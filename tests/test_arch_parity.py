"""Architectures beyond plain llama/qwen: RoPE scaling (Llama 3.1's llama3 rule, linear, YaRN, Phi-3's
longrope), partial rotary (Phi-4-mini), phi3's fused layout and mistral files.

Oracles we did not write: transformers' own RoPE functions (inverse frequencies and attention factor,
per kind) and tiny random transformers models, run on exactly the numbers our loaders read: from a
save_pretrained folder, and from a GGUF laid out as llama.cpp's converter does (tests/hf_to_gguf.py),
dense fp32 and quantized (Q8_0 through the native fused layers). Reuse must stay bit-exact on them:
a prompt prefilled in chunks and decoded gives the same logits bits as one pass.
"""
from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.models.rope import Rope, rotary_row_order
from ternlm.engine.weights import choose_weights
from hf_to_gguf import write_gguf
from test_loaders import _save_tokenizer

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
SHORT = [1.0 + 0.15 * i for i in range(8)]          # longrope factors: head_dim 16 -> 8 frequencies
LONG = [1.5 + 0.4 * i for i in range(8)]

# name -> (transformers class names, config kwargs, GGUF architecture)
MODELS = {
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "llama"),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}), "llama"),
    "qwen2-yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128}), "qwen2"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, sliding_window=None,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "phi3"),
    "phi3-longrope-partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, sliding_window=None, partial_rotary_factor=0.75,
        original_max_position_embeddings=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT[:6], "long_factor": LONG[:6],
            "original_max_position_embeddings": 64}), "phi3"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None,
                                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                "llama"),
}


def hf_model(name: str, seed: int = 0):
    import transformers as tf
    cfg_cls, model_cls, kw, _ = MODELS[name]
    cfg = getattr(tf, cfg_cls)(**COMMON, **kw)
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(cfg).float().eval()
    with torch.no_grad():       # norms off 1 and sharper weights: every path and greedy choice matters
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if n.endswith(("norm.weight", ".bias")) else p.mul_(4.0)
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def ids_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- RoPE tables against transformers' own functions ------------------------------------------------

ROPE_CASES = {
    "linear": ({"rope_type": "linear", "factor": 2.5}, Rope(theta=10000.0, kind="linear", factor=2.5)),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64},
               Rope(theta=10000.0, kind="llama3", factor=8.0, original_context=64)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
             Rope(theta=10000.0, kind="yarn", factor=4.0, original_context=128)),
    "yarn-betas": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16,
                    "beta_slow": 2},
                   Rope(theta=10000.0, kind="yarn", factor=8.0, original_context=256, beta_fast=16, beta_slow=2)),
    "longrope": ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 128, "factor": 4.0},
                 Rope(theta=10000.0, kind="longrope", factor=4.0, original_context=128,
                      freq_factors=tuple(SHORT), long_factors=tuple(LONG))),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params, ours = ROPE_CASES[case]
    cfg = tf.LlamaConfig(**COMMON, rope_parameters={"rope_theta": 10000.0, **params})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    short = ours.for_context(100)
    torch.testing.assert_close(short.inv_freq(16), ref, rtol=1e-6, atol=0)
    assert math.isclose(ours.scale(), ref_scale, rel_tol=1e-12)
    if case == "longrope":      # past the original context: the long factors, as transformers' long_inv_freq
        long_ref, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=129)
        torch.testing.assert_close(ours.for_context(129).inv_freq(16), long_ref, rtol=1e-6, atol=0)
        assert short.long_factors is None and short.freq_factors == tuple(SHORT)


def test_default_rope_tables_are_the_plain_ones():
    """The plain rope's tables are bit-identical to the textbook formula (stored KV stays valid)."""
    cos, sin = Rope(theta=1e6).tables(64, 300)
    inv = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    emb = torch.outer(torch.arange(300, dtype=torch.float32), inv).repeat(1, 2)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())


def test_partial_rotary_order_pairs_the_rotated_dims():
    order = rotary_row_order(2, 16, 12)
    assert sorted(order.tolist()) == list(range(32))
    head = order[:16].tolist()
    # kernel pairs (i, i + 8): rotated pairs (j, j + 6) for j < 6, then pass-through dims 12..15
    assert [(head[i], head[i + 8]) for i in range(6)] == [(j, j + 6) for j in range(6)]
    assert sorted(head[6:8] + head[14:16]) == [12, 13, 14, 15]
    cos, sin = Rope(rotary_dim=12, attention_factor=1.3).tables(16, 40)
    assert torch.all(cos[:, 6:8] == 1) and torch.all(sin[:, 6:8] == 0), "pass-through dims: identity, unscaled"


# ---- whole models: HF folder, GGUF dense, GGUF quantized through the native layers ------------------

def _engine(loaded, quantized: bool, ctx: int | None = None) -> Engine:
    if quantized:
        return Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="fp32"), kv_dtype="float32",
                      ctx=ctx)
    return Engine(loaded, dtype=torch.float32, ctx=ctx)


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_folder_matches_transformers(name, tmp_path):
    hf = hf_model(name, seed=3)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    loaded = load_hf_folder(tmp_path, torch.float32)
    assert loaded.config.arch == hf.config.model_type
    engine = _engine(loaded, quantized=False, ctx=60)   # within every original context: short factors
    ids = ids_of(60)
    torch.testing.assert_close(engine.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0-native"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_matches_transformers(name, quantized, tmp_path):
    hf = hf_model(name, seed=5)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, MODELS[name][3], quant=QT.Q8_0 if quantized else None)
    loaded = load_gguf(path, torch.float32, keep_quantized=quantized, lanes=quantized)
    engine = _engine(loaded, quantized)
    if quantized:
        assert engine.model.native is not None, "every layer runs fused in C"
    # past the longrope original context (64/128) so the long factors are the ones in use on both sides
    ids = ids_of(200)
    ours, ref = engine.logits(ids), hf_logits(hf, ids)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 2e-5 * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["llama3-rope", "qwen2-yarn", "phi3-longrope-partial"])
def test_chunked_prefill_and_decode_are_bit_exact(name, tmp_path):
    """[BATCH-INVARIANT] with scaled/partial RoPE: chunks of 7, then decode, give the bits of one pass."""
    hf = hf_model(name, seed=7)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, MODELS[name][3], quant=QT.Q8_0)
    engine = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), quantized=True)
    ids = ids_of(90, seed=2)
    whole = engine.logits(ids)
    engine.runner.chunk_size = 7
    last = engine.runner.prefill(engine.slots[0], ids[:-1])
    assert torch.equal(last, whole[-2])
    assert torch.equal(engine.runner.decode(engine.slots[0], ids[-1]), whole[-1])


def test_longrope_factors_follow_the_context_and_the_namespace(tmp_path):
    """Short factors for a context within the original, long beyond: fixed per engine, and part of the
    KV namespace (a cache built with one set must never serve the other)."""
    hf = hf_model("phi3-longrope-partial")
    path = tmp_path / "phi3.gguf"
    write_gguf(hf, path, "phi3")
    short = _engine(load_gguf(path, torch.float32), quantized=False, ctx=64)
    long = _engine(load_gguf(path, torch.float32), quantized=False, ctx=512)
    assert short.config.rope.freq_factors == pytest.approx(SHORT[:6])
    assert long.config.rope.freq_factors == pytest.approx(LONG[:6])
    assert short.namespace() != long.namespace()
    ids = ids_of(50)
    torch.testing.assert_close(short.logits(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)
