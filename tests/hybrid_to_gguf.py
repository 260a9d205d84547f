"""Writes a tiny transformers Qwen3.5 (qwen35) or Qwen3.5-MoE (qwen35moe) as a GGUF the way llama.cpp's converter
lays it out (the llama-cpp-python 0.3.36 sdist's conversion/qwen.py: Qwen3_5TextModel, Qwen3_5MoeTextModel, run
with --no-mtp), for the hybrid parity tests.

What the converter does that a loader must undo, reproduced from its code's behaviour:
  - every RMSNorm weight stored as 1 + w, but the DeltaNet's gated norm (ssm_norm) as it is;
  - A_log stored as ssm_a = -exp(A_log); dt_bias as ssm_dt.bias; the conv kernel squeezed to (channels, K);
  - in_proj_qkv / in_proj_z / in_proj_b / in_proj_a as attn_qkv / attn_gate / ssm_beta / ssm_alpha, out_proj as
    ssm_out; the attention's q_proj (each head's q rows then its gate rows) kept whole as attn_q;
  - with fewer key heads than value heads, the V heads reordered from grouped (by key head) to tiled order
    in attn_qkv's v rows, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt, the conv's v channels and ssm_out's columns;
  - metadata ssm.{conv_kernel, state_size, group_count, time_step_rank, inner_size},
    attention.recurrent_layers, full_attention_interval, rope.dimension_count (partial), rope.dimension_sections;
  - qwen35moe (its Qwen2MoeModel base): no feed_forward_length (the config has no dense width); expert_count,
    expert_used_count, expert_feed_forward_length, expert_shared_feed_forward_length; on every layer the router
    as ffn_gate_inp (F32 whatever the type), experts.gate_up_proj split at its middle into ffn_gate_exps and
    ffn_up_exps and experts.down_proj as ffn_down_exps (torch (E, rows, in)), the shared expert as
    ffn_{gate,up,down}_shexp and its gate (1, hidden) as ffn_gate_inp_shexp (F32); no expert_weights_norm
    (the config has no norm_topk_prob: llama.cpp renormalises for this architecture).
Checked against that converter's own output on the same model (tensor names, shapes, bytes, metadata:
tests/converter_check.py, run by hand: the tests read nothing outside the repository), the tokenizer aside (its pre-tokenizer table does not know this test's vocabulary); qwen35moe at f32 and Q8_0 with
every matrix's input a multiple of 32 (the converter keeps a Q8_0 matrix whose rows are not as F16: not written
here).
With `quant` the matrices are stored quantized and the transformers model's weights replaced by the
dequantized values, so both sides run the same numbers (K-quants, which the gguf package does not quantize:
random valid blocks, the model's weights then those blocks' values).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

from test_loaders import _add_tokenizer
from test_qweight import random_blocks

_NO_QUANTIZER = (QT.Q4_K, QT.Q5_K, QT.Q6_K)


def _tiled(n_k: int, per_k: int, dim: int) -> torch.Tensor:
    """Indices of `n_k * per_k` heads of `dim` each, grouped (by key head) -> tiled order."""
    return torch.arange(n_k * per_k * dim).reshape(n_k, per_k, dim).transpose(0, 1).reshape(-1)


def write_qwen35_gguf(hf, path: Path, quant: QT | None = None) -> None:
    """hf: a transformers Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM (fp32, random). Side effect: with `quant`,
    hf's matrices become the dequantized values of what the file holds."""
    c = hf.config
    moe = bool(getattr(c, "num_experts", 0))
    arch = "qwen35moe" if moe else "qwen35"
    H, KV = c.num_attention_heads, c.num_key_value_heads
    d = c.head_dim
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    per_k = Hv // Hk
    rp = dict(c.rope_parameters or {})
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if not moe:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_freq_base(float(rp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_uint32(f"{arch}.ssm.conv_kernel", c.linear_conv_kernel_dim)
    w.add_uint32(f"{arch}.ssm.state_size", dk)
    w.add_uint32(f"{arch}.ssm.group_count", Hk)
    w.add_uint32(f"{arch}.ssm.time_step_rank", Hv)
    w.add_uint32(f"{arch}.ssm.inner_size", Hv * dv)
    w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    w.add_uint32(f"{arch}.full_attention_interval", 4)
    w.add_rope_dimension_count(int(d * float(rp.get("partial_rotary_factor", 0.25))))
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    _add_tokenizer(w, c.vocab_size)
    sd = {n: t.detach().float() for n, t in hf.state_dict().items()}
    replaced: dict[str, torch.Tensor] = {}
    tile = Hk != Hv                   # the converter reorders only then

    def put(name: str, hf_name: str, t: torch.Tensor, perm: torch.Tensor | None = None, dim: int = 0,
            matrix: bool = True) -> None:
        """Store t (hf_name's tensor, transformed) with its `perm` along `dim`; quantized matrices write back
        the dequantized numbers into hf_name in its own layout."""
        stored = t if perm is None else t.index_select(dim, perm)
        if quant is None or not matrix:
            w.add_tensor(name, stored.contiguous().numpy())
            return
        if quant in _NO_QUANTIZER:      # the gguf package cannot quantize K-quants: random valid blocks instead
            rows = stored.shape[:-1]         # (out,) or a stack of experts' (E, out)
            raw = random_blocks(quant, rows.numel(), stored.shape[-1], seed=len(replaced)).reshape(*rows, -1)
        else:
            raw = np_quantize(stored.contiguous().numpy(), quant)
        w.add_tensor(name, raw, raw_dtype=quant)
        back = torch.from_numpy(np_dequantize(raw, quant).copy()).reshape(stored.shape)
        replaced[hf_name] = back if perm is None else back.index_select(dim, torch.argsort(perm))

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        put("output.weight", "lm_head.weight", sd["lm_head.weight"])
    put("output_norm.weight", "", sd["model.norm.weight"] + 1, matrix=False)
    for i, kind in enumerate(c.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", "", sd[p + "input_layernorm.weight"] + 1, matrix=False)
        put(b + "post_attention_norm.weight", "", sd[p + "post_attention_layernorm.weight"] + 1, matrix=False)
        if moe:
            _experts(put, sd, p, b, replaced)
        else:
            for n in ("gate", "up", "down"):
                put(b + f"ffn_{n}.weight", p + f"mlp.{n}_proj.weight", sd[p + f"mlp.{n}_proj.weight"])
        if kind == "full_attention":
            a = p + "self_attn."
            for g, n in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                put(b + f"{g}.weight", a + f"{n}.weight", sd[a + f"{n}.weight"])
            put(b + "attn_q_norm.weight", "", sd[a + "q_norm.weight"] + 1, matrix=False)
            put(b + "attn_k_norm.weight", "", sd[a + "k_norm.weight"] + 1, matrix=False)
            continue
        la = p + "linear_attn."
        qk = 2 * Hk * dk
        v_rows = torch.cat([torch.arange(qk), qk + _tiled(Hk, per_k, dv)]) if tile else None
        heads = _tiled(Hk, per_k, 1) if tile else None
        put(b + "attn_qkv.weight", la + "in_proj_qkv.weight", sd[la + "in_proj_qkv.weight"], v_rows)
        put(b + "attn_gate.weight", la + "in_proj_z.weight", sd[la + "in_proj_z.weight"],
            _tiled(Hk, per_k, dv) if tile else None)
        put(b + "ssm_beta.weight", la + "in_proj_b.weight", sd[la + "in_proj_b.weight"], heads)
        put(b + "ssm_alpha.weight", la + "in_proj_a.weight", sd[la + "in_proj_a.weight"], heads)
        put(b + "ssm_out.weight", la + "out_proj.weight", sd[la + "out_proj.weight"],
            _tiled(Hk, per_k, dv) if tile else None, dim=1)
        put(b + "ssm_a", "", -torch.exp(sd[la + "A_log"]), heads, matrix=False)
        put(b + "ssm_dt.bias", "", sd[la + "dt_bias"], heads, matrix=False)
        put(b + "ssm_conv1d.weight", "", sd[la + "conv1d.weight"].squeeze(1), v_rows, matrix=False)
        put(b + "ssm_norm.weight", "", sd[la + "norm.weight"], matrix=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if replaced:
        with torch.no_grad():
            params = dict(hf.named_parameters())
            for n, t in replaced.items():
                params[n].copy_(t)


def _experts(put, sd: dict, p: str, b: str, replaced: dict) -> None:
    """Layer p's MLP as qwen35moe's converter writes it (blk prefix b): the router and the shared expert's gate
    F32, the stacked experts and the shared expert's matrices in the file's type. gate_up_proj (E, 2 I, hidden)
    is split at I into gate and up (each quantized alone), written back as one tensor."""
    put(b + "ffn_gate_inp.weight", "", sd[p + "mlp.gate.weight"], matrix=False)
    gate_up = sd[p + "mlp.experts.gate_up_proj"]
    half = gate_up.shape[1] // 2
    put(b + "ffn_gate_exps.weight", "gate", gate_up[:, :half])
    put(b + "ffn_up_exps.weight", "up", gate_up[:, half:])
    if "gate" in replaced:              # the file's numbers, back in hf's one tensor
        replaced[p + "mlp.experts.gate_up_proj"] = torch.cat([replaced.pop("gate"), replaced.pop("up")], dim=1)
    put(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj", sd[p + "mlp.experts.down_proj"])
    for n in ("gate", "up", "down"):
        name = p + f"mlp.shared_expert.{n}_proj.weight"
        put(b + f"ffn_{n}_shexp.weight", name, sd[name])
    put(b + "ffn_gate_inp_shexp.weight", "", sd[p + "mlp.shared_expert_gate.weight"], matrix=False)
