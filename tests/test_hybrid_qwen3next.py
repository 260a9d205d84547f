"""Qwen3-Next (qwen3next, issue 47): qwen35moe's layers (gated DeltaNet, gated attention with partial RoPE, a router
over experts plus a sigmoid-gated shared expert on every layer) with the DeltaNet's q|k|v|z and b|a projections
fused and interleaved per key head (in_proj_qkvz, in_proj_ba), split at load by deltanet.fused_rows.

Oracles: transformers' Qwen3NextForCausalLM (its pure-torch chunked scan and conv, its own routing) on a tiny random
model, run again in float64 for the parity bound; the same model written as GGUF by llama.cpp's own converter
(conversion/qwen.py Qwen3NextModel, run in a subprocess by tests/nemotron_to_gguf.convert: f32, Q8_0), whose
quantized numbers are put back into transformers (`reference_weights`); our own cold run (a fresh slot, one pass)
for every reuse, bit for bit.

The parity bound [FP64-BOUND] and the checks themselves: tests/hybrid_checks.py.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as np_dequantize

from ternlm.models.config import UnsupportedModelError
from ternlm.engine.core import Engine
from ternlm.models.recurrent.deltanet import fused_rows
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.engine.weights import choose_weights
from hybrid_checks import (DIVERGENCES_200, assert_batched_equals_alone, assert_chunks_match_one_pass,
                           assert_fp64_parity, assert_greedy_text_matches, assert_int8_exact_on_every_path,
                           assert_q4_k_file_matches, assert_reuse_gives_cold_bits,
                           assert_streamed_experts_give_resident_bits, folder_engine, save_folder)
from nemotron_to_gguf import convert
from test_moe import ids_of

# deltanet, attention, deltanet, deltanet: a recurrent layer after an attention one; 2 key heads for 4 value heads
# (the per-key-head interleave and the grouped V order both matter); 6 experts, 2 a token, and a shared expert
KINDS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=16, linear_value_head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False, layer_types=KINDS,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            intermediate_size=48, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_qwen3next(seed: int = 0, **kw):
    import transformers as tf
    cfg = tf.Qwen3NextConfig(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = tf.Qwen3NextForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") and "linear_attn" not in n:   # x * (1 + w): the +1 at load matters
                p.normal_(0, 0.3)
            elif n.endswith("linear_attn.norm.weight"):
                p.normal_(1, 0.3)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.3)     # decisive routing and a gate away from 1/2: a wrong expert or gate shows
            elif n.endswith(("linear_attn.dt_bias", "linear_attn.A_log")):
                p.normal_(0, 0.5)     # per head: a head's b/a rows swapped with another's shows
    return model


@pytest.fixture(scope="module")
def qwen3next(tmp_path_factory):
    hf = hf_qwen3next(seed=3)
    folder = tmp_path_factory.mktemp("qwen3next")
    save_folder(hf, folder)
    return hf, folder


def test_fused_rows_undo_transformers_ordering():
    """deltanet.fused_rows against transformers' own fix_query_key_value_ordering on a random projection."""
    from ternlm.models.hf import config_from_hf
    hf = hf_qwen3next(seed=1)
    net = hf.model.layers[0].linear_attn
    cfg = config_from_hf(hf.config.to_dict(), {n for n, _ in hf.named_parameters()})
    qkvz, ba = torch.randn(3, 5, net.in_proj_qkvz.out_features), torch.randn(3, 5, net.in_proj_ba.out_features)
    q, k, v, z, b, a = net.fix_query_key_value_ordering(qkvz, ba)
    rows = {**fused_rows(cfg, "in_proj_qkvz"), **fused_rows(cfg, "in_proj_ba")}
    want_qkv = torch.cat([x.reshape(3, 5, -1) for x in (q, k, v)], -1)
    assert torch.equal(qkvz[..., rows["in_proj_qkv"]], want_qkv)
    assert torch.equal(qkvz[..., rows["in_proj_z"]], z.reshape(3, 5, -1))
    assert torch.equal(ba[..., rows["in_proj_b"]], b) and torch.equal(ba[..., rows["in_proj_a"]], a)


def test_config_and_layers_from_the_folder(qwen3next):
    _, folder = qwen3next
    loaded = load_hf_folder(folder, torch.float32)
    cfg, w = loaded.config, loaded.weights
    assert cfg.arch == "qwen3next" and cfg.layer_kinds == ("deltanet", "attention", "deltanet", "deltanet")
    assert cfg.recurrent_layers == (0, 2, 3) and cfg.attn_output_gate and cfg.rope_spec.rotary_dim == 4
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (6, 2, 32)
    assert cfg.shared_expert_intermediate_size == 64 and cfg.norm_topk_prob and not cfg.linear_v_tiled
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim) == (2, 4, 16, 32)
    assert tuple(w["model.layers.0.linear_attn.in_proj_qkv.weight"].shape) == (2 * 32 + 128, 64)
    assert tuple(w["model.layers.0.linear_attn.in_proj_b.weight"].shape) == (4, 64)


def test_logits_and_greedy_text_match_transformers(qwen3next):
    """The HF folder: logits within [FP64-BOUND], argmax equal everywhere; greedy decoding gives the same tokens."""
    hf, folder = qwen3next
    engine = folder_engine(folder)
    ids = ids_of(150, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, "hf folder", eager_experts=True)
    assert_greedy_text_matches(engine, hf, ids[:40], max_tokens=24)


def test_router_follows_norm_topk_prob(tmp_path):
    """norm_topk_prob false (transformers' Qwen2MoeTopKRouter: softmax top-k weights as they are): still parity."""
    hf = hf_qwen3next(seed=4, norm_topk_prob=False)
    save_folder(hf, tmp_path)
    engine = folder_engine(tmp_path)
    assert not engine.config.norm_topk_prob
    ids = ids_of(60, seed=3)
    assert_fp64_parity(hf, engine.logits(ids), ids, "norm_topk_prob=false", eager_experts=True)


def test_mtp_block_is_skipped(qwen3next, tmp_path):
    """A checkpoint's multi-token-prediction block (mtp.*, in Qwen3-Next's own shards) is skipped as transformers
    skips it: the same logits as without it."""
    import shutil
    from safetensors.torch import save_file
    _, folder = qwen3next
    shutil.copytree(folder, tmp_path / "m")
    save_file({"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)},
              tmp_path / "m" / "mtp.safetensors")
    ids = ids_of(30, seed=1)
    assert torch.equal(folder_engine(tmp_path / "m").logits(ids), folder_engine(folder).logits(ids))


@pytest.mark.parametrize("kw", [dict(decoder_sparse_step=2), dict(mlp_only_layers=[1])], ids=["sparse_step", "mlp_only"])
def test_dense_mlp_layers_are_refused(tmp_path, kw):
    """Dense MLP layers among the expert layers (not in Qwen3-Next-80B's config) are refused by name, not run wrong."""
    save_folder(hf_qwen3next(seed=0, **kw), tmp_path)
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step"):
        load_hf_folder(tmp_path, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "auto"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(qwen3next, dtype):
    """[RESUME-EXACT]: a prompt in chunks of 7, then decoded token by token, gives the bits of one pass."""
    _, folder = qwen3next
    engine = folder_engine(folder, dtype)
    ids = ids_of(90, seed=5)
    assert_chunks_match_one_pass(engine, ids, engine.logits(ids), chunk_size=7, tail=10)


def test_reuse_at_divergence_points_gives_the_cold_bits(qwen3next):
    """A 200-token conversation, then a prompt that leaves it at d (and one that extends it): the reused run
    (resumed at the latest snapshot <= d) gives the cold run's logits bit for bit, first and decoded tokens."""
    _, folder = qwen3next
    warm, cold = folder_engine(folder, state_interval=32), folder_engine(folder, prefix_reuse=False)
    assert_reuse_gives_cold_bits(warm, cold, ids_of(200, seed=7), ids_of(200, seed=8), DIVERGENCES_200, max_tokens=3)


def test_batched_equals_alone(qwen3next):
    """Four requests joining a batch at different steps give each one's tokens and logits alone, bit for bit."""
    _, folder = qwen3next
    engine = folder_engine(folder, slots=5, chunk_size=16)
    assert_batched_equals_alone(engine, [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)], [0, 0, 2, 3], budget=40)


# --- llama.cpp's converter's GGUF files -------------------------------------------------------------------------

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
_LAYER = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
          "ssm_ba.weight": "linear_attn.in_proj_ba.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
          "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj"}


def reference_weights(hf, path) -> int:
    """Copy every quantized tensor of the converter's GGUF at `path`, dequantized, into `hf` in transformers' own
    layout: attn_qkv + attn_gate back into in_proj_qkvz's per-key-head interleave, ffn_gate_exps + ffn_up_exps
    into experts.gate_up_proj. Returns how many GGUF tensors were copied."""
    params = dict(hf.named_parameters())
    cfg = None
    n = 0
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np_dequantize(np.array(t.data), t.tensor_type).copy()).reshape(shape)
        n += 1
        if t.name in _TOP:
            dst, rows = params[_TOP[t.name]], None
        else:
            _, i, part = t.name.split(".", 2)
            pre = f"model.layers.{i}."
            if part in ("attn_qkv.weight", "attn_gate.weight"):
                if cfg is None:
                    from ternlm.models.hf import config_from_hf
                    cfg = config_from_hf(hf.config.to_dict(), set(params))
                dst = params[pre + "linear_attn.in_proj_qkvz.weight"]
                rows = fused_rows(cfg, "in_proj_qkvz")["in_proj_qkv" if part == "attn_qkv.weight" else "in_proj_z"]
            elif part in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                dst, half = params[pre + "mlp.experts.gate_up_proj"], w.shape[1]
                with torch.no_grad():       # (E, 2 I, hidden): gate rows first
                    (dst[:, :half] if part.startswith("ffn_gate") else dst[:, half:]).copy_(w)
                continue
            else:
                dst, rows = params[pre + _LAYER[part]], None
        with torch.no_grad():
            if rows is None:
                dst.copy_(w.reshape(dst.shape))
            else:
                dst[rows] = w
    return n


@pytest.fixture(scope="module")
def converted(qwen3next, tmp_path_factory):
    """{outtype: GGUF path} by llama.cpp's converter (Qwen3NextModel, --no-mtp) from the saved folder."""
    _, folder = qwen3next
    out = tmp_path_factory.mktemp("qwen3next_gguf")
    paths = {}
    for outtype in ("f32", "q8_0"):
        paths[outtype] = out / f"qwen3next-{outtype}.gguf"
        convert(folder, paths[outtype], outtype, TINY["vocab_size"], model="qwen.Qwen3NextModel", extra=("--no-mtp",))
    return paths


def _gguf_engine(path, keep: bool, act: str | None, budget: int | None = None, **kw) -> Engine:
    loaded = load_gguf(path, torch.float32, keep_quantized=keep, lanes=keep, expert_budget=budget,
                       int8=act == "int8")            # streamed experts read into the int layouts int8 multiplies
    cfg = loaded.config
    assert cfg.arch == "qwen3next" and not cfg.linear_v_tiled and cfg.num_experts == 6 and cfg.norm_topk_prob
    assert cfg.layer_kinds == ("deltanet", "attention", "deltanet", "deltanet") and cfg.rope_spec.rotary_dim == 4
    weights = choose_weights("gguf", "auto", True, activations=act) if keep else None
    engine = Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32", min_reuse=1, **kw)
    assert engine.model.activations == (act or "fp32")
    return engine


@pytest.mark.parametrize("outtype,act", [("f32", None), ("q8_0", "fp32")])
def test_converter_gguf_matches_transformers(qwen3next, converted, outtype, act):
    """The converter's file through our loader and kernels (Q8_0: its blocks kept, fp32 activations) against
    transformers on the file's numbers: [FP64-BOUND], argmax equal everywhere, greedy tokens equal."""
    hf = copy.deepcopy(qwen3next[0])
    copied = reference_weights(hf, converted[outtype])
    assert (copied == 0) == (outtype == "f32") and (outtype == "f32" or copied >= 30)
    engine = _gguf_engine(converted[outtype], outtype != "f32", act)
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, outtype, eager_experts=True)
    assert_greedy_text_matches(engine, hf, ids[:30], max_tokens=16)


def test_converter_q8_0_int8_is_exact_on_every_path(qwen3next, converted):
    """int8 activations (the default for quantized files): top-1 agreement with transformers >= 90%, and chunks +
    decode == one pass, reuse at divergence points == the cold run, batched == alone, bit for bit."""
    hf = copy.deepcopy(qwen3next[0])
    reference_weights(hf, converted["q8_0"])
    assert_int8_exact_on_every_path(hf, _gguf_engine(converted["q8_0"], True, "int8"),
                                    _gguf_engine(converted["q8_0"], True, "int8", slots=4, chunk_size=16))


def test_converter_q8_0_streamed_experts_give_the_resident_bits(converted):
    """--expert-cache on the converter's file: experts streamed through a cache of two and a half of them (24 in
    the file) give the resident run's logits bit for bit, one pass and chunks + decode."""
    path = converted["q8_0"]
    assert_streamed_experts_give_resident_bits(_gguf_engine(path, True, "int8"),
                                               lambda budget: _gguf_engine(path, True, "int8", budget))


# Q4_K needs 256-wide inputs: the same layers, wider (every 2-D matrix's input 256; the experts stay F32)
WIDE = dict(hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
            shared_expert_intermediate_size=256)



def test_q4_k_file_matches_transformers(tmp_path):
    """Q4_K matrices through our kernels (the converter's --outtype writes no K-quants: random valid blocks in its
    own f32 file, hybrid_checks.assert_q4_k_file_matches), a model wide enough for 256-wide inputs."""
    def to_f32(folder, out):
        convert(folder, out, "f32", TINY["vocab_size"], model="qwen.Qwen3NextModel", extra=("--no-mtp",))
    assert_q4_k_file_matches(hf_qwen3next(seed=3, **WIDE), tmp_path, to_f32, reference_weights, eager_experts=True)
