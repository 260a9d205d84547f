"""Writes a tiny transformers model as a GGUF the way llama.cpp's converter lays it out, for parity
tests: the oracle is the transformers model itself, run on exactly the weights the file holds.

What the converter does that a loader must undo, reproduced from its documented behaviour:
  - llama (and mistral) q/k rows in rotate-every-two order (`converter_permute`);
  - phi3: q/k/v fused as attn_qkv, gate/up fused as ffn_up (gate first), longrope factors as the
    tensors rope_factors_short/long, partial rotary as rope.dimension_count;
  - Llama 3.1 rope: the llama3 rule precomputed as one divisor per frequency (rope_freqs.weight);
  - qwen3's q/k RMSNorms as attn_q_norm / attn_k_norm;
  - mixture of experts (qwen3moe, Mixtral as a llama file): the router as ffn_gate_inp (kept F32, as
    llama.cpp's quantizer does), each expert matrix stacked into one 3-D tensor ffn_{gate,up,down}_exps
    (torch (E, rows, in)), and {arch}.expert_count / expert_used_count / expert_feed_forward_length;
  - qwen2moe's shared expert as ffn_{gate,up,down}_shexp, its gate (1, hidden) as ffn_gate_inp_shexp
    (kept F32: GGUF [hidden, 1], which llama.cpp reads as its {n_embd}), expert_shared_feed_forward_length;
    expert_weights_norm written only where it differs from what llama.cpp runs for the architecture
    (qwen3moe: normalised; qwen2moe and olmoe: not); olmoe's full-width q/k norms as attn_q/k_norm;
  - gemma3: every RMSNorm weight stored as 1 + w (the converter's norm_shift: HF applies x * (1 + w)),
    post_attention_norm / ffn_norm (= pre_feedforward_layernorm) / post_ffw_norm, the window as
    attention.sliding_window with the 5:1 layer pattern left implicit (written as
    attention.sliding_window_pattern only when the model's layer_types differ from it), the global
    layers' rope base (and linear scaling) as the file's rope, no output.weight (tied).
With `quant=QT.Q8_0` the projection matrices are stored quantized and the transformers model's own
weights are replaced by the dequantized values, so both sides run the same numbers.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

from test_loaders import _add_tokenizer


def converter_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter on llama Q/K rows: reshape(heads, 2, rows/2, ...).swapaxes(1, 2)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return inv


def llama3_rope_factors(theta: float, dim: int, rs: dict) -> list[float]:
    """One divisor per frequency, as the converter precomputes Llama 3.1's rule into rope_freqs."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(hf, path: Path, gguf_arch: str, quant: QT | None = None) -> None:
    """hf: a transformers *ForCausalLM (fp32, random). Side effect: with `quant`, hf's projection
    weights become the dequantized values of what the file holds."""
    c = hf.config
    H, KV = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    rp = dict(getattr(c, "rope_parameters", None) or {})
    gemma = gguf_arch == "gemma3"
    if isinstance(rp.get("full_attention"), dict):      # per layer type (gemma3): the file's rope is the global one
        rp = dict(rp["full_attention"])
    partial = float(rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0)
    w = GGUFWriter(path, gguf_arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(int(d * partial))
    theta = float(rp.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if gemma:
        w.add_sliding_window(int(c.sliding_window))
        windowed = [t == "sliding_attention" for t in c.layer_types]
        if windowed != [(i + 1) % 6 != 0 for i in range(c.num_hidden_layers)]:
            w.add_sliding_window_pattern(windowed)
        if getattr(c, "final_logit_softcapping", None):
            w.add_final_logit_softcapping(float(c.final_logit_softcapping))
    moe = "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    if moe:
        E, I = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].shape[:2]
        w.add_expert_count(int(E))
        w.add_expert_used_count(int(c.num_experts_per_tok))
        if gguf_arch in ("qwen3moe", "qwen2moe"):
            w.add_expert_feed_forward_length(int(I) // 2)
        if gguf_arch == "qwen3moe" and not c.norm_topk_prob:
            w.add_expert_weights_norm(False)
        if gguf_arch in ("qwen2moe", "olmoe") and c.norm_topk_prob:
            w.add_expert_weights_norm(True)
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(int(c.shared_expert_intermediate_size))
    _add_tokenizer(w, c.vocab_size)
    kind = rp.get("rope_type", "default")
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", np.array(llama3_rope_factors(theta, d, rp), dtype=np.float32))
    elif kind in ("linear", "yarn"):
        w.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
    elif kind == "longrope":
        original = int(rp["original_max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rp["short_factor"], dtype=np.float32))

    sd = hf.state_dict()
    replaced: dict[str, torch.Tensor] = {}

    def matrix(gguf_name: str, hf_names: list[str], permute_heads: list[int | None]) -> None:
        parts = []
        for n, heads in zip(hf_names, permute_heads):
            t = sd[n].float()
            parts.append(converter_permute(t, heads) if heads else t)
        stored = torch.cat(parts) if len(parts) > 1 else parts[0]
        if quant is None:
            w.add_tensor(gguf_name, stored.numpy())
            return
        raw = np_quantize(stored.numpy(), quant)
        w.add_tensor(gguf_name, raw, raw_dtype=quant)
        back = torch.from_numpy(np_dequantize(raw, quant).copy()).reshape(stored.shape)
        for n, heads, piece in zip(hf_names, permute_heads, torch.split(back, [sd[n].shape[0] for n in hf_names])):
            if heads:   # undo the converter's row order: rows commute with per-row quantization
                order = converter_permute(torch.arange(piece.shape[0]), heads)
                piece = piece[_inverse(order)]
            replaced[n] = piece

    def stacked(gguf_name: str, t: torch.Tensor) -> torch.Tensor:
        """A 3-D (E, rows, in) expert tensor; returns the numbers the file holds."""
        t = t.float().contiguous()
        if quant is None:
            w.add_tensor(gguf_name, t.numpy())
            return t
        raw = np_quantize(t.numpy(), quant)       # blocks along `in`: each expert a slab of whole rows
        w.add_tensor(gguf_name, raw, raw_dtype=quant)
        return torch.from_numpy(np_dequantize(raw, quant).copy()).reshape(t.shape)

    def vector(gguf_name: str, hf_name: str) -> None:
        t = sd[hf_name].float()
        w.add_tensor(gguf_name, (t + 1.0 if gemma and hf_name.endswith("norm.weight") else t).numpy())

    llama = gguf_arch == "llama"
    matrix("token_embd.weight", ["model.embed_tokens.weight"], [None])
    vector("output_norm.weight", "model.norm.weight")
    if not c.tie_word_embeddings:
        matrix("output.weight", ["lm_head.weight"], [None])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        vector(b + "attn_norm.weight", p + "input_layernorm.weight")
        if gemma:       # 4 norms a layer: ffn_norm is the MLP's pre-norm
            vector(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")
            vector(b + "ffn_norm.weight", p + "pre_feedforward_layernorm.weight")
            vector(b + "post_ffw_norm.weight", p + "post_feedforward_layernorm.weight")
        else:
            vector(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
        if p + "self_attn.q_norm.weight" in sd:      # qwen3 / qwen3moe; olmoe's span the whole projection
            vector(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight")
            vector(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight")
        if gguf_arch == "phi3":
            q, k, v = sd[p + "self_attn.qkv_proj.weight"].split([H * d, KV * d, KV * d])
            g, u = sd[p + "mlp.gate_up_proj.weight"].chunk(2)
            sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                       p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": g, p + "mlp.up_proj.weight": u})
            matrix(b + "attn_qkv.weight", [p + f"self_attn.{n}_proj.weight" for n in "qkv"], [None] * 3)
            matrix(b + "ffn_up.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [None, None])
        else:
            matrix(b + "attn_q.weight", [p + "self_attn.q_proj.weight"], [H if llama else None])
            matrix(b + "attn_k.weight", [p + "self_attn.k_proj.weight"], [KV if llama else None])
            matrix(b + "attn_v.weight", [p + "self_attn.v_proj.weight"], [None])
            if not moe:
                matrix(b + "ffn_gate.weight", [p + "mlp.gate_proj.weight"], [None])
                matrix(b + "ffn_up.weight", [p + "mlp.up_proj.weight"], [None])
            for n in "qkv":
                if p + f"self_attn.{n}_proj.bias" in sd:
                    w.add_tensor(b + f"attn_{n}.bias", sd[p + f"self_attn.{n}_proj.bias"].float().numpy())
        matrix(b + "attn_output.weight", [p + "self_attn.o_proj.weight"], [None])
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", sd[p + "mlp.gate.weight"].float().numpy())
            gu = sd[p + "mlp.experts.gate_up_proj"]                   # (E, 2 I, hidden), gate rows first
            half = gu.shape[1] // 2
            g = stacked(b + "ffn_gate_exps.weight", gu[:, :half])
            u = stacked(b + "ffn_up_exps.weight", gu[:, half:])
            down = stacked(b + "ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"])
            if quant is not None:
                replaced[p + "mlp.experts.gate_up_proj"] = torch.cat([g, u], dim=1)
                replaced[p + "mlp.experts.down_proj"] = down
            if p + "mlp.shared_expert_gate.weight" in sd:     # qwen2moe
                for n in ("gate", "up", "down"):
                    matrix(b + f"ffn_{n}_shexp.weight", [p + f"mlp.shared_expert.{n}_proj.weight"], [None])
                w.add_tensor(b + "ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"].float().numpy())
        else:
            matrix(b + "ffn_down.weight", [p + "mlp.down_proj.weight"], [None])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    if replaced:       # the transformers model now holds exactly the file's (dequantized) numbers
        with torch.no_grad():
            params = dict(hf.named_parameters())
            for i in range(c.num_hidden_layers):
                p = f"model.layers.{i}."
                if gguf_arch == "phi3":
                    replaced[p + "self_attn.qkv_proj.weight"] = torch.cat(
                        [replaced.pop(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
                    replaced[p + "mlp.gate_up_proj.weight"] = torch.cat(
                        [replaced.pop(p + "mlp.gate_proj.weight"), replaced.pop(p + "mlp.up_proj.weight")])
            for n, t in replaced.items():
                params[n].copy_(t)
