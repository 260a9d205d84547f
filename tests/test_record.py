"""Unit tests of PrefixRecord, the reuse decision and the slot lifecycle, on fake KV.

The fake model writes each position's token id into K and its position into V, so after any
sequence of operations a test can read off exactly what the KV holds and compare it with the record.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ternlm.models.config import ModelConfig
from ternlm.kv.record import PrefixRecord, decide_reuse, lcp
from ternlm.kv.slots import ContextOverflow, KVShape, Slot
from ternlm.engine.runner import Embed, Runner

NS = b"ns"


class FakeModel:
    """Stands in for Transformer: K[..., pos, :] = token id, V[..., pos, :] = position."""
    dtype = torch.float32
    cfg = ModelConfig("llama", 1000, 4, 4, 2, 1, 1, 2, 1e4, 1e-6, 10_000, True)

    def embed_ids(self, ids):
        return ids.float().unsqueeze(1).repeat(1, 4)        # (T, hidden)

    def __call__(self, x, start, k_cache, v_cache, all_logits=False):
        T = x.shape[0]
        k_cache[:, :, start:start + T, :] = x[:, :1].view(1, 1, T, 1)
        v_cache[:, :, start:start + T, :] = torch.arange(start, start + T, dtype=torch.float32).view(1, 1, T, 1)
        return torch.zeros(T, 1000)

    def forward_batch(self, x, segments):
        """The batched interface the runner calls: each segment through __call__ on its own rows."""
        out, r0 = [], 0
        for s in segments:
            logits = self(x[r0:r0 + s.length], s.start, s.k_cache, s.v_cache)
            out.append(None if s.logits == "none" else logits if s.logits == "all" else logits[-1:])
            r0 += s.length
        return out


def make_slot(cap=4, max_cap=64):
    return Slot(0, KVShape(2, 1, 2, torch.float32, max_cap), initial_capacity=cap)


def assert_integrity(slot: Slot):
    """The record equals the ids actually in the KV, position by position."""
    n = len(slot.record)
    assert slot.k[:, :, :n, :].eq(torch.tensor(slot.record.fed, dtype=torch.float32).view(1, 1, n, 1)).all()
    assert slot.v[:, :, :n, :].eq(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)).all()


def test_lcp():
    assert lcp([], [1]) == 0
    assert lcp([1, 2, 3], [1, 2, 3]) == 3
    assert lcp([1, 2, 3], [1, 2, 4]) == 2
    a = list(range(1000))
    b = a[:700] + [-1] + a[701:]
    assert lcp(a, b) == 700
    assert lcp(a, a[:600]) == 600


@given(st.lists(st.integers(0, 3), max_size=600), st.lists(st.integers(0, 3), max_size=600))
def test_lcp_matches_naive(a, b):
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert lcp(a, b) == naive


def test_grow_keeps_record_and_kv():
    slot, runner = make_slot(cap=4), Runner(FakeModel(), chunk_size=3)
    runner.prefill(slot, list(range(10, 20)))
    assert slot.capacity >= 10 and slot.record.fed == list(range(10, 20))
    assert_integrity(slot)


def test_truncate_then_prefill_keeps_prefix():
    slot, runner = make_slot(), Runner(FakeModel(), chunk_size=4)
    runner.prefill(slot, [5] * 12)
    slot.record.truncate(7)
    runner.prefill(slot, [9, 9, 9])
    assert slot.record.fed == [5] * 7 + [9] * 3
    assert_integrity(slot)


def test_write_past_capacity_empties_record():
    slot, runner = make_slot(cap=4, max_cap=16), Runner(FakeModel(), chunk_size=4)
    runner.prefill(slot, list(range(12)))
    with pytest.raises(ContextOverflow):
        runner.prefill(slot, list(range(8)))
    assert len(slot.record) == 0          # emptied, not left at 12 or partially extended


def test_failed_grow_drops_record(monkeypatch):
    slot, runner = make_slot(cap=4), Runner(FakeModel(), chunk_size=4)
    runner.prefill(slot, [1, 2, 3, 4])

    def boom(*a, **k):
        raise MemoryError("no room")
    monkeypatch.setattr(torch, "zeros", boom)
    with pytest.raises(MemoryError):
        slot.ensure_capacity(8)
    monkeypatch.undo()
    assert len(slot.record) == 0


def test_exception_mid_prefill_leaves_exact_record():
    slot, runner = make_slot(), Runner(FakeModel(), chunk_size=4)

    def fault(end):
        if end == 8:
            raise RuntimeError("injected")
    with pytest.raises(RuntimeError):
        runner.prefill(slot, list(range(100, 120)), on_chunk=fault)
    assert slot.record.fed == list(range(100, 108))
    assert_integrity(slot)


def test_exception_inside_model_call_records_nothing_of_that_chunk():
    slot, model = make_slot(), FakeModel()
    runner = Runner(model, chunk_size=4)
    runner.prefill(slot, [1, 2, 3, 4])
    real = FakeModel.__call__

    def flaky(self, x, start, k, v, all_logits=False):
        real(self, x, start, k, v)   # the write happens, then the call fails
        raise RuntimeError("mid-forward")
    FakeModel.__call__ = flaky
    try:
        with pytest.raises(RuntimeError):
            runner.prefill(slot, [7, 7, 7, 7])
    finally:
        FakeModel.__call__ = real
    assert slot.record.fed == [1, 2, 3, 4]
    assert_integrity(slot)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["prefill", "decode", "truncate", "reset"]),
                          st.lists(st.integers(0, 999), min_size=1, max_size=9),
                          st.integers(0, 40)), max_size=25))
def test_random_operations_keep_integrity(ops):
    slot, runner = make_slot(cap=2, max_cap=4096), Runner(FakeModel(), chunk_size=4)
    for op, ids, k in ops:
        if op == "prefill":
            runner.prefill(slot, ids)
        elif op == "decode":
            runner.decode(slot, ids[0])
        elif op == "truncate":
            slot.record.truncate(k)
        else:
            slot.reset(NS)
        assert_integrity(slot)


def rec(ids, ns=NS):
    r = PrefixRecord(namespace=ns)
    r.append(list(ids))
    return r


def test_decision_rules():
    r = rec(range(100))
    assert decide_reuse(r, list(range(100)) + [5], NS).tokens == 100
    same = decide_reuse(r, list(range(100)), NS)
    assert same.tokens == 99                        # [FRESH-LOGITS] identical resend feeds its last token
    assert decide_reuse(r, list(range(50)), NS).tokens == 49    # shorter resend
    d = decide_reuse(r, list(range(40)) + [7, 7], NS)
    assert d.tokens == 40 and "diverged at token 40 of record 100" in d.reason
    assert decide_reuse(r, list(range(40)) + [7], NS, message_ends=[10, 30, 45]).reason.endswith("(message 2)")
    small = decide_reuse(r, list(range(9)) + [7], NS)
    assert small.tokens == 0 and small.reason.startswith("below min_reuse (9 < 16)")
    assert decide_reuse(r, list(range(101)), b"other").reason == "namespace differs"
    assert decide_reuse(r, list(range(101)), NS, enabled=False).reason == "reuse disabled"
    assert decide_reuse(rec(range(40)), [0, 99] + list(range(2, 40)), NS, min_reuse=0).tokens == 1
    assert decide_reuse(rec(range(40)), [99] + list(range(1, 40)), NS, min_reuse=0).tokens == 0


def test_decision_taint_and_digests():
    r = PrefixRecord(namespace=NS)
    r.append(list(range(30)), digests={20: b"A"})
    prompt = list(range(30)) + [1]
    assert decide_reuse(r, prompt, NS, prompt_digests={20: b"A"}).tokens == 30
    d = decide_reuse(r, prompt, NS, prompt_digests={20: b"B"})
    assert d.tokens == 20 and "payload differs at 20" in d.reason
    assert decide_reuse(r, prompt, NS, prompt_digests={}).tokens == 20       # plain token vs embedding
    assert decide_reuse(r, prompt, NS, prompt_digests={25: b"C"}).tokens == 20
    t = PrefixRecord(namespace=NS)
    t.append(list(range(30)), taint_at=18)
    d = decide_reuse(t, prompt, NS, min_reuse=1)
    assert d.tokens == 18 and d.reason == "tainted at 18"
    t.truncate(10)
    assert t.tainted_from is None and decide_reuse(t, prompt, NS, min_reuse=1).tokens == 10


def test_runner_records_digests_and_taint():
    slot, runner = make_slot(), Runner(FakeModel(), chunk_size=4)
    e = torch.zeros(4)
    runner.prefill(slot, list(range(10)), embeds={3: Embed(e, b"d3"), 6: Embed(e, None)})
    assert slot.record.digests[3] == b"d3"
    assert slot.record.tainted_from == 6
