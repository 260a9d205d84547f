"""Load a local Hugging Face folder (config.json + *.safetensors + tokenizer files) into a LoadedModel.

Only safetensors are read: .bin checkpoints are pickles and are never opened.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import torch
from safetensors import safe_open

from .config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError
from .families import FAMILIES
from ..text.tokenizer import Tokenizer
from . import lfm2, nemotron_h
from .recurrent.deltanet import fused_rows
from .loaded import LoadedModel
from .param_check import require_exactly
from .registry import cached_sha256
from .rope import Rope, rotary_row_order
from .templates import with_builtin_template

log = logging.getLogger(__name__)

# Each family's conventions in config.json and its checkpoints: models/families.py (FAMILIES[arch].hf_*).
# `architectures` entries we accept when `model_type` is absent or unfamiliar (Family.hf_classes).
_ARCH_CLASSES = {cls: arch for arch, family in FAMILIES.items() for cls in family.hf_classes}
# config.json's model_type -> ours, where they differ (Family.hf_model_types)
_MODEL_TYPES = {model_type: arch for arch, family in FAMILIES.items() for model_type in family.hf_model_types}
# Gemma's and the qwen35 family's checkpoints store each RMSNorm weight as an offset from 1 (Family.hf_norms_from_one):
# 1 added at load, but to these
_NORMS_AS_THEY_ARE = ("linear_attn.norm.weight",)     # qwen35's (qwen3next's) gated RMSNorm: x * w (transformers' own)
# qwen35's (qwen35moe's) gated DeltaNet layers (models/deltanet.py), in place of self_attn.*
_DELTANET_PARAMS = {f"linear_attn.{n}" for n in ("dt_bias", "A", "conv1d.weight", "norm.weight", "out_proj.weight",
                                                   "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                                   "in_proj_a.weight")}
# qwen3next's fused DeltaNet projections, split into the ones above by deltanet.fused_rows
_DELTANET_FUSED = {"linear_attn.in_proj_qkvz.weight": "in_proj_qkvz", "linear_attn.in_proj_ba.weight": "in_proj_ba"}
_HF_KINDS = {"linear_attention": "deltanet", "full_attention": "attention"}
_POST_NORM_PARAMS = {"pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"}
# Fused checkpoints (phi3) -> the llama layout the engine runs: (fused name, [(part, share of rows)])
_FUSED = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}

_LAYER_PARAMS = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
_BIAS_PARAMS = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
_QK_NORM_PARAMS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
_MOE_LAYER_PARAMS = {"mlp.gate.weight"}     # + mlp.experts.{e}.{gate,up,down}_proj.weight per expert
_SHARED_PARAMS = {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                  "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight"}   # qwen2moe, qwen35moe
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Mixtral checkpoints: block_sparse_moe.{gate, experts.{e}.w1 (gate) / w3 (up) / w2 (down)}
_MIXTRAL_RE = re.compile(r"block_sparse_moe\.(gate|experts\.(\d+)\.w([123]))\.weight")
_MIXTRAL_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
# Buffers some old checkpoints saved alongside the weights; recomputed by the engine, so skipped. mtp.*: the
# multi-token-prediction block of Qwen3-Next / Qwen3.5 checkpoints, which transformers skips too (not run here).
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq|(model\.)?mtp\..*")


# Vision-language checkpoints (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration,
# Gemma3ForConditionalGeneration: the Hub's Qwen3.5 and Gemma 3 >= 4B folders): the language model's weights
# under one of these prefixes, the vision tower's and projector's under the others, not run here (text only).
_LANGUAGE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head."))
_VISION_RE = re.compile(r"(model\.)?(visual|vision_tower|multi_modal_projector|vision_model|embed_vision)\..*")


def text_part(cfg: dict) -> dict:
    """config.json -> the language model's config: a vision-language config's `text_config` (its
    `tie_word_embeddings` from the outer config, whose lm_head it is), any other config as it is. Pure."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or not any(a.endswith("ForConditionalGeneration")
                                             for a in cfg.get("architectures") or ()):
        return cfg
    out = dict(text)
    if "tie_word_embeddings" in cfg:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    out.setdefault("architectures", [])
    return out


def run_name(stored: str, vision_language: bool) -> str | None:
    """A checkpoint parameter's name as the text model runs it (a vision-language checkpoint's language model
    prefix dropped), or None for what is not loaded: the vision tower and projector, the MTP block, rotary
    buffers (_IGNORED_RE). Pure."""
    name = stored
    if vision_language:
        for prefix, ours in _LANGUAGE_PREFIXES:
            if stored.startswith(prefix):
                name = ours + stored[len(prefix):]
                break
        else:
            if _VISION_RE.fullmatch(stored):
                return None
    return None if _IGNORED_RE.fullmatch(name) else name


def _arch(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    model_type = _MODEL_TYPES.get(model_type, model_type)
    if model_type in SUPPORTED_ARCHS:
        return model_type
    for cls in cfg.get("architectures") or ():
        if cls in _ARCH_CLASSES:
            return _ARCH_CLASSES[cls]
    raise UnsupportedModelError(
        f"model_type {model_type!r} / architectures {cfg.get('architectures')!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHS)}"
    )


def _rope(cfg: dict, head_dim: int) -> tuple[float, Rope | None]:
    """(rope_theta, the RoPE variant or None for plain). transformers >= 5 writes ``rope_parameters``;
    older configs have top-level ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``."""
    params = dict(cfg.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        # Per-layer-type rope (sliding + full attention models): not an architecture we run.
        raise UnsupportedModelError(f"per-layer rope parameters {sorted(params)} are not supported")
    scaling = dict(cfg.get("rope_scaling") or {})

    def kind_of(d: dict) -> str:
        return d.get("rope_type", d.get("type")) or "default"
    # a scaled kind in either place wins over a default one in the other
    kind = kind_of(scaling) if kind_of(scaling) != "default" else kind_of(params)
    spec = {**params, **scaling} if kind_of(scaling) != "default" else {**scaling, **params}
    theta = float(spec.get("rope_theta", params.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    partial = float(spec.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary = int(head_dim * partial) if partial != 1.0 else 0
    original = int(spec.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 0))
    attn = spec.get("attention_factor")
    common = dict(theta=theta, rotary_dim=rotary, attention_factor=None if attn is None else float(attn))
    try:
        if kind == "default":
            return theta, (Rope(**common) if rotary else None)
        if kind == "linear":
            return theta, Rope(kind="linear", factor=float(spec["factor"]), **common)
        if kind == "llama3":
            return theta, Rope(kind="llama3", factor=float(spec["factor"]), original_context=original,
                               low_freq_factor=float(spec["low_freq_factor"]),
                               high_freq_factor=float(spec["high_freq_factor"]), **common)
        if kind == "yarn":
            if spec.get("mscale") or spec.get("mscale_all_dim") or spec.get("truncate") is False:
                raise UnsupportedModelError("yarn with mscale/mscale_all_dim/truncate=false is not supported")
            return theta, Rope(kind="yarn", factor=float(spec["factor"]), original_context=original,
                               beta_fast=float(spec.get("beta_fast") or 32), beta_slow=float(spec.get("beta_slow") or 1),
                               **common)
        if kind == "longrope":
            factor = spec.get("factor") or int(cfg["max_position_embeddings"]) / original
            return theta, Rope(kind="longrope", factor=float(factor), original_context=original,
                               freq_factors=tuple(map(float, spec["short_factor"])),
                               long_factors=tuple(map(float, spec["long_factor"])), **common)
    except (KeyError, ValueError) as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"rope scaling {kind!r}: {e!r} in config.json") from None
    raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn, longrope)")


def config_from_hf(cfg: dict, param_names: set[str]) -> ModelConfig:
    """config.json (as a dict) + the checkpoint's parameter names -> ModelConfig.

    Bias and q/k-norm flags come from the parameters actually present: they are the truth the
    engine must run (e.g. qwen2 always has q/k/v bias though its config has no key for it).
    """
    arch = _arch(cfg)
    family = FAMILIES[arch]
    if family.kinds == "gemma3":
        return _gemma3_config(cfg, param_names)
    if family.kinds == "deltanet":
        return _qwen35_config(cfg, param_names, arch)
    if family.layout == "nemotron_h":   # one block a layer: models/nemotron_h.py
        return nemotron_h.config_from_hf(cfg)
    if family.layout == "lfm2":         # short convs beside attention: models/lfm2.py
        return lfm2.config_from_hf(cfg, _rope)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rope = _rope(cfg, head_dim)
    context = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window") if family.hf_window_caps_context else None
    if window and int(window) < context:
        # every layer windowed (Mistral 7B v0.1, Phi-3-mini-4k): within the window attention is
        # full, so the model runs exactly up to it; beyond needs windowed attention (issue 37)
        log.warning("%s: sliding window %d < context %d; context limited to %d", arch, window, context, window)
        context = int(window)
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=context,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in param_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in param_names,
        qk_norm_full=family.qk_norm_full and "model.layers.0.self_attn.q_norm.weight" in param_names,
        rope=rope,
        **_moe_from_hf(cfg, arch),
    )


def _qwen35_config(cfg: dict, param_names: set[str], arch: str) -> ModelConfig:
    """Qwen3.5 text (Qwen3_5TextConfig): layer_types' linear_attention layers are gated DeltaNet, the
    full_attention ones qwen3's attention with an output gate (q_proj holds each head's q and gate rows) and
    partial RoPE (rope_parameters' partial_rotary_factor, default 0.25); norms x * (1 + w) (1 added at load);
    text positions only (mrope's three sections coincide for text). Qwen3.5-MoE (Qwen3_5MoeTextConfig, arch
    qwen35moe): the same layers with experts and a shared expert on every one (_moe_from_hf); it has no dense
    intermediate_size, so the config's is the experts'. Qwen3-Next (Qwen3NextConfig, arch qwen3next): the same
    again but for its fused in_proj_qkvz / in_proj_ba (split at load: to_llama_layout) and its router's
    norm_topk_prob; its intermediate_size is the dense MLP's of mlp_only_layers, refused by _moe_from_hf."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    n = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types") or ["full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0
                                       else "linear_attention" for i in range(n)]
    if any(k not in _HF_KINDS for k in kinds):
        raise UnsupportedModelError(f"layer types {sorted(set(kinds) - set(_HF_KINDS))} are not supported")
    params = dict(cfg.get("rope_parameters") or {})
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    params.pop("mrope_section", None)
    params.pop("mrope_interleaved", None)
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rope = _rope({**cfg, "rope_parameters": params}, head_dim)
    attn = [i for i, k in enumerate(kinds) if k == "full_attention"]
    first = f"model.layers.{attn[0] if attn else 0}.self_attn."
    moe = _moe_from_hf(cfg, arch)
    return ModelConfig(
        arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or moe.get("expert_intermediate_size", 0)), num_layers=n,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim, rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=first + "q_proj.bias" in param_names, qk_norm=first + "q_norm.weight" in param_names, rope=rope,
        layer_kinds=tuple(_HF_KINDS[k] for k in kinds), attn_output_gate=True,
        linear_key_heads=int(cfg["linear_num_key_heads"]), linear_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_dim=int(cfg["linear_key_head_dim"]), linear_value_dim=int(cfg["linear_value_head_dim"]),
        linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)), **moe)


def _gemma3_config(cfg: dict, param_names: set[str]) -> ModelConfig:
    """Gemma 3 text (Gemma3TextConfig): windows from layer_types (or sliding_window_pattern, default
    every 6th layer global), RoPE per layer type (transformers 5's rope_parameters by layer type, or the
    older rope_theta + rope_local_base_freq + rope_scaling on the global layers), query scale
    query_pre_attn_scalar ** -0.5, GeGLU, embeddings times sqrt(hidden), post-attention/-MLP norms."""
    if cfg.get("attn_logit_softcapping"):
        raise UnsupportedModelError("attention logit soft-capping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"activation {act!r} is not supported for gemma3 (only gelu_pytorch_tanh)")
    hidden, heads, layers = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or 256)
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(cfg.get("sliding_window_pattern") or 6) else "full_attention"
        for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types} are not {layers} sliding/full attention layers")
    params = dict(cfg.get("rope_parameters") or {})
    context = int(cfg.get("max_position_embeddings", 131072))
    if isinstance(params.get("full_attention"), dict):
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:                                        # transformers 4.x config.json
        full = {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    full.setdefault("rope_theta", 1e6)
    local.setdefault("rope_theta", 10000.0)
    theta, rope = _rope({"rope_parameters": full, "max_position_embeddings": context}, head_dim)
    local_theta, local_rope = _rope({"rope_parameters": local, "max_position_embeddings": context}, head_dim)
    window = int(cfg.get("sliding_window") or 4096)
    final_cap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        arch="gemma3", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim, rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_position_embeddings=context,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in param_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in param_names,
        rope=rope,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        swa_rope=local_rope or Rope(theta=local_theta),
        post_norms="model.layers.0.post_feedforward_layernorm.weight" in param_names,
        mlp_act="gelu_tanh", embed_scale=hidden ** 0.5,
        query_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        final_logit_softcap=float(final_cap or 0.0),
    )


def _moe_from_hf(cfg: dict, arch: str) -> dict:
    """ModelConfig's expert fields; {} for a dense model. qwen3moe, qwen2moe, qwen35moe, qwen3next:
    moe_intermediate_size and norm_topk_prob (transformers' default False, qwen3next's True; qwen35moe's router
    always renormalises and has no such field), qwen2moe's, qwen35moe's and qwen3next's shared expert of
    shared_expert_intermediate_size; olmoe:
    intermediate_size wide experts, norm_topk_prob (default False); Mixtral: intermediate_size wide, always
    renormalised. Every layer must be sparse (decoder_sparse_step 1, no mlp_only_layers); olmoe's clip_qkv
    is not run."""
    family = FAMILIES[arch]
    count = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if family.hf_experts else 0
    if not count:
        return {}
    if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedModelError("dense MLP layers among the expert layers (decoder_sparse_step, "
                                    "mlp_only_layers) are not supported")
    if cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"clip_qkv {cfg['clip_qkv']} is not supported")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family.hf_shared_expert else 0
    if cfg.get("shared_expert_intermediate_size") and not shared:
        with_shared = [a for a, f in FAMILIES.items() if f.hf_shared_expert]
        raise UnsupportedModelError(f"shared experts are supported for {', '.join(with_shared)} only, not {arch}")
    return dict(num_experts=count, experts_per_token=int(cfg["num_experts_per_tok"]),
                expert_intermediate_size=int(cfg[family.hf_expert_width]),
                # the router renormalises whatever the config says (hf_topk_renormed), or per it (its class's default)
                norm_topk_prob=True if family.hf_topk_renormed
                else bool(cfg.get("norm_topk_prob", family.hf_norm_topk_default)),
                shared_expert_intermediate_size=shared)


def _check_params(names: set[str], config: ModelConfig) -> None:
    """Exactly the parameters this engine runs: unknown ones (o_proj bias, MoE...) mean an
    unsupported variant; missing ones mean a broken checkpoint."""
    layout = FAMILIES[config.arch].layout
    if layout == "nemotron_h":
        return nemotron_h.check_params(names, config)
    if layout == "lfm2":
        return lfm2.check_params(names, config)
    per_layer = set(_LAYER_PARAMS)
    if config.num_experts:
        per_layer = {p for p in per_layer if not p.startswith("mlp.")} | _MOE_LAYER_PARAMS | {
            f"mlp.experts.{e}.{n}_proj.weight" for e in range(config.num_experts) for n in ("gate", "up", "down")}
        if config.shared_expert_intermediate_size:
            per_layer |= _SHARED_PARAMS
    if config.qkv_bias:
        per_layer |= _BIAS_PARAMS
    if config.qk_norm:
        per_layer |= _QK_NORM_PARAMS
    if config.post_norms:
        per_layer |= _POST_NORM_PARAMS
    if config.attn_output_gate:
        per_layer.add("self_attn.gate_proj.weight")            # split from q_proj by to_llama_layout
    recurrent = {p for p in per_layer if not p.startswith("self_attn.")} | _DELTANET_PARAMS
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}" for i in range(config.num_layers)
                 for p in (recurrent if config.kind(i) == "deltanet" else per_layer)}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    require_exactly(names, expected, optional)


def to_llama_layout(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The layout the engine runs: fused projections (phi3's qkv_proj, gate_up_proj) split into
    q/k/v and gate/up by rows, and with partial rotary each head's q/k rows (and q/k norm entries)
    reordered for the kernels' RoPE (rope.rotary_row_order). Returns a new dict; tensors not
    touched are shared."""
    family = FAMILIES[config.arch]
    if family.layout == "nemotron_h":
        return nemotron_h.to_engine_layout(weights, config)
    if family.layout == "lfm2":
        return lfm2.to_engine_layout(weights, config)
    d, H, KV = config.head_dim, config.num_heads, config.num_kv_heads
    sizes = {"q_proj": H * d, "k_proj": KV * d, "v_proj": KV * d}
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if family.hf_norms_from_one and name.endswith("norm.weight") and not name.endswith(_NORMS_AS_THEY_ARE):
            w = (w.float() + 1.0).to(w.dtype)      # x * (1 + w) -> x * w', as the reference adds in fp32
        m = _LAYER_RE.fullmatch(name)
        if m and m.group(2) == "linear_attn.A_log":   # the decay rate -exp(A_log), as llama.cpp's converter stores it
            out[name.removesuffix("_log")] = -w.float().exp()
            continue
        if m and m.group(2) in _DELTANET_FUSED:     # qwen3next: per-key-head interleaved -> qwen35's four projections
            base = name[: -len(m.group(2))] + "linear_attn."
            parts = fused_rows(config, _DELTANET_FUSED[m.group(2)])
            if sum(r.numel() for r in parts.values()) != w.shape[0]:
                raise UnsupportedModelError(f"{name} has {w.shape[0]} rows, expected "
                                            f"{sum(r.numel() for r in parts.values())}")
            for part, rows in parts.items():
                out[f"{base}{part}.weight"] = w[rows].contiguous()
            continue
        if m and config.attn_output_gate and m.group(2) == "self_attn.q_proj.weight":
            # qwen35: each head's q rows then its gate rows, (H, 2 D, hidden) -> q_proj and gate_proj
            per_head = w.reshape(H, 2 * d, -1)
            out[name] = per_head[:, :d].reshape(H * d, -1).contiguous()
            out[name[: -len(m.group(2))] + "self_attn.gate_proj.weight"] = per_head[:, d:].reshape(H * d, -1).contiguous()
            continue
        if m and config.num_experts and _moe_layout(out, name[: -len(m.group(2))], m.group(2), w, config):
            continue
        fused = _FUSED.get(m.group(2)) if m else None
        if fused is None:
            out[name] = w
            continue
        base = name[: -len(m.group(2))] + m.group(2).split(".")[0] + "."
        rows = [sizes[p] for p in fused] if "q_proj" in fused else [w.shape[0] // 2] * 2
        if sum(rows) != w.shape[0]:
            raise UnsupportedModelError(f"{name} has {w.shape[0]} rows, expected {sum(rows)}")
        for part, piece in zip(fused, torch.split(w, rows)):
            out[f"{base}{part}.weight"] = piece.contiguous()
    rd = config.rope_spec.rotary_dim
    if rd:
        for name in list(out):
            m = _LAYER_RE.fullmatch(name)
            kind = m.group(2) if m else ""
            if kind.startswith(("self_attn.q_proj.", "self_attn.k_proj.")):
                heads = H if "q_proj" in kind else KV
                out[name] = out[name][rotary_row_order(heads, d, rd)]
            elif kind in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                out[name] = out[name][rotary_row_order(1, d, rd)]
    return out


def _moe_layout(out: dict[str, torch.Tensor], prefix: str, param: str, w: torch.Tensor,
                config: ModelConfig) -> bool:
    """One expert parameter -> the engine's per-expert names (mlp.gate.weight,
    mlp.experts.{e}.{gate,up,down}_proj.weight) in `out`; False when `param` is not one to rename.
    Mixtral's block_sparse_moe.* names, and transformers 5's stacked tensors: experts.gate_up_proj
    (E, 2 I, hidden), gate rows first, and experts.down_proj (E, hidden, I)."""
    m = _MIXTRAL_RE.fullmatch(param)
    if m:
        name = "mlp.gate.weight" if m.group(1) == "gate" else f"mlp.experts.{m.group(2)}.{_MIXTRAL_W[m.group(3)]}.weight"
        out[prefix + name] = w
        return True
    if param in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        E, I = config.num_experts, config.expert_intermediate_size
        want = (E, 2 * I, config.hidden_size) if param.endswith("gate_up_proj") else (E, config.hidden_size, I)
        if tuple(w.shape) != want:
            raise UnsupportedModelError(f"{prefix}{param} has shape {tuple(w.shape)}, expected {want}")
        for e in range(E):
            if param.endswith("gate_up_proj"):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = w[e, :I]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = w[e, I:]
            else:
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = w[e]
        return True
    return False


def _safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        found_bin = any(folder.glob("*.bin"))
        raise UnsupportedModelError(
            f"{folder} has no *.safetensors files"
            + (" (only .bin pickles, which are never loaded; convert them to safetensors)" if found_bin else "")
        )
    return files


def load_hf_folder(path: str | os.PathLike[str], dtype: torch.dtype) -> LoadedModel:
    """Read config.json, every *.safetensors shard and the tokenizer files of a local folder.

    Side effects: logs what is loading and the time taken (logger ``ternlm.models.hf``); hashes the
    safetensors files (sorted by name, cached by path+size+mtime in the ternlm cache dir).
    """
    folder = Path(path)
    t0 = time.perf_counter()
    raw_config = (folder / "config.json").read_bytes()
    outer = json.loads(raw_config)
    cfg = text_part(outer)
    vision_language = cfg is not outer
    _arch(cfg)  # fail on an unsupported architecture before touching gigabytes of weights
    files = _safetensors_files(folder)
    log.info("loading %s: %s, %d safetensors file(s) -> %s%s", folder, cfg.get("model_type"), len(files), dtype,
             " (the language model of a vision-language checkpoint: text only)" if vision_language else "")

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as st:
            for stored in st.keys():
                name = run_name(stored, vision_language)
                if name is None:
                    continue
                if name in weights:
                    raise UnsupportedModelError(f"parameter {name} appears in more than one shard ({file.name})")
                weights[name] = st.get_tensor(stored).to(dtype)
    t_weights = time.perf_counter()

    config = config_from_hf(cfg, set(weights))
    weights = to_llama_layout(weights, config)
    _check_params(set(weights), config)
    tokenizer = Tokenizer.from_hf_folder(folder)
    t_tok = time.perf_counter()
    digest = cached_sha256(files)
    t_end = time.perf_counter()
    log.info("loaded %s in %.2fs (weights %.2fs, tokenizer %.2fs, sha256 %.2fs)", folder.name,
             t_end - t0, t_weights - t0, t_tok - t_weights, t_end - t_tok)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=with_builtin_template(config.arch, getattr(tokenizer, "chat_template", None)),
                       sha256=digest, source=folder,
                       extra_sha256=hashlib.sha256(raw_config).hexdigest())
