"""The two pure planners, property-tested without a model.

kv/placement.plan_placement: [0, keep) reused from the slot | [keep, loaded) loaded from tier blocks |
[loaded, n) prefilled. step_plan.plan_step: how many rows each running sequence feeds in one step.
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ternlm.kv.placement import plan_placement
from ternlm.engine.step_plan import Want, plan_step


@st.composite
def placement_inputs(draw):
    block = draw(st.sampled_from([1, 4, 64]))
    n = draw(st.integers(1, 400))
    record_len = draw(st.integers(0, 400))
    min_reuse = draw(st.integers(0, 40))
    # what decide_reuse can return: 0, or a value in [min_reuse, min(n - 1, record_len)]
    # (k may pass first_embed: a slot whose embedding payload digests match keeps it)
    hi, lo = min(n - 1, record_len), max(min_reuse, 1)
    k = draw(st.one_of(st.just(0), st.integers(lo, hi))) if hi >= lo else 0
    first_embed = draw(st.one_of(st.just(n), st.integers(0, n)))
    tier_blocks = draw(st.integers(0, -(-n // block) + 1))
    # what store.find_tail can return: a tail continuing the prompt after those blocks, < one block
    room = min(block - 1, n - 1 - tier_blocks * block)
    tail_tokens = draw(st.one_of(st.just(0), st.integers(1, room))) if room >= 1 else 0
    store = draw(st.booleans())
    return dict(n=n, record_len=record_len, slot_usable=k, tier_blocks=tier_blocks, first_embed=first_embed,
                min_reuse=min_reuse, store=store, block=block, tail_tokens=tail_tokens)


@settings(max_examples=2000, deadline=None)
@given(placement_inputs())
def test_placement_ranges_and_rules(kw):
    p = plan_placement(**kw)
    n, k, block = kw["n"], kw["slot_usable"], kw["block"]
    # [0, keep) reused | [keep, loaded) loaded | [loaded, n) prefilled: a partition, >= 1 token fed
    assert 0 <= p.keep <= p.loaded <= max(n - 1, 0)
    assert p.reused + p.prefill == n and p.prefill >= 1            # [FRESH-LOGITS]
    assert p.keep <= k <= p.loaded                                 # the tiers never make it worse
    assert p.save_slot == (kw["store"] and k < kw["record_len"])   # saved before anything is discarded
    whole = kw["tier_blocks"] * block
    if p.loaded > k:                                               # the tiers are used
        assert kw["store"] and p.loads
        assert p.loaded >= kw["min_reuse"] and p.loaded <= kw["first_embed"]   # no entry carries an embed
        assert p.keep % block == 0 and p.first_block * block == p.keep
        assert p.blocks == -(-(p.loaded - p.tail - p.keep) // block)
        assert p.first_block + p.blocks <= kw["tier_blocks"]       # only blocks the tiers hold
        assert p.loaded <= whole + kw["tail_tokens"]
        assert 0 <= p.tail <= kw["tail_tokens"]
        if p.tail:                                                 # a tail follows all the tiers' blocks
            assert p.first_block + p.blocks == kw["tier_blocks"] and p.loaded == whole + p.tail
        else:
            assert p.blocks >= 1 and p.loaded <= whole
    else:
        assert p.keep == p.loaded == k and p.blocks == 0 and p.tail == 0 and not p.loads
    assert p.reset == (p.keep == 0)


@settings(max_examples=500, deadline=None)
@given(placement_inputs(), st.integers(0, 8))
def test_placement_monotone_in_tier_blocks_and_save_independent(kw, more):
    a = plan_placement(**kw)
    b = plan_placement(**(kw | {"tier_blocks": kw["tier_blocks"] + more}))
    assert b.loaded >= a.loaded
    assert a.loaded >= plan_placement(**(kw | {"tail_tokens": 0})).loaded   # a tail never makes it worse
    assert a.save_slot == b.save_slot == plan_placement(**(kw | {"tier_blocks": 0})).save_slot


def test_placement_examples():
    # a slot holding 100 usable positions, tiers holding 3 blocks of 64 of a 300-token prompt
    p = plan_placement(n=300, record_len=120, slot_usable=100, tier_blocks=3, first_embed=300,
                       min_reuse=16, store=True, block=64)
    assert (p.keep, p.loaded, p.first_block, p.blocks, p.save_slot) == (64, 192, 1, 2, True)
    # the tiers give no more than the slot: keep the slot's prefix, load nothing
    p = plan_placement(n=300, record_len=100, slot_usable=100, tier_blocks=1, first_embed=300,
                       min_reuse=16, store=True, block=64)
    assert (p.keep, p.loaded, p.blocks, p.save_slot) == (100, 100, 0, False)
    # an identical resend of a 128-token prompt: tiers hold both blocks, the last token is refed
    p = plan_placement(n=128, record_len=0, slot_usable=0, tier_blocks=2, first_embed=128,
                       min_reuse=16, store=True, block=64)
    assert (p.keep, p.loaded, p.blocks) == (0, 127, 2) and p.reset
    # tiers below min_reuse are not worth a load
    p = plan_placement(n=300, record_len=0, slot_usable=0, tier_blocks=1, first_embed=300,
                       min_reuse=100, store=True, block=64)
    assert p.loaded == 0 and p.blocks == 0
    # a 40-token chat, no whole block: its tail entry gives all but the last token (as a slot would)
    p = plan_placement(n=41, record_len=0, slot_usable=0, tier_blocks=0, first_embed=41,
                       min_reuse=16, store=True, tail_tokens=40, block=64)
    assert (p.keep, p.loaded, p.blocks, p.tail) == (0, 40, 0, 40)
    # 3 blocks and a 38-token tail in the tiers, 100 usable positions in the slot: keep block 0
    p = plan_placement(n=300, record_len=120, slot_usable=100, tier_blocks=3, first_embed=300,
                       min_reuse=16, store=True, tail_tokens=38, block=64)
    assert (p.keep, p.loaded, p.first_block, p.blocks, p.tail) == (64, 230, 1, 2, 38)
    # the slot has all the blocks and part of the tail: only the tail's rest is worth a load
    p = plan_placement(n=300, record_len=200, slot_usable=200, tier_blocks=3, first_embed=300,
                       min_reuse=16, store=True, tail_tokens=38, block=64)
    assert (p.keep, p.loaded, p.blocks, p.tail) == (192, 230, 0, 38)
    # an embedding inside the tail's range cuts it there
    p = plan_placement(n=300, record_len=0, slot_usable=0, tier_blocks=3, first_embed=200,
                       min_reuse=16, store=True, tail_tokens=38, block=64)
    assert (p.loaded, p.blocks, p.tail) == (200, 3, 8)
    # no store: the slot's decision stands
    p = plan_placement(n=300, record_len=200, slot_usable=150, tier_blocks=4, first_embed=300,
                       min_reuse=16, store=False, block=64)
    assert (p.keep, p.loaded, p.save_slot) == (150, 150, False)


wants = st.lists(st.builds(Want, st.integers(1, 500), st.booleans()), max_size=12).map(
    lambda ws: [Want(1, True) if w.decoding else w for w in ws])


@settings(max_examples=2000, deadline=None)
@given(wants, st.integers(1, 300), st.integers(1, 300))
def test_plan_step_rules(ws, budget, chunk):
    out = plan_step(ws, budget, chunk)
    assert len(out) == len(ws)
    decodes = sum(w.decoding for w in ws)
    prefills = [i for i, w in enumerate(ws) if not w.decoding]
    for i, w in enumerate(ws):
        if w.decoding:
            assert out[i] == 1                                   # a decode always runs
        else:
            assert 0 <= out[i] <= min(w.pending, chunk)
    if ws:
        assert sum(out) >= 1                                     # progress
    if prefills:
        assert out[prefills[0]] >= 1                             # the oldest prefill is never starved
    cap = budget if decodes else max(budget, chunk)
    assert sum(out) <= max(cap, decodes + (1 if prefills else 0))
    order = sorted(prefills, key=lambda i: (ws[i].pending, i))  # shortest remaining prefill first
    for k, j in enumerate(order):
        if out[j] > (1 if j == prefills[0] else 0):              # j got rows beyond the guaranteed one
            assert all(out[i] == min(ws[i].pending, chunk) for i in order[:k])
    if prefills:                                                 # rows left unused only when all are served
        if sum(out) < cap:
            assert all(out[i] == min(ws[i].pending, chunk) for i in prefills)
    if not decodes and len(prefills) == 1:
        assert out[prefills[0]] == min(ws[prefills[0]].pending, chunk)   # alone: whole chunks


def test_plan_step_examples():
    # 7 decodes and a 4,000-token cold prompt, budget 64: the prompt gets 57 rows beside the decodes
    ws = [Want(1, True)] * 7 + [Want(4000, False)]
    assert plan_step(ws, 64, 256) == [1] * 7 + [57]
    # nothing decodes: the prompt takes a whole chunk
    assert plan_step([Want(4000, False)], 64, 256) == [256]
    # two prefills of equal length share the budget in admission order
    assert plan_step([Want(1, True), Want(40, False), Want(40, False)], 64, 256) == [1, 40, 23]
    # a follow-up turn (60 tokens left) admitted after a cold prompt goes first; the cold one keeps moving
    assert plan_step([Want(1, True), Want(4000, False), Want(60, False)], 64, 256) == [1, 3, 60]
    # decodes alone fill the budget: the oldest prefill still gets its row, the shorter one waits
    assert plan_step([Want(1, True)] * 4 + [Want(500, False), Want(9, False)], 4, 256) == [1] * 4 + [1, 0]
