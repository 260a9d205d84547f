"""Hybrid models (issue 47): Qwen3.5's gated DeltaNet layers beside gated attention, and reuse with a recurrent
state (kv/recurrent.py snapshots, kernels/recurrent.c's one-token-at-a-time scan).

Oracles: transformers' Qwen3_5ForCausalLM (its pure-torch chunked scan and conv, not fla) on a tiny random
model, saved with save_pretrained and written as llama.cpp's converter writes it (tests/hybrid_to_gguf.py:
f32, Q8_0, Q4_K; the key heads fewer than the value heads, so the converter's tiled V order is exercised); our
own cold run (`--no-prefix-kv`, a fresh slot, one full pass) for every reuse: a resumed state must give the
cold run's logits bit for bit, at every divergence point.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import load_gguf
from ternlm.engine.weights import choose_weights
from hybrid_to_gguf import write_qwen35_gguf
from lesser_isa import LESSER, run_built_for
from ternlm.kv.recurrent import RecurrentShape, RecurrentState
from ternlm.models.hf import load_hf_folder
from hybrid_checks import (assert_batched_equals_alone, assert_chunks_match_one_pass, assert_fp64_parity,
                           assert_greedy_text_matches, assert_int8_exact_on_every_path, assert_reuse_gives_cold_bits,
                           assert_threads_do_not_change_bits, folder_engine, save_folder)
from test_moe import ids_of

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=1024,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_qwen35(seed: int = 0, **kw):
    import transformers as tf
    cfg = tf.Qwen3_5TextConfig(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():             # norms away from their zero init (x * (1 + w)): the +1 at load matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") and "linear_attn" not in n:
                p.normal_(0, 0.3)
            elif n.endswith("linear_attn.norm.weight"):
                p.normal_(1, 0.3)
    return model


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    hf = hf_qwen35(seed=3)
    folder = tmp_path_factory.mktemp("qwen35")
    save_folder(hf, folder)
    return hf, folder


@pytest.fixture(scope="module")
def qwen35_q8(tmp_path_factory):
    """The same model with head_dim 32, for --kv-dtype q8_0 (its rows need a multiple of 32)."""
    folder = tmp_path_factory.mktemp("qwen35-hd32")
    save_folder(hf_qwen35(seed=3, head_dim=32), folder)
    return folder


# The KV formats the bit-exactness properties run on: auto (fp32 here: the torch layers) and q8_0 (int8 codes +
# fp16 scales written by the native kernels on the torch layers' table path). q8_0 runs compare with q8_0 runs.
KVS = ["auto", "q8_0"]


def _kv_folder(request, kv: str):
    """(folder, Engine kwargs) for a KV format: q8_0 runs the head_dim 32 twin."""
    if kv == "q8_0":
        return request.getfixturevalue("qwen35_q8"), {"kv_dtype": "q8_0"}
    return request.getfixturevalue("qwen35")[1], {}


def test_config_and_layers_from_the_folder(qwen35):
    _, folder = qwen35
    cfg = load_hf_folder(folder, torch.float32).config
    assert cfg.arch == "qwen35" and cfg.layer_kinds == ("deltanet",) * 3 + ("attention",)
    assert cfg.attn_output_gate and cfg.rope_spec.rotary_dim == 4 and cfg.recurrent_layers == (0, 1, 2)


def test_logits_and_greedy_text_match_transformers(qwen35):
    """Logits within fp32 rounding of transformers' (its chunked scan, ours one token at a time), and greedy
    decoding gives the same tokens."""
    hf, folder = qwen35
    engine = folder_engine(folder)
    ids = ids_of(150, seed=2)
    ours = engine.logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() <= 2e-5 * ref.abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert_greedy_text_matches(engine, hf, ids[:40], max_tokens=24)


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("auto", "auto"), ("float32", "q8_0")],
                         ids=["float32", "auto", "float32-kv_q8_0"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(request, dtype, kv):
    """[RESUME-EXACT] the scan takes the same per-token steps on every path: a prompt in chunks of 7, then
    decoded token by token, gives the bits of one pass over all of it (fp32, and the CPU's own dtype; and
    with a q8_0 KV cache)."""
    folder, kw = _kv_folder(request, kv)
    engine = folder_engine(folder, dtype, **kw)
    assert engine.kv_dtype == kw.get("kv_dtype", engine.kv_dtype)
    ids = ids_of(90, seed=5)
    assert_chunks_match_one_pass(engine, ids, engine.logits(ids), chunk_size=7, tail=10)


@pytest.mark.parametrize("kv", KVS)
def test_reuse_at_every_divergence_gives_the_cold_bits(request, kv):
    """A 300-token conversation, then a prompt that leaves it at every point d in 0..300: the reused run
    (resumed at the latest snapshot <= d, kept KV, the rest prefilled) gives the cold run's logits bit for
    bit, its first token's and the decoded ones'; it reuses exactly that snapshot."""
    folder, kw = _kv_folder(request, kv)
    warm, cold = folder_engine(folder, state_interval=32, **kw), folder_engine(folder, prefix_reuse=False, **kw)
    assert warm.kv_dtype == cold.kv_dtype
    assert_reuse_gives_cold_bits(warm, cold, ids_of(300, seed=7), ids_of(300, seed=8), range(0, 301), max_tokens=3)


@pytest.mark.parametrize("kv", KVS)
def test_batched_equals_alone(request, kv):
    """Four requests joining a batch at different steps (prefill chunks beside decodes, each slot its own
    recurrent state) give each one's tokens and logits alone, bit for bit."""
    folder, kw = _kv_folder(request, kv)
    engine = folder_engine(folder, slots=5, chunk_size=16, **kw)
    assert_batched_equals_alone(engine, [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)], [0, 0, 2, 3], budget=40)


def test_threads_do_not_change_the_bits(qwen35):
    _, folder = qwen35
    assert_threads_do_not_change_bits(folder_engine(folder), ids_of(70, seed=9))


def test_state_snapshots_grid_and_restore():
    """The snapshot bookkeeping alone: the grid's positions and a prefill's end are wanted; resumable is
    pos itself or the latest snapshot at or before k; restoring drops what lies past; the oldest snapshot
    goes first over the limit."""
    st = RecurrentState(RecurrentShape(1, 4, 3, 2, 2, 2), interval=64, max_snapshots=3)
    assert st.wants(0, [5] * 200, prefill_end=True) == [64, 128, 192, 200]
    assert st.wants(64, [5], prefill_end=False) == [] and st.wants(127, [5], prefill_end=False) == [128]
    for p in (64, 128, 192):
        st.keep(p, torch.full_like(st.conv, p), torch.full_like(st.ssm, p))
    st.pos = 200
    assert st.resumable(250) == 200 and st.resumable(199) == 192 and st.resumable(63) == 0
    st.keep(200, st.conv.clone(), st.ssm.clone())
    assert sorted(st.snaps) == [128, 192, 200]                  # 64 went first
    st.restore(128)
    assert st.pos == 128 and sorted(st.snaps) == [128] and torch.equal(st.ssm, torch.full_like(st.ssm, 128))
    with pytest.raises(ValueError):
        st.restore(100)


def test_snapshot_budget_keeps_turn_boundaries_beside_the_newest_grid():
    """Over the budget, turn boundaries (prefill ends, off the grid) keep up to half of it and the grid the rest,
    oldest first in each pool, the newest snapshot never: six turns of ~150 tokens, 6 snapshots allowed."""
    st = RecurrentState(RecurrentShape(1, 4, 3, 2, 2, 2), interval=64, max_snapshots=6)
    for end in (150, 310, 455, 610, 770, 905):                  # each turn's prefill end, with the grid before it
        start = max(st.snaps, default=0)
        for p in st.wants(start, [5] * (end - start), prefill_end=True):
            st.keep(p, st.conv.clone(), st.ssm.clone())
        st.pos = end
    assert sorted(st.snaps) == [455, 610, 770, 832, 896, 905]     # 3 past boundaries + the newest, 2 grid points
    assert st.resumable(500) == 455 and st.resumable(700) == 610 and st.resumable(800) == 770
    assert st.resumable(900) == 896


# Q4_K needs 256-wide inputs: the same model, wider
WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_value_head_dim=64, linear_key_head_dim=64)


def _gguf(tmp_path, quant, act: str | None, seed: int = 3):
    """(transformers model holding the file's numbers, our engine on the file) for quant None (f32) / Q8_0 /
    Q4_K and activations fp32 | int8 (the GGUF's blocks kept: --weights gguf)."""
    hf = hf_qwen35(seed=seed, **(WIDE if quant == QT.Q4_K else {}))
    path = tmp_path / f"qwen35-{getattr(quant, 'name', 'f32')}.gguf"
    write_qwen35_gguf(hf, path, quant)
    keep = quant is not None
    loaded = load_gguf(path, torch.float32, keep_quantized=keep, lanes=keep)
    assert loaded.config.linear_v_tiled and loaded.config.layer_kinds == ("deltanet",) * 3 + ("attention",)
    weights = choose_weights("gguf", "auto", True, activations=act) if keep else None
    engine = Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32", min_reuse=1)
    assert engine.model.activations == (act or "fp32")
    return hf, engine


@pytest.mark.parametrize("quant", [None, QT.Q8_0, QT.Q4_K], ids=["f32", "q8_0", "q4_k"])
def test_gguf_matches_transformers(quant, tmp_path):
    """A converter-laid GGUF through our loader and kernels (fp32 activations) against transformers on the
    file's numbers: within fp32 rounding, judged against the same model in float64 ([FP64-BOUND],
    hybrid_checks.py: Q4_K's random blocks make wider weights, so no fixed fraction of the scale fits every
    type); argmax equal everywhere."""
    hf, engine = _gguf(tmp_path, quant, "fp32" if quant is not None else None)
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, getattr(quant, "name", "f32"))


@pytest.mark.parametrize("quant", [QT.Q8_0, QT.Q4_K], ids=["q8_0", "q4_k"])
def test_gguf_int8_is_exact_on_every_path(quant, tmp_path):
    """int8 activations (the default for quantized files) on a hybrid model: still the model (top-1 agreement
    with transformers >= 90%), and chunks + decode == one pass, batched == alone, reuse at divergence points
    == the cold run, bit for bit."""
    hf, engine = _gguf(tmp_path, quant, "int8")
    batched = Engine(load_gguf(tmp_path / f"qwen35-{quant.name}.gguf", torch.float32, keep_quantized=True, lanes=True),
                     dtype="float32", weights=engine.weights_choice, kv_dtype="float32", slots=4, chunk_size=16)
    assert_int8_exact_on_every_path(hf, engine, batched)


_ISA_SCRIPT = textwrap.dedent("""
    import os, tempfile, torch
    from gguf import GGMLQuantizationType as QT
    from ternlm.engine.core import Engine
    from ternlm.models.gguf import load_gguf
    from ternlm.engine.weights import choose_weights
    from hybrid_to_gguf import write_qwen35_gguf
    from test_hybrid import hf_qwen35
    from test_moe import ids_of
    hf = hf_qwen35(seed=3)
    path = os.path.join(tempfile.mkdtemp(), "m.gguf")
    write_qwen35_gguf(hf, path, QT.Q8_0)
    ids = ids_of(60, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for act in ("fp32", "int8"):
        e = Engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), dtype="float32",
                   weights=choose_weights("gguf", "auto", True, activations=act), kv_dtype="float32")
        whole = e.logits(ids)
        if act == "fp32":
            assert (whole - ref).abs().max() <= 2e-5 * ref.abs().max()
        e.runner.chunk_size = 7
        assert torch.equal(e.runner.prefill(e.slots[0], ids[:-1]), whole[-2])
        assert torch.equal(e.runner.decode(e.slots[0], ids[-1]), whole[-1])
    print(e.model.kernels.isa, "ok")
""")


@LESSER
def test_lesser_isa_builds(march, isa, tmp_path):
    """The hybrid layers as an AVX2-only (or baseline x86-64) CPU builds them (recurrent.c's scan and
    pointwise functions, VN 8 or 4 lanes): transformers' logits (fp32 activations), chunks and decode ==
    one pass (fp32 and int8)."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]


def _slot_kv_per_token(path) -> int:
    """K and V bytes of one token in an engine's slot on this file (fp32 activations: the torch layers)."""
    slot = Engine.load(str(path), dtype="float32").slots[0]
    return (slot.k.nbytes + slot.v.nbytes) // slot.capacity


def test_fit_check_and_info_count_the_recurrent_state(tmp_path):
    """The memory fit counts each slot's recurrent state with as many snapshots as it may keep, and its KV at
    fp32 (hybrid layers run in torch); `ternlm info -m` reports a snapshot's bytes and a token's share; a
    suggested --slots / --ctx fits with the state counted."""
    from ternlm.engine.fit import Available, budget_for, check
    from ternlm.cli.info import recurrent_info
    from ternlm.kv.recurrent import recurrent_shape
    hf = hf_qwen35(seed=1)
    path = tmp_path / "m.gguf"
    write_qwen35_gguf(hf, path, QT.Q8_0)
    shape = recurrent_shape(load_gguf(path, torch.float32).config)
    b = budget_for(str(path), slots=3, ctx=512)
    assert b.state_per_slot == shape.nbytes * (1 + RecurrentState.snapshots_for(shape)) > 0
    # the one attention layer's K and V (2 heads of 16, fp32): the 3 DeltaNet layers hold no KV, the engine's
    # slot neither
    assert b.kv_per_token == 1 * 2 * 2 * 16 * 4 == _slot_kv_per_token(path)
    info = recurrent_info(str(path), 64)
    assert info["snapshot_bytes"] == shape.nbytes and info["recurrent_layers"] == 3
    assert info["attention_layers"] == 1 and info["kv_bytes_per_token"] == b.kv_per_token
    tight = b.model + b.overhead + b.kv + b.state_per_slot * 2         # room for 2 of the 3 slots
    fit = check(b, Available(tight, "test"), slots_flag=True)
    assert not fit.ok and "--slots 2" in fit.line
    import dataclasses
    assert check(dataclasses.replace(b, slots=2), Available(tight, "test")).ok
