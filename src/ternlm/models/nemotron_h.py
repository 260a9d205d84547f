"""Nemotron-H (transformers `nemotron_h`, llama.cpp `nemotron_h`): config and weight names, HF folder and GGUF.

Each decoder layer is ONE block behind its own pre-norm and residual, chosen by `layers_block_type`:
  linear_attention -> a Mamba-2 mixer (models/mamba2.py)    full_attention -> attention without RoPE
  mlp -> up -> relu(x)^2 -> down                               moe -> experts (not run here: UnsupportedModelError)
The engine's Layer runs a token mixer then a feed-forward, each optional, so a block is data:
  config.layer_kinds[i] ("mamba2" | "attention" | "none") and config.layer_ffns[i] ("mlp" | "none"). The block's
  norm is the mixer's input norm (input_layernorm) or, on a feed-forward-only layer, the MLP's
  (post_attention_layernorm): the same x * rsqrt(mean(x^2) + eps) * w either way.

Sources: transformers 5's modeling_nemotron_h.py (names model.embeddings, model.layers.i.{norm, mixer.*},
model.norm_f; on disk backbone.* as NVIDIA's checkpoints, which save_pretrained writes back) and llama.cpp's converter (conversion/nemotron.py, via GraniteHybridModel and Mamba2Model):
ssm_in / ssm_out / ssm_conv1d.{weight,bias} / ssm_dt.bias / ssm_a (= -exp(A_log), (H, 1)) / ssm_d ((H, 1)) /
ssm_norm ((G, H P / G)) on Mamba-2 layers, attn_{q,k,v,output} on attention layers, ffn_{up,down} on MLP layers,
attn_norm on every layer; norms stored as they are (x * w). With the transformers 5 configs (which always list
the MoE defaults) the converter names the file `nemotron_h_moe` even without experts: both names load here, and
the kinds come from each layer's tensors. The converter permutes each attention head's q and k rows for RoPE;
with no RoPE that is the same permutation on both sides of q . k, so they are used as stored.
"""
from __future__ import annotations

import re

import torch

from .config import ModelConfig, UnsupportedModelError
from .param_check import require_exactly

_HF_KINDS = {"linear_attention": ("mamba2", "none"), "full_attention": ("attention", "none"), "mlp": ("none", "mlp")}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MAMBA = ("mixer.in_proj.weight", "mixer.out_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.A",
          "mixer.D", "mixer.dt_bias", "mixer.norm.weight")
_ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
_MLP = ("mlp.up_proj.weight", "mlp.down_proj.weight")
# GGUF per-layer names -> the engine's (layer kind: the names it holds)
_GGUF_MAMBA = {"ssm_in.weight": "mixer.in_proj.weight", "ssm_out.weight": "mixer.out_proj.weight",
               "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
               "ssm_a": "mixer.A", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias",
               "ssm_norm.weight": "mixer.norm.weight", "attn_norm.weight": "input_layernorm.weight"}
_GGUF_ATTN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
              "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
              "attn_norm.weight": "input_layernorm.weight"}
_GGUF_MLP = {"ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
             "attn_norm.weight": "post_attention_layernorm.weight"}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _block(cfg: ModelConfig, i: int) -> str:
    """Layer i's one block: "mamba2" | "attention" | "mlp"."""
    return "mlp" if cfg.kind(i) == "none" else cfg.kind(i)


def config_from_hf(cfg: dict) -> ModelConfig:
    """config.json (NemotronHConfig, transformers 5; older hybrid_override_pattern strings too) -> ModelConfig.
    dt's floor: transformers' prefill clamps softplus(dt + bias) at time_step_min (its decode does not)."""
    kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
    if kinds is None and cfg.get("hybrid_override_pattern"):
        kinds = [{"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}[c]
                 for c in cfg["hybrid_override_pattern"]]
    if not kinds or set(kinds) - set(_HF_KINDS):
        raise UnsupportedModelError(f"nemotron_h layer types {sorted(set(kinds or ()) - set(_HF_KINDS))} are not "
                                    f"supported (mixture-of-experts blocks are not run yet)")
    for flag in ("use_bias", "mamba_proj_bias", "mlp_bias", "attention_bias"):
        if cfg.get(flag):
            raise UnsupportedModelError(f"nemotron_h with {flag} is not supported")
    if not cfg.get("use_conv_bias", True):
        raise UnsupportedModelError("nemotron_h without the conv bias (use_conv_bias false) is not supported")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedModelError("nemotron_h: only relu2 MLPs and SiLU Mamba-2 convs are supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelConfig(
        arch="nemotron_h", vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=len(kinds), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), rope_theta=10000.0,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        mlp_act="relu2", no_rope=True,
        layer_kinds=tuple(_HF_KINDS[k][0] for k in kinds), layer_ffns=tuple(_HF_KINDS[k][1] for k in kinds),
        mamba_heads=int(cfg["mamba_num_heads"]), mamba_head_dim=int(cfg["mamba_head_dim"]),
        mamba_state=int(cfg["ssm_state_size"]), mamba_groups=int(cfg.get("n_groups") or cfg.get("mamba_n_groups")),
        mamba_conv_kernel=int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4),
        mamba_dt_min=float(cfg.get("time_step_min", 0.001)))


def to_engine_layout(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' names -> the engine's (model.embed_tokens, model.norm, per layer input_layernorm or
    post_attention_layernorm, self_attn.*, mlp.*, mixer.* with A_log as A = -exp(A_log), as llama.cpp's
    converter stores it). Returns a new dict; tensors not touched are shared."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name.startswith("backbone."):     # NVIDIA's checkpoints (and transformers 5's save_pretrained) say backbone
            name = "model." + name.removeprefix("backbone.")
        m = _LAYER_RE.fullmatch(name)
        if not m:
            out[{"model.embeddings.weight": "model.embed_tokens.weight",
                 "model.norm_f.weight": "model.norm.weight"}.get(name, name)] = w
            continue
        i, part = int(m.group(1)), m.group(2)
        block, base = _block(config, i), f"model.layers.{i}."
        if part == "norm.weight":
            part = "post_attention_layernorm.weight" if block == "mlp" else "input_layernorm.weight"
        elif part == "mixer.A_log":
            part, w = "mixer.A", -w.float().exp()
        elif block == "attention" and part.startswith("mixer."):
            part = "self_attn." + part.removeprefix("mixer.")
        elif block == "mlp" and part.startswith("mixer."):
            part = "mlp." + part.removeprefix("mixer.")
        out[base + part] = w
    return out


def expected_params(config: ModelConfig) -> set[str]:
    """Every engine-named parameter a nemotron_h model of this config has (lm_head unless tied)."""
    per = {"mamba2": (*_MAMBA, "input_layernorm.weight"), "attention": (*_ATTN, "input_layernorm.weight"),
           "mlp": (*_MLP, "post_attention_layernorm.weight")}
    names = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if config.tie_word_embeddings
                                                                  else {"lm_head.weight"})
    return names | {f"model.layers.{i}.{p}" for i in range(config.num_layers) for p in per[_block(config, i)]}


def check_params(names: set[str], config: ModelConfig) -> None:
    """Exactly the parameters this engine runs (a tied checkpoint may still carry lm_head)."""
    require_exactly(names, expected_params(config), {"lm_head.weight"})


def gguf_name(gguf_name: str, config: ModelConfig) -> str | None:
    """A per-layer GGUF tensor name -> the engine's, by the layer's block; None for one it does not know."""
    m = _GGUF_LAYER_RE.fullmatch(gguf_name)
    if not m or int(m.group(1)) >= config.num_layers:
        return None
    table = {"mamba2": _GGUF_MAMBA, "attention": _GGUF_ATTN, "mlp": _GGUF_MLP}[_block(config, int(m.group(1)))]
    name = table.get(m.group(2))
    return None if name is None else f"model.layers.{m.group(1)}.{name}"


def config_from_gguf(field, arch: str, names: dict) -> ModelConfig:
    """GGUF metadata (`field(key, default)`) + tensor presence -> ModelConfig. A layer's block is what its
    tensors are (ssm_in: Mamba-2, attn_q: attention, ffn_up: MLP; expert tensors: not supported); the MLP width
    from ffn_up (the converter's nemotron_h_moe files say 0); dt unclamped (llama.cpp's ssm_scan)."""
    layers = int(field(f"{arch}.block_count"))
    kinds, ffns = [], []
    for i in range(layers):
        has = {k: f"blk.{i}.{k}.weight" in names for k in ("ssm_in", "attn_q", "ffn_up", "ffn_up_exps")}
        if has["ffn_up_exps"] or sum(has.values()) != 1:
            raise UnsupportedModelError(f"{arch} layer {i}: not one Mamba-2, attention or MLP block "
                                        f"(mixture-of-experts blocks are not run yet)")
        kinds.append("mamba2" if has["ssm_in"] else "attention" if has["attn_q"] else "none")
        ffns.append("mlp" if has["ffn_up"] else "none")
    hidden, heads = int(field(f"{arch}.embedding_length")), int(field(f"{arch}.attention.head_count"))
    kv = field(f"{arch}.attention.head_count_kv", heads)
    kv_heads = max(int(x) for x in kv) if isinstance(kv, (list, tuple)) else int(kv)
    up = next((names[f"blk.{i}.ffn_up.weight"] for i in range(layers) if ffns[i] == "mlp"), None)
    H = int(field(f"{arch}.ssm.time_step_rank"))
    eps = field(f"{arch}.attention.layer_norm_rms_epsilon", None)
    vocab = int(names["token_embd.weight"].shape[-1])        # the embedding decides the logits' width
    return ModelConfig(
        arch="nemotron_h", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(up.shape[1]) if up is not None else hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads or heads, head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=10000.0,
        rms_norm_eps=float(eps if eps is not None else field(f"{arch}.attention.layer_norm_epsilon")),
        max_position_embeddings=int(field(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in names, mlp_act="relu2", no_rope=True,
        layer_kinds=tuple(kinds), layer_ffns=tuple(ffns),
        mamba_heads=H, mamba_head_dim=int(field(f"{arch}.ssm.inner_size")) // H,
        mamba_state=int(field(f"{arch}.ssm.state_size")), mamba_groups=int(field(f"{arch}.ssm.group_count")),
        mamba_conv_kernel=int(field(f"{arch}.ssm.conv_kernel")), mamba_dt_min=0.0)


def check_gguf_tensors(names: set[str], config: ModelConfig) -> None:
    """Every tensor one this engine knows, and every layer's block complete."""
    glob = {"token_embd.weight", "output_norm.weight", "output.weight"}
    unknown = sorted(n for n in names if n not in glob and gguf_name(n, config) is None)
    if unknown:
        raise UnsupportedModelError(f"GGUF has tensors this engine does not know: {', '.join(unknown[:8])}")
    want = {"token_embd.weight", "output_norm.weight"}
    for i in range(config.num_layers):
        table = {"mamba2": _GGUF_MAMBA, "attention": _GGUF_ATTN, "mlp": _GGUF_MLP}[_block(config, i)]
        want |= {f"blk.{i}.{n}" for n in table}
    missing = sorted(want - names)
    if missing:
        raise UnsupportedModelError(f"GGUF lacks tensors: {', '.join(missing[:8])}")
