"""[RAW] Streamed experts served unkept are multiplied straight from their GGML blocks as read (kernels/moe_layer.py
_RawExperts, qint8.c's tq_int8_raw_range): the model's logits are the resident int8 model's, bit for bit.

The file is a small synthetic qwen3moe in llama.cpp's Q4_K_M layout (benchmarks/synth_moe_gguf.py: Q4_K gate/up
experts, Q6_K or Q4_K down experts by layer), so the raw path sees both K-quant types. Oracles: the same file with
every expert resident (converted at load, tests/test_native_moe.py ties that to transformers on real weights) and
the streamed store with the raw path switched off (TERNLM_EXPERT_RAW=0: every expert converted first).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ternlm.models import native_moe as moe_layer
from ternlm.models.gguf import load_gguf
from ternlm.models.moe import EXPERTS_IN_USE, StreamedExperts
from test_moe import _engine, ids_of

_SYNTH = Path(__file__).resolve().parents[1] / "benchmarks" / "synth_moe_gguf.py"


def _synth():
    spec = importlib.util.spec_from_file_location("synth_moe_gguf", _SYNTH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("synth_moe_gguf", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def kquant_moe(tmp_path_factory):
    synth = _synth()
    path = tmp_path_factory.mktemp("raw-moe") / "qwen3moe-q4km.gguf"
    # 8 layers: the Q4_K_M rule puts Q6_K down experts on layers 0, 3, 6, 7 and Q4_K on the others
    synth.write(path, synth.Geometry(layers=8, experts=16, active=4, hidden=512, expert_ffn=256, heads=4,
                                     kv_heads=2, head_dim=128, vocab=512, context=512), seed=3, log=None)
    return path


def _streamed(path, budget: int, monkeypatch, raw: bool):
    monkeypatch.setenv("TERNLM_EXPERT_DIRECT", "1")          # [RAW] takes the direct reader's buffers
    monkeypatch.setenv("TERNLM_EXPERT_RAW", "1" if raw else "0")
    e = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget, int8=True),
                "int8")
    assert e.model.native is not None, "the MoE layers are fused (the raw path is theirs)"
    return e


@pytest.fixture
def raw_builds(monkeypatch):
    """How many experts were built over their raw bytes."""
    n = [0]
    build = moe_layer._RawExperts.build

    def counting(self, *a, **k):
        n[0] += 1
        return build(self, *a, **k)
    monkeypatch.setattr(moe_layer._RawExperts, "build", counting)
    return n


@pytest.mark.parametrize("kept", [0, 6], ids=["nothing-kept", "some-kept"])
def test_raw_experts_give_the_resident_int8_bits(kquant_moe, monkeypatch, raw_builds, kept):
    ids = ids_of(60, seed=4)
    resident = _engine(load_gguf(kquant_moe, torch.float32, keep_quantized=True, lanes=True), "int8")
    whole = resident.logits(ids)
    assert whole.isfinite().all()
    one = resident.model.experts.get(0, 0).nbytes
    streamed = _streamed(kquant_moe, EXPERTS_IN_USE * 2 * one + kept * one, monkeypatch, raw=True)
    store = streamed.model.experts
    assert isinstance(store, StreamedExperts) and store._direct is not None
    assert {x.qtype for slabs in store._slabs.values() for x in slabs} == {12, 14}     # Q4_K and Q6_K
    assert torch.equal(streamed.logits(ids), whole)
    assert raw_builds[0] > 0 and store.stats.evictions >= raw_builds[0]
    assert store.ring_bytes == 0, "no expert served unkept was converted into a ring slot"

    # chunked prefill (experts seeing a few rows each) then decode steps: the same bits
    streamed.runner.chunk_size = resident.runner.chunk_size = 7
    assert torch.equal(streamed.runner.prefill(streamed.slots[0], ids[:-1]), whole[-2])
    assert torch.equal(streamed.runner.decode(streamed.slots[0], ids[-1]), whole[-1])
    assert len(store) <= kept + 2 and store.nbytes + store.ring_reserve <= EXPERTS_IN_USE * 2 * one + kept * one
    # the raw experts' buffers: EXPERTS_IN_USE held, the rest back in the reader's free list
    assert sum(x.raw is not None for x in store._unkept) <= EXPERTS_IN_USE


def test_raw_off_converts_every_expert_with_the_same_bits(kquant_moe, monkeypatch, raw_builds):
    ids = ids_of(40, seed=5)
    on = _streamed(kquant_moe, 0, monkeypatch, raw=True)
    want = on.logits(ids)
    assert raw_builds[0] > 0
    before = raw_builds[0]
    off = _streamed(kquant_moe, 0, monkeypatch, raw=False)
    assert torch.equal(off.logits(ids), want)
    assert raw_builds[0] == before and off.model.experts.ring_bytes > 0


def test_a_raw_expert_is_valid_for_experts_in_use_more_unkept_gets(kquant_moe, monkeypatch, raw_builds):
    """The [RING] contract for [RAW] experts: the buffer an expert multiplies from goes back to the reader only
    when EXPERTS_IN_USE more experts have been served unkept after it."""
    e = _streamed(kquant_moe, 0, monkeypatch, raw=True)
    store, raw = e.model.experts, e.model.native[0].raw
    assert raw is not None
    got = [store.get(0, x, 1, raw) for x in range(EXPERTS_IN_USE)]
    assert all(g.raw is not None for g in got) and raw_builds[0] == EXPERTS_IN_USE
    free = store._direct._free
    assert not any(g.raw is f for g in got for f in free), "held buffers are not free"
    store.get(0, EXPERTS_IN_USE, 1, raw)
    assert any(got[0].raw is f for f in free) and not any(g.raw is f for g in got[1:] for f in free)
    with pytest.raises(RuntimeError, match="native MoE layer only"):
        got[1].gate_up(torch.zeros(1, 512))


def test_miss_groups_cover_every_expert_once_held_first():
    """[MISS-GROUPS] the product calls' ranges: the held experts EXPERTS_IN_USE at a time, then the misses in
    groups of their own, every expert in exactly one call, in order."""
    for n, held, group, miss in ((13, 5, 8, 1), (20, 0, 8, 8), (8, 8, 8, 1), (30, 17, 8, 3), (1, 0, 8, 1)):
        spans = moe_layer._spans(n, held, group, miss)
        assert [i for a, b in spans for i in range(a, b)] == list(range(n))
        assert all(b <= held or a >= held for a, b in spans), "no call mixes held experts and misses"
        assert all(b - a <= (group if b <= held else miss) for a, b in spans)
