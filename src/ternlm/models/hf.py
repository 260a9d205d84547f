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

from ..config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError
from ..tokenizer import Tokenizer
from .loaded import LoadedModel
from .registry import cached_sha256

log = logging.getLogger(__name__)

# `architectures` entries we accept when `model_type` is absent or unfamiliar.
_ARCH_CLASSES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

_LAYER_PARAMS = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
_BIAS_PARAMS = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
_QK_NORM_PARAMS = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some old checkpoints saved alongside the weights; recomputed by the engine, so skipped.
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq")


def _arch(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHS:
        return model_type
    for cls in cfg.get("architectures") or ():
        if cls in _ARCH_CLASSES:
            return _ARCH_CLASSES[cls]
    raise UnsupportedModelError(
        f"model_type {model_type!r} / architectures {cfg.get('architectures')!r} is not supported; "
        f"supported: {', '.join(SUPPORTED_ARCHS)}"
    )


def _rope(cfg: dict) -> float:
    """rope_theta, rejecting scaled rope. transformers >= 5 writes ``rope_parameters``; older
    configs have top-level ``rope_theta`` and ``rope_scaling``."""
    params = cfg.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        # Per-layer-type rope (sliding + full attention models): not an architecture we run.
        raise UnsupportedModelError(f"per-layer rope parameters {sorted(params)} are not supported")
    scaling = cfg.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (only unscaled rope)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def config_from_hf(cfg: dict, param_names: set[str]) -> ModelConfig:
    """config.json (as a dict) + the checkpoint's parameter names -> ModelConfig.

    Bias and q/k-norm flags come from the parameters actually present: they are the truth the
    engine must run (e.g. qwen2 always has q/k/v bias though its config has no key for it).
    """
    arch = _arch(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=_rope(cfg),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in param_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in param_names,
    )


def _check_params(names: set[str], config: ModelConfig) -> None:
    """Exactly the parameters this engine runs: unknown ones (o_proj bias, MoE...) mean an
    unsupported variant; missing ones mean a broken checkpoint."""
    per_layer = set(_LAYER_PARAMS)
    if config.qkv_bias:
        per_layer |= _BIAS_PARAMS
    if config.qk_norm:
        per_layer |= _QK_NORM_PARAMS
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in per_layer}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    unknown = sorted(names - expected - optional)
    if unknown:
        raise UnsupportedModelError(f"checkpoint has parameters this engine does not run: {', '.join(unknown[:8])}")
    missing = sorted(expected - names)
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks parameters: {', '.join(missing[:8])}")


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
    cfg = json.loads(raw_config)
    _arch(cfg)  # fail on an unsupported architecture before touching gigabytes of weights
    files = _safetensors_files(folder)
    log.info("loading %s: %s, %d safetensors file(s) -> %s", folder, cfg.get("model_type"), len(files), dtype)

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as st:
            for name in st.keys():
                if _IGNORED_RE.fullmatch(name):
                    continue
                if name in weights:
                    raise UnsupportedModelError(f"parameter {name} appears in more than one shard ({file.name})")
                weights[name] = st.get_tensor(name).to(dtype)
    t_weights = time.perf_counter()

    config = config_from_hf(cfg, set(weights))
    _check_params(set(weights), config)
    tokenizer = Tokenizer.from_hf_folder(folder)
    t_tok = time.perf_counter()
    digest = cached_sha256(files)
    t_end = time.perf_counter()
    log.info("loaded %s in %.2fs (weights %.2fs, tokenizer %.2fs, sha256 %.2fs)", folder.name,
             t_end - t0, t_weights - t0, t_tok - t_weights, t_end - t_tok)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None), sha256=digest, source=folder,
                       extra_sha256=hashlib.sha256(raw_config).hexdigest())
