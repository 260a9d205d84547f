"""Hybrid models (issue 47), nemotron_h: Nemotron-H's one-block layers (Mamba-2 mixers, attention without RoPE,
relu^2 MLPs, each behind its own norm) and reuse with a Mamba-2 recurrent state (kv/recurrent.py snapshots,
kernels/recurrent.c's tq_ssd_scan one token at a time).

Oracles: transformers' NemotronHForCausalLM on a tiny random model (its pure-torch chunked SSD scan and conv: no
mamba_ssm / causal_conv1d here), saved with save_pretrained and written as GGUF by llama.cpp's own converter
(tests/nemotron_to_gguf.py: f32, Q8_0); our own cold run (`prefix_reuse=False`, a fresh slot, one full pass)
for every reuse: a resumed state must give the cold run's logits bit for bit, at every divergence point.
Parity bounds come from a float64 run of the same model ([FP64-BOUND]: our distance from it at most 4x
transformers' own fp32 distance); that rule and the checks themselves: tests/hybrid_checks.py.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from ternlm.engine.core import Engine
from ternlm.kv.recurrent import recurrent_shape
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.engine.weights import choose_weights
from hybrid_checks import (assert_batched_equals_alone, assert_chunks_match_one_pass, assert_fp64_parity,
                           assert_greedy_text_matches, assert_int8_exact_on_every_path, assert_q4_k_file_matches,
                           assert_reuse_gives_cold_bits, assert_threads_do_not_change_bits, folder_engine, save_folder)
from nemotron_to_gguf import convert, reference_weights
from test_moe import ids_of

KINDS = ["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"]
TINY = dict(vocab_size=300, hidden_size=64, layers_block_type=KINDS, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
            conv_kernel=4, max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_nemotron(seed: int = 0, **kw):
    import transformers as tf
    cfg = tf.NemotronHConfig(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = tf.NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():       # away from the init's ones (norms, D, dt_bias) and equal A_log per head
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("norm_f.weight"):
                p.normal_(1, 0.3)
            elif n.endswith(("mixer.D", "mixer.dt_bias", "conv1d.bias")):
                p.normal_(0, 0.5)
            elif n.endswith("mixer.A_log"):
                p.uniform_(-1, 2)
    return model


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    hf = hf_nemotron(seed=3)
    folder = tmp_path_factory.mktemp("nemotron_h")
    save_folder(hf, folder)
    return hf, folder


def test_config_and_layers_from_the_folder(nemotron):
    _, folder = nemotron
    cfg = load_hf_folder(folder, torch.float32).config
    assert cfg.arch == "nemotron_h" and cfg.no_rope and cfg.mlp_act == "relu2"
    assert cfg.layer_kinds == ("mamba2", "none", "attention", "none", "mamba2", "none")
    assert cfg.layer_ffns == ("none", "mlp", "none", "mlp", "none", "mlp")
    assert cfg.recurrent_layers == (0, 4)
    assert recurrent_shape(cfg).shapes == ((2, 8 * 8 + 2 * 2 * 16, 3), (2, 8, 8, 16))


def test_logits_and_greedy_text_match_transformers(nemotron):
    """Logits within fp32 rounding of transformers' (its chunked SSD scan, ours one token at a time), and greedy
    decoding gives the same tokens."""
    hf, folder = nemotron
    engine = folder_engine(folder)
    ids = ids_of(150, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, "hf folder")
    assert_greedy_text_matches(engine, hf, ids[:40], max_tokens=24)


@pytest.mark.parametrize("dtype", ["float32", "auto"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(nemotron, dtype):
    """[RESUME-EXACT] the scan takes the same per-token steps on every path: a prompt in chunks of 7, then
    decoded token by token, gives the bits of one pass over all of it (fp32, and the CPU's own dtype)."""
    _, folder = nemotron
    engine = folder_engine(folder, dtype)
    ids = ids_of(90, seed=5)
    assert_chunks_match_one_pass(engine, ids, engine.logits(ids), chunk_size=7, tail=10)


def test_reuse_at_every_divergence_gives_the_cold_bits(nemotron):
    """A 200-token conversation, then a prompt that leaves it at every point d in 0..200: the reused run
    (resumed at the latest snapshot <= d, kept KV, the rest prefilled) gives the cold run's logits bit for
    bit, its first token's and the decoded ones'; it reuses exactly that snapshot."""
    _, folder = nemotron
    warm, cold = folder_engine(folder, state_interval=32), folder_engine(folder, prefix_reuse=False)
    assert_reuse_gives_cold_bits(warm, cold, ids_of(200, seed=7), ids_of(200, seed=8), range(0, 201), max_tokens=3)


def test_batched_equals_alone(nemotron):
    """Four requests joining a batch at different steps (prefill chunks beside decodes, each slot its own
    recurrent state) give each one's tokens and logits alone, bit for bit."""
    _, folder = nemotron
    engine = folder_engine(folder, slots=5, chunk_size=16)
    assert_batched_equals_alone(engine, [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)], [0, 0, 2, 3], budget=40)


def test_threads_do_not_change_the_bits(nemotron):
    _, folder = nemotron
    assert_threads_do_not_change_bits(folder_engine(folder), ids_of(70, seed=9))


@pytest.fixture(scope="module")
def converted(nemotron, tmp_path_factory):
    """{outtype: GGUF path} by llama.cpp's converter from the saved folder."""
    _, folder = nemotron
    out = tmp_path_factory.mktemp("nemotron_gguf")
    paths = {}
    for outtype in ("f32", "q8_0"):
        paths[outtype] = out / f"nemotron-{outtype}.gguf"
        convert(folder, paths[outtype], outtype, TINY["vocab_size"])
    return paths


@pytest.mark.parametrize("outtype,act", [("f32", None), ("q8_0", "fp32")])
def test_converter_gguf_matches_transformers(nemotron, converted, outtype, act):
    """The converter's file (named nemotron_h_moe, as it names transformers 5 configs: kinds from its tensors)
    through our loader and kernels (Q8_0: its blocks kept, fp32 activations) against transformers on the
    file's numbers: within fp32 rounding (float64-judged), greedy tokens equal."""
    hf, _ = nemotron
    hf = copy.deepcopy(hf)
    path = converted[outtype]
    # Q8_0: every matrix (2 Mamba-2 x in/out, q/k/v/o, 3 MLPs x up/down, embedding, LM head)
    assert reference_weights(hf, path) == (0 if outtype == "f32" else 16)
    keep = outtype != "f32"
    loaded = load_gguf(path, torch.float32, keep_quantized=keep, lanes=keep)
    assert loaded.config.layer_kinds == ("mamba2", "none", "attention", "none", "mamba2", "none")
    weights = choose_weights("gguf", "auto", True, activations=act) if keep else None
    engine = Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32", min_reuse=1)
    assert engine.model.activations == (act or "fp32")
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, outtype)
    assert_greedy_text_matches(engine, hf, ids[:30], max_tokens=16)


def test_converter_q8_0_int8_is_exact_on_every_path(nemotron, converted):
    """int8 activations (the default for quantized files): top-1 agreement with transformers >= 90%, and chunks +
    decode == one pass, reuse at divergence points == the cold run, batched == alone, bit for bit."""
    hf, _ = nemotron
    hf = copy.deepcopy(hf)
    reference_weights(hf, converted["q8_0"])

    def engine(**kw):
        return Engine(load_gguf(converted["q8_0"], torch.float32, keep_quantized=True, lanes=True), dtype="float32",
                      weights=choose_weights("gguf", "auto", True, activations="int8"), kv_dtype="float32",
                      min_reuse=1, **kw)
    e = engine()
    assert e.model.activations == "int8"
    assert_int8_exact_on_every_path(hf, e, engine(slots=4, chunk_size=16))


# Q4_K needs 256-wide inputs: the same layers, wider (every matrix's input 256)
WIDE = dict(hidden_size=256, head_dim=64, intermediate_size=256, mamba_head_dim=32)



def test_q4_k_file_matches_transformers(tmp_path):
    """Q4_K matrices through our kernels (the converter's --outtype writes no K-quants: random valid blocks in its
    own f32 file, hybrid_checks.assert_q4_k_file_matches), a model wide enough for 256-wide inputs."""
    hf = hf_nemotron(seed=3, **WIDE)
    for m in hf.modules():      # a GGUF's dt is unclamped (llama.cpp's ssm_scan; config_from_gguf): transformers' too
        if hasattr(m, "time_step_limit"):   # (its prefill clamps at time_step_min; Q4_K's wide weights reach below)
            m.time_step_limit = (0.0, float("inf"))
    assert_q4_k_file_matches(hf, tmp_path, lambda folder, out: convert(folder, out, "f32", TINY["vocab_size"]),
                             reference_weights)


def test_moe_blocks_are_refused_by_name(tmp_path):
    """'moe' blocks are not run yet: the folder is refused with a reason, not run wrongly."""
    hf = hf_nemotron(seed=1, layers_block_type=["linear_attention", "moe"], n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    save_folder(hf, tmp_path)
    from ternlm.models.config import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        load_hf_folder(tmp_path, torch.float32)
    assert json.loads((tmp_path / "config.json").read_text())["layers_block_type"][1] == "moe"
