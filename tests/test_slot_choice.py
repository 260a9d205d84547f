"""Slot choice with a prompt_cache_key pin whose slot another conversation has taken since.

A pin keeps a conversation in its slot while that slot still holds it. Once another conversation
ran there, a prompt that shares nothing with either slot (both score zero) must take the least
recently used slot instead of evicting the newcomer's warm KV for nothing.
"""
from __future__ import annotations

from ternlm.engine.scheduler import Finished, GenParams, GenRequest, Scheduler
from tiny import tiny_engine

P1 = [(7 * i + 1) % 250 for i in range(40)]
P3 = [(13 * i + 2) % 250 for i in range(40)]
P4 = [(17 * i + 9) % 250 for i in range(40)]


def run(sched: Scheduler, prompt, **kw) -> Finished:
    events = []
    sched.submit(GenRequest(list(prompt), GenParams(max_tokens=4), **kw), events.append)
    while sched.run_once():
        pass
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def test_pin_taken_over_by_another_conversation_is_not_evicted():
    _, eng = tiny_engine("llama", seed=3, slots=2, min_reuse=4, chunk_size=8, ctx=256)
    sched = Scheduler(eng)
    a = run(sched, P1, affinity="conv-a")
    pinned = a.completion.slot
    # conversation B shares a prefix with A's slot, so it takes that slot over (no key of its own)
    b = run(sched, P1[:20] + P3)
    assert b.completion.slot == pinned and b.completion.cached_tokens == 20
    other = 1 - pinned
    eng.slots[pinned].last_used = eng.slots[other].last_used + 1.0   # the other slot is the LRU one
    # A comes back with a prompt no slot can serve: both score zero -> the LRU slot, B's KV survives
    c = run(sched, P4, affinity="conv-a")
    assert c.completion.slot == other and c.completion.cached_tokens == 0
    assert eng.slots[pinned].record.fed[:60] == P1[:20] + P3
    # the pin follows the conversation to its new slot
    d = run(sched, P4 + c.completion.token_ids, affinity="conv-a")
    assert d.completion.slot == other and d.completion.cached_tokens > 0


def test_pin_still_holding_its_conversation_wins_a_tie():
    _, eng = tiny_engine("llama", seed=3, slots=2, min_reuse=4, chunk_size=8, ctx=256)
    sched = Scheduler(eng)
    a = run(sched, P1, affinity="conv-a")
    pinned = a.completion.slot
    eng.slots[1 - pinned].last_used = 0.0
    b = run(sched, P3, affinity="conv-a")          # nothing usable anywhere, but the slot is A's own
    assert b.completion.slot == pinned
