"""LFM2 (transformers `lfm2`, llama.cpp `lfm2`): config and weight names, HF folder and GGUF.

Each layer is a token mixer then a SwiGLU MLP, each behind its RMSNorm (operator_norm, ffn_norm): the mixer is a
gated short convolution (`layer_types` "conv": models/shortconv.py, a recurrent state of K - 1 inputs) or
attention with per-head q/k RMSNorm and full RoPE ("full_attention": qwen3's attention). The final norm is
`embedding_norm` (llama.cpp names it token_embd_norm and applies it at the output too). Embeddings tied by default.
The engine's names: input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj / q_norm / k_norm,
mlp.{gate,up,down}_proj, conv.{in_proj,out_proj,conv}.weight, model.norm.

Sources: transformers 5's modeling_lfm2.py / configuration_lfm2.py (the MLP width adjusted by
block_auto_adjust_ff_dim, block_ffn_dim_multiplier, block_multiple_of) and llama.cpp's converter
(conversion/lfm2.py: LFM2Model, a TextModel: q/k rows as transformers has them, norms as they are, the conv
kernel squeezed to (hidden, K); per-layer head_count_kv 0 on conv layers; shortconv.l_cache). A conv bias
(conv_bias) is refused: LFM2's releases have none.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from .config import ModelConfig, UnsupportedModelError
from .param_check import require_exactly

_HF_KINDS = {"conv": "shortconv", "full_attention": "attention"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# transformers' per-layer names -> the engine's
_HF_NAMES = {"operator_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
             "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
             "feed_forward.w2.weight": "mlp.down_proj.weight", "self_attn.out_proj.weight": "self_attn.o_proj.weight",
             "self_attn.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attn.k_layernorm.weight": "self_attn.k_norm.weight"}
_COMMON = ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
           "mlp.down_proj.weight")
_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight")
_CONV = ("conv.in_proj.weight", "conv.out_proj.weight", "conv.conv.weight")
# GGUF per-layer names -> the engine's
_GGUF_COMMON = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight"}
_GGUF_ATTN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
              "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GGUF_CONV = {"shortconv.in_proj.weight": "conv.in_proj.weight", "shortconv.out_proj.weight": "conv.out_proj.weight",
              "shortconv.conv.weight": "conv.conv.weight"}
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "token_embd_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def mlp_width(cfg: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it from config.json."""
    width = int(cfg.get("block_ff_dim") or cfg["intermediate_size"])
    if cfg.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            width = int(cfg["block_ffn_dim_multiplier"] * width)
            multiple = int(cfg.get("block_multiple_of", 256))
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def config_from_hf(cfg: dict, rope: Callable[[dict, int], tuple]) -> ModelConfig:
    """config.json (Lfm2Config) -> ModelConfig. rope: hf._rope (config, head_dim) -> (theta, Rope or None)."""
    if cfg.get("conv_bias"):
        raise UnsupportedModelError("lfm2 with conv_bias is not supported (LFM2's releases have none)")
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        full = set(cfg.get("full_attn_idxs") or range(n))
        kinds = ["full_attention" if i in full else "conv" for i in range(n)]
    if len(kinds) != n or set(kinds) - set(_HF_KINDS):
        raise UnsupportedModelError(f"lfm2 layer types {sorted(set(kinds) - set(_HF_KINDS))} are not supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 1000000.0))     # Lfm2Config's default_theta
    theta, rope_spec = rope({**cfg, "rope_parameters": params}, head_dim)
    tie = cfg.get("tie_word_embeddings", cfg.get("tie_embedding", True))
    return ModelConfig(
        arch="lfm2", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden, intermediate_size=mlp_width(cfg),
        num_layers=n, num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rope_theta=theta, rms_norm_eps=float(cfg.get("norm_eps", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 128000)), tie_word_embeddings=bool(tie),
        qk_norm=True, rope=rope_spec, layer_kinds=tuple(_HF_KINDS[k] for k in kinds),
        shortconv_kernel=int(cfg.get("conv_L_cache", 3)))


def to_engine_layout(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' names -> the engine's (module docstring); the conv kernel (hidden, 1, K) as (hidden, K).
    Returns a new dict; tensors not touched are shared."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        m = _LAYER_RE.fullmatch(name)
        if not m:
            out["model.norm.weight" if name == "model.embedding_norm.weight" else name] = w
            continue
        part = _HF_NAMES.get(m.group(2), m.group(2))
        if part == "conv.conv.weight":
            w = w.reshape(w.shape[0], -1)
        out[f"model.layers.{m.group(1)}.{part}"] = w
    return out


def expected_params(config: ModelConfig) -> set[str]:
    """Every engine-named parameter an lfm2 model of this config has (lm_head unless tied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if config.tie_word_embeddings
                                                                  else {"lm_head.weight"})
    return names | {f"model.layers.{i}.{p}" for i in range(config.num_layers)
                    for p in _COMMON + (_ATTN if config.kind(i) == "attention" else _CONV)}


def check_params(names: set[str], config: ModelConfig) -> None:
    """Exactly the parameters this engine runs (a tied checkpoint may still carry lm_head)."""
    require_exactly(names, expected_params(config), {"lm_head.weight"})


def gguf_name(gguf_name: str, config: ModelConfig) -> str | None:
    """A GGUF tensor name -> the engine's, by the layer's kind; None for one it does not know."""
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if not m or int(m.group(1)) >= config.num_layers:
        return None
    kind = _GGUF_ATTN if config.kind(int(m.group(1))) == "attention" else _GGUF_CONV
    name = _GGUF_COMMON.get(m.group(2)) or kind.get(m.group(2))
    return None if name is None else f"model.layers.{m.group(1)}.{name}"


def config_from_gguf(field, names: dict) -> ModelConfig:
    """GGUF metadata (`field(key, default)`) + tensor presence -> ModelConfig. A layer is a conv layer where it has
    shortconv.in_proj (the converter also writes head_count_kv 0 there), else attention."""
    layers = int(field("lfm2.block_count"))
    kinds = tuple("shortconv" if f"blk.{i}.shortconv.in_proj.weight" in names else "attention" for i in range(layers))
    hidden, heads = int(field("lfm2.embedding_length")), int(field("lfm2.attention.head_count"))
    kv = field("lfm2.attention.head_count_kv", heads)
    kv_heads = max(int(x) for x in kv) if isinstance(kv, (list, tuple)) else int(kv)
    theta = float(field("lfm2.rope.freq_base", 1000000.0))
    return ModelConfig(
        arch="lfm2", vocab_size=int(names["token_embd.weight"].shape[-1]), hidden_size=hidden,
        intermediate_size=int(field("lfm2.feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads or heads, head_dim=int(field("lfm2.attention.key_length", hidden // heads)),
        rope_theta=theta, rms_norm_eps=float(field("lfm2.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field("lfm2.context_length")),
        tie_word_embeddings="output.weight" not in names, qk_norm=True, layer_kinds=kinds,
        shortconv_kernel=int(field("lfm2.shortconv.l_cache")))


def check_gguf_tensors(names: set[str], config: ModelConfig) -> None:
    """Every tensor one this engine knows, and every layer complete."""
    unknown = sorted(n for n in names if gguf_name(n, config) is None)
    if unknown:
        raise UnsupportedModelError(f"GGUF has tensors this engine does not know: {', '.join(unknown[:8])}")
    want = {"token_embd.weight", "token_embd_norm.weight"}
    for i in range(config.num_layers):
        kind = _GGUF_ATTN if config.kind(i) == "attention" else _GGUF_CONV
        want |= {f"blk.{i}.{n}" for n in (*_GGUF_COMMON, *kind)}
    missing = sorted(want - names)
    if missing:
        raise UnsupportedModelError(f"GGUF lacks tensors: {', '.join(missing[:8])}")
