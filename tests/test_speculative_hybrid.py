"""Speculative decoding on a hybrid model (issues 47, 48): a slot with a recurrent state cannot cut it back past
rows it took, so a verify step with rejected rows rewinds to the state held before the step and feeds the rows
that stand again at the head of the next step [VERIFY-REWIND] (sequence.py, kv/slots.py). The answer must not
change: oracle, the same engine with speculation off (plain one-token decoding, itself tested against
transformers in test_hybrid.py), token for token and logits bit for bit, greedy and seeded sampling, alone and
batched; after a run the slot's record must describe exactly its KV and its recurrent state (a fresh prefill of the
record gives the same bits), so a later turn reuses nothing a rejected row wrote.
"""
from __future__ import annotations

import dataclasses

import pytest

from ternlm.engine.sampling import Penalties
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from hybrid_checks import folder_engine, save_folder
from test_batching import alone, together
from test_hybrid import hf_qwen35
from test_reuse import assert_record_matches_kv
from tiny import tiny_loaded
from ternlm.engine.spec.draft_model import DraftModel
from ternlm.engine.core import Engine
from ternlm.kv.slots import Slot


# The KV formats: auto (fp32 here) and q8_0 (int8 codes + fp16 scales, rows of a multiple of 32 values: the
# model with head_dim 32). Speculation on and off, and the cold oracle, run the same format and model.
KVS = {"auto": ({}, {}), "q8_0": ({"head_dim": 32}, {"kv_dtype": "q8_0"})}


@pytest.fixture(scope="module", params=list(KVS))
def target(request, tmp_path_factory):
    """(folder, Engine kwargs) of a KV format."""
    model_kw, engine_kw = KVS[request.param]
    path = tmp_path_factory.mktemp("qwen35-spec")
    save_folder(hf_qwen35(seed=3, **model_kw), path)
    return path, engine_kw


@pytest.fixture(scope="module")
def engine(target):
    folder, kw = target
    e = folder_engine(folder, chunk_size=16, slots=6, state_interval=32, **kw)
    assert e.kv_dtype == kw.get("kv_dtype", "float32")
    return e


def _looping(engine, n: int = 40) -> list[int]:
    """A prompt whose greedy answer repeats it (the model's own answer to [5, 6, 7], then [5, 6, 7] again):
    lookup drafts are found and mostly taken, so the rewind runs on the steps where one is not."""
    base = engine.generate([5, 6, 7], max_tokens=n, ignore_eos=True, speculative=False).token_ids
    return [5, 6, 7] + base + [5, 6, 7]


def assert_record_matches_state(engine, slot: Slot) -> None:
    """The slot's KV and its recurrent state are those a fresh prefill of its record gives, bit for bit."""
    fed = slot.record.fed
    fresh = Slot(99, slot.shape, initial_capacity=len(fed), recurrent=slot.state.shape,
                 state_interval=slot.state.interval)
    engine.runner.prefill(fresh, fed)
    n = len(fed)
    assert torch.equal(slot.k[:, :, :n], fresh.k[:, :, :n]) and torch.equal(slot.v[:, :, :n], fresh.v[:, :, :n])
    assert slot.state.pos == fresh.state.pos == n
    assert torch.equal(slot.state.conv, fresh.state.conv) and torch.equal(slot.state.ssm, fresh.state.ssm)


def _both(engine, prompt, max_tokens, **kw):
    off, _ = alone(engine, prompt, max_tokens, speculative=False, **kw)
    on, slot = alone(engine, prompt, max_tokens, speculative=True, **kw)
    assert on.token_ids == off.token_ids and on.text == off.text and on.finish_reason == off.finish_reason
    assert torch.equal(on.logits, off.logits)
    assert_record_matches_state(engine, slot)
    return on, off


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11},
                                      {"penalties": Penalties(repetition=1.2, frequency=0.3)},
                                      {"temperature": 0.9, "seed": 11, "penalties": Penalties(1.1, last_n=8)}],
                         ids=["greedy", "seeded", "greedy-penalties", "seeded-penalties"])
def test_a_hybrid_model_speculates_and_answers_as_plain_decoding(engine, sampling):
    """Drafts are taken and some rejected (the rewind runs), the answer and every logit are plain decoding's,
    and the slot's record, KV and state agree."""
    on, off = _both(engine, _looping(engine), 60, **sampling)
    assert off.timings.drafted == 0
    if not sampling:
        assert 0 < on.timings.accepted < on.timings.drafted, on.timings


def test_verify_steps_take_no_snapshots_of_their_own(engine):
    """A verify step is no prefill end: its rows leave no snapshot but the grid's (each one would push a
    message start or the prompt's end out of the snapshot budget)."""
    prompt = _looping(engine)
    on, slot = alone(engine, prompt, 50, speculative=True)
    assert on.timings.drafted > 0
    assert all(p <= len(prompt) or p % slot.state.interval == 0 for p in slot.state.snaps), sorted(slot.state.snaps)


segments = st.lists(st.integers(3, 255), min_size=2, max_size=10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(head=segments, seg=segments, reps=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.8]),
       seed=st.integers(0, 2**31), max_tokens=st.integers(1, 30))
def test_any_prompt_same_answer(engine, head, seg, reps, temperature, seed, max_tokens):
    """Prompts with repeated segments (lookup finds drafts), answers of any length (drafts cut by max_tokens,
    a rewind on the last step), greedy and seeded sampling."""
    _both(engine, head + seg * reps + seg[:1], max_tokens, temperature=temperature, seed=seed)


def _batched_equals_alone(engine, reqs) -> list:
    """Speculating streams batched with plain ones and prefills (joining at steps 0, 1, 1, 4): each one's answer
    alone with speculation off, token for token and logits bit for bit; every slot's KV and state exact."""
    solo = [alone(engine, p, m, speculative=False)[0] for p, m in reqs]
    batched = together(engine, reqs, [0, 1, 1, 4], budget=24, speculative=True)
    for i, (b, a) in enumerate(zip(batched, solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i
        assert_record_matches_state(engine, engine.slots[i + 1])
    return batched


def test_batched_with_other_streams_same_answers(engine):
    """Speculating hybrid streams batched with plain ones and prefills: each one's answer alone, spec off."""
    loop = _looping(engine)
    batched = _batched_equals_alone(engine, [(loop, 40), (list(range(3, 60)), 12), (loop[:20] + loop, 30),
                                             ([9, 8, 7] * 9, 25)])
    assert sum(b.timings.accepted for b in batched) > 0


def test_the_next_turn_resumes_from_what_was_kept(engine, target):
    """After a speculative answer with rejected rows, the next turn (prompt + answer + more) resumes at the end
    of what the slot kept (its live state) and answers as a cold engine would, bit for bit."""
    cold = folder_engine(target[0], prefix_reuse=False, **target[1])
    prompt = _looping(engine)
    engine.slots[0].reset()
    one = engine.generate(prompt, max_tokens=30, ignore_eos=True, slot=0, speculative=True)
    assert one.timings.drafted > one.timings.accepted
    kept = len(engine.slots[0].record)
    assert len(prompt) <= kept <= len(prompt) + len(one.token_ids)
    nxt = prompt + one.token_ids + [7, 7, 7]
    two = engine.generate(nxt, max_tokens=20, ignore_eos=True, slot=0, keep_logits=True, speculative=True)
    ref = cold.generate(nxt, max_tokens=20, ignore_eos=True, keep_logits=True, speculative=False)
    assert two.cached_tokens == kept
    assert two.token_ids == ref.token_ids and torch.equal(two.logits, ref.logits)


# ---- a draft model for a hybrid target ------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafted(target, engine):
    """The same hybrid target with a draft model: a tiny random llama wearing the target's tokenizer (a llama
    cannot mimic a qwen35: its drafts are rejected, all of them on these prompts, and every such step rewinds)."""
    _, small = tiny_loaded("llama", seed=5, vocab=engine.config.vocab_size)
    small = Engine(dataclasses.replace(small, tokenizer=engine.tokenizer), dtype=torch.float32, min_reuse=1,
                   chunk_size=16, slots=6, speculative=False)
    return folder_engine(target[0], chunk_size=16, slots=6, state_interval=32, draft=DraftModel(small), **target[1])


def _both_drafted(engine, prompt, max_tokens, **kw):
    on, off = _both(engine, prompt, max_tokens, **kw)
    small = engine.drafts.engine
    assert_record_matches_kv(small, small.slots[0])
    return on, off


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"])
def test_a_draft_model_drafts_for_a_hybrid_target(drafted, sampling):
    """Drafts from the draft model are verified, rejected ones rewind the target's state; the answer and every
    logit are plain decoding's, both slots' records exact."""
    drafted_n = accepted = 0
    for prompt in ([5, 6, 7], list(range(3, 60)), [9, 8, 7] * 9):
        on, off = _both_drafted(drafted, prompt, 40, **sampling)
        drafted_n, accepted = drafted_n + on.timings.drafted, accepted + on.timings.accepted
    assert drafted_n > accepted, (drafted_n, accepted)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(3, 255), min_size=1, max_size=40), temperature=st.sampled_from([0.0, 0.8]),
       seed=st.integers(0, 2**31), max_tokens=st.integers(1, 30))
def test_a_draft_model_any_prompt_same_answer(drafted, prompt, temperature, seed, max_tokens):
    _both_drafted(drafted, prompt, max_tokens, temperature=temperature, seed=seed)


def test_a_draft_model_batched_with_other_streams(drafted):
    batched = _batched_equals_alone(drafted, [([5, 6, 7], 30), (list(range(3, 60)), 12), ([1, 2] * 20, 30),
                                              ([9, 8, 7] * 9, 25)])
    assert sum(b.timings.drafted for b in batched) > 0
