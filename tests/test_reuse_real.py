"""Prefix reuse on the real model: MT-Bench conversations, turn 2 sent with the whole transcript as a
chat client does. Greedy text with reuse on == off, and turn 2 reuses turn 1's KV."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import TEST_DATA
from ternlm import Engine

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def questions():
    path = TEST_DATA / "mt_bench_question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # 10 conversations across the categories
    return [rows[i] for i in range(0, 80, 8)]


@pytest.fixture(scope="module")
def cold():
    return Engine.load("smollm2-135m", dtype="float32", prefix_reuse=False)


def test_mt_bench_turn2_identical_and_reused(smollm2_f32, cold, questions):
    warm = smollm2_f32
    for q in questions:
        msgs = [{"role": "user", "content": q["turns"][0]}]
        a1 = warm.generate(warm.apply_chat_template(msgs), max_tokens=MAX_TOKENS)
        b1 = cold.generate(cold.apply_chat_template(msgs), max_tokens=MAX_TOKENS)
        assert a1.text == b1.text
        msgs += [{"role": "assistant", "content": a1.text}, {"role": "user", "content": q["turns"][1]}]
        a2 = warm.generate(warm.apply_chat_template(msgs), max_tokens=MAX_TOKENS)
        b2 = cold.generate(cold.apply_chat_template(msgs), max_tokens=MAX_TOKENS)
        assert a2.text == b2.text, f"question {q['question_id']}"
        assert a2.cached_tokens > 0 and b2.cached_tokens == 0
        # everything up to the end of turn 1's prompt at least is reused
        assert a2.cached_tokens >= a1.prompt_tokens, (q["question_id"], a2.reuse.reason)


def test_divergence_names_the_message(smollm2_f32):
    e = smollm2_f32
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour of the sky on a clear day, please."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And at sunset?"}]
    e.generate(e.apply_chat_template(msgs), max_tokens=4)
    edited = [dict(m) for m in msgs]
    edited[2]["content"] = "Blue, mostly."                  # the client rewrote history in message 2
    out = e.generate(e.apply_chat_template(edited), max_tokens=4)
    assert "(message 2)" in out.reuse.reason
    assert 0 < out.cached_tokens < out.prompt_tokens


@pytest.mark.parametrize("engine_name", ["smollm2_f32", "smollm2_bf16"])
def test_decoded_kv_is_bit_identical_to_prefilled_kv(engine_name, request, questions):
    """[BATCH-INVARIANT] on the real model: KV written one decode step at a time equals, bit for bit,
    the KV a single prefill of the same record writes. This is what makes reusing a conversation's
    own answer (its decoded KV) exact; the tiny-model tests cannot see kernel choices that only the
    real shapes trigger (bf16 one-row projections on CPUs without AMX did differ)."""
    from ternlm.kv.slots import Slot
    engine = request.getfixturevalue(engine_name)
    msgs = [{"role": "user", "content": questions[1]["turns"][0]}]
    out = engine.generate(engine.apply_chat_template(msgs), max_tokens=24, ignore_eos=True)
    slot = engine.slots[out.slot]
    fed = slot.record.fed
    assert len(fed) == out.prompt_tokens + 23          # the last sampled token is never fed
    fresh = Slot(99, slot.shape, initial_capacity=len(fed))
    engine.runner.prefill(fresh, fed)
    n = len(fed)
    assert torch.equal(slot.k[:, :, :n], fresh.k[:, :, :n])
    assert torch.equal(slot.v[:, :, :n], fresh.v[:, :, :n])
