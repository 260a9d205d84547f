"""Equivalence of reuse: with prefix KV reuse on, every turn gives the same greedy tokens and
bit-identical logits as a cold run, and the record equals the ids behind the KV (bit-identical KV
when recomputed from the record alone). Bit-exactness holds because attention is batch-invariant
([BATCH-INVARIANT] in models/llama.py): a position's K/V do not depend on how tokens were batched.

Tiny random models built by transformers, fp32 and bf16, chunk size 8 so tails span several chunks.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ternlm.kv.slots import Slot
from conftest import needs_bf16
from tiny import tiny_engine


# q8_0: the KV as int8 codes + fp16 scales (kv/kvtype.py), written by the native kernels on the torch layers'
# table path; its rows need a head_dim that is a multiple of 32, hence head_dim 32. Warm and cold are both q8_0.
Q8 = dict(kv_dtype="q8_0", head_dim=32)


@pytest.fixture(scope="module", params=[pytest.param(("llama", torch.float32, {}), id="llama-fp32"),
                                        pytest.param(("qwen2", torch.float32, {}), id="qwen2-fp32"),
                                        pytest.param(("qwen3", torch.float32, {}), id="qwen3-fp32"),
                                        pytest.param(("llama", torch.float32, Q8), id="llama-q8_0"),
                                        pytest.param(("llama", torch.bfloat16, {}), id="llama-bf16", marks=needs_bf16)])
def engines(request):
    arch, dtype, kv = request.param
    _, warm = tiny_engine(arch, seed=1, prefix_reuse=True, min_reuse=1, chunk_size=8, dtype=dtype, **kv)
    _, cold = tiny_engine(arch, seed=1, prefix_reuse=False, chunk_size=8, dtype=dtype, **kv)
    assert warm.kv_dtype == cold.kv_dtype == kv.get("kv_dtype", warm.kv_dtype)
    return warm, cold


def assert_record_matches_kv(engine, slot: Slot):
    """Recompute the KV from the record alone and compare with what the slot holds."""
    fed = slot.record.fed
    if not fed:
        return
    fresh = Slot(99, slot.shape, initial_capacity=len(fed))
    engine.runner.prefill(fresh, fed)
    n = len(fed)
    assert torch.equal(slot.k[:, :, :n], fresh.k[:, :, :n])
    assert torch.equal(slot.v[:, :, :n], fresh.v[:, :, :n])


def run_both(warm, cold, prompt, max_tokens):
    a = warm.generate(prompt, max_tokens=max_tokens, keep_logits=True)
    b = cold.generate(prompt, max_tokens=max_tokens, keep_logits=True)
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert torch.equal(a.logits, b.logits)
    assert b.cached_tokens == 0
    assert_record_matches_kv(warm, warm.slots[0])
    return a


# A turn: how the next prompt is made from the previous prompt + answer.
turn = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 255), min_size=1, max_size=30)),
    st.tuples(st.just("diverge"), st.floats(0, 1), st.lists(st.integers(0, 255), min_size=1, max_size=30)),
    st.tuples(st.just("resend")),
    st.tuples(st.just("shorter"), st.floats(0, 1)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.lists(st.integers(0, 255), min_size=1, max_size=40), turns=st.lists(turn, min_size=1, max_size=4),
       max_tokens=st.integers(1, 6))
def test_reuse_equals_cold(engines, first, turns, max_tokens):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = list(first)
    out = run_both(warm, cold, prompt, max_tokens)
    for t in turns:
        history = prompt + out.token_ids
        if t[0] == "append":           # the normal chat turn: transcript + answer + new user text
            prompt = history + t[1]
        elif t[0] == "diverge":        # client rewrote history: cut anywhere, incl. inside the answer or at 0
            cut = int(t[1] * len(history))
            prompt = history[:cut] + t[2]
        elif t[0] == "resend":
            prompt = list(prompt)
        else:
            prompt = history[:max(1, int(t[1] * len(history)))]
        expected_k = min(len(prompt) - 1, max((i for i in range(len(prompt) + 1)
                                                if warm.slots[0].record.fed[:i] == prompt[:i]), default=0))
        out = run_both(warm, cold, prompt, max_tokens)
        assert out.cached_tokens == (expected_k if expected_k >= warm.min_reuse else 0)


def test_long_tail_spanning_chunks(engines):
    warm, cold = engines
    warm.slots[0].reset()
    p = list(range(50))
    out = run_both(warm, cold, p, 4)
    p2 = p + out.token_ids + list(range(100, 170))    # tail of ~70 tokens = 9 chunks of 8
    out2 = run_both(warm, cold, p2, 4)
    assert out2.cached_tokens >= 50


def test_fault_mid_prefill_then_correct(engines):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = [i % 200 for i in range(60)]

    def fault(end):
        if end >= 24:
            raise RuntimeError("injected fault")
    with pytest.raises(RuntimeError):
        warm.generate(prompt, max_tokens=3, on_chunk=fault)
    assert warm.slots[0].record.fed == prompt[:24]
    assert_record_matches_kv(warm, warm.slots[0])
    out = run_both(warm, cold, prompt, 5)
    assert out.cached_tokens == 24


def test_cancel_mid_decode_then_correct(engines):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = [i % 200 for i in range(30)]
    stream = warm.stream(prompt, max_tokens=10)
    got = [next(stream) for _ in range(3)]
    stream.close()                                  # the client went away after 3 tokens
    # three tokens were sampled, two of them fed back: the third was never written
    assert warm.slots[0].record.fed == prompt + [d.token_id for d in got[:2]]
    assert_record_matches_kv(warm, warm.slots[0])
    run_both(warm, cold, prompt + [7, 8, 9], 5)


def test_identical_resend_reuses_all_but_last(engines):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = list(range(40))
    run_both(warm, cold, prompt, 2)
    again = run_both(warm, cold, prompt, 2)
    assert again.cached_tokens == 39


def test_taint_same_ids_different_embeddings(engines):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = list(range(40))
    hidden = warm.config.hidden_size
    e1, e2 = torch.randn(hidden), torch.randn(hidden)
    a = warm.generate(prompt, max_tokens=3, embeds={20: e1}, keep_logits=True)
    b = warm.generate(prompt + [1], max_tokens=3, embeds={20: e2}, keep_logits=True)
    assert b.cached_tokens == 20                     # stops at the first differing payload
    ref = cold.generate(prompt + [1], max_tokens=3, embeds={20: e2}, keep_logits=True)
    assert b.token_ids == ref.token_ids
    assert torch.equal(b.logits, ref.logits)
    c = warm.generate(prompt + [1, 2], max_tokens=3, embeds={20: e2.clone()})
    assert c.cached_tokens == 41                     # same payload (bit-exact) reuses
    assert a.cached_tokens == 0


def test_undigested_embedding_taints(engines):
    warm, _ = engines
    warm.slots[0].reset()
    prompt = list(range(40))
    e = torch.randn(warm.config.hidden_size)
    warm.generate(prompt, max_tokens=2, embeds={25: e}, digest_embeds=False)
    assert warm.slots[0].record.tainted_from == 25
    again = warm.generate(prompt + [3], max_tokens=2, embeds={25: e}, digest_embeds=False)
    assert again.cached_tokens == 25 and again.reuse.reason == "tainted at 25"


def test_namespace_never_crosses(engines):
    warm, cold = engines
    warm.slots[0].reset()
    prompt = list(range(40))
    warm.generate(prompt, max_tokens=2, cache_salt="alice")
    bob = warm.generate(prompt + [1], max_tokens=2, cache_salt="bob")
    assert bob.cached_tokens == 0 and bob.reuse.reason == "namespace differs"
    alice = warm.generate(bob_prompt := prompt + [1], max_tokens=2, cache_salt="alice")
    assert alice.cached_tokens == 0          # the slot now holds bob's state
    assert warm.generate(bob_prompt + [2], max_tokens=2, cache_salt="alice").cached_tokens == 41


def test_reuse_disabled_reports_why(engines):
    _, cold = engines
    prompt = list(range(40))
    cold.generate(prompt, max_tokens=2)
    out = cold.generate(prompt + [1], max_tokens=2)
    assert out.cached_tokens == 0 and out.reuse.reason == "reuse disabled"
