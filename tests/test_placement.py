"""The two pure planners, property-tested without a model.

kv/placement.plan_placement: [0, keep) reused from the slot | [keep, loaded) loaded from tier blocks |
[loaded, n) prefilled; plan_tiers / settle_tiers: the same around a fetch, with a hybrid slot's
recurrent-state rules. step_plan.plan_step: how many rows each running sequence feeds in one step.
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ternlm.kv.placement import Fetched, plan_placement, plan_tiers, settle_tiers
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


@st.composite
def tier_inputs(draw):
    """A placement with tiers, the slot's resume points (a hybrid slot's snapshots; None: attention alone),
    and what a fetch of the plan then reads."""
    kw = draw(placement_inputs())
    del kw["store"]                            # plan_tiers is for a slot with tiers behind it
    hybrid = draw(st.booleans())
    snaps = None
    if hybrid:                                 # open() hands _place a resumable k: k is one of them
        snaps = sorted({0, kw["slot_usable"], *draw(st.lists(st.integers(0, kw["record_len"]), max_size=6))})
    return kw, snaps


def _resumable(snaps):
    return None if snaps is None else (lambda x: max(s for s in snaps if s <= x))


@settings(max_examples=2000, deadline=None)
@given(tier_inputs(), st.data())
def test_tiers_plan_and_settle(inputs, data):
    kw, snaps = inputs
    block, k, n = kw["block"], kw["slot_usable"], kw["n"]
    facts = {key: kw[key] for key in ("n", "record_len", "slot_usable", "first_embed", "min_reuse", "block")}
    ask = plan_tiers(**kw, resumable=_resumable(snaps))
    a = ask.placement
    assert ask.set_aside <= (snaps is not None and a.loads)              # only a hybrid slot, only for a load
    if ask.set_aside:
        assert a.keep == 0                                              # the tiers load from block 0
    elif snaps is not None and a.loads:
        assert _resumable(snaps)(a.keep) == a.keep                      # [RESUME-AT-SNAPSHOT]
    if not a.loads:
        return
    got = data.draw(st.integers(0, a.blocks))                           # entries can vanish before the fetch
    whole_tail = data.draw(st.booleans())
    fetched = Fetched(blocks=got, complete=a.first_block + got == kw["tier_blocks"],
                      tail_tokens=kw["tail_tokens"], tail_whole=whole_tail,
                      states=None if snaps is None else tuple(data.draw(st.lists(st.booleans(), min_size=got,
                                                                                  max_size=got))),
                      tail_state=snaps is not None and data.draw(st.booleans()))
    p = settle_tiers(ask, fetched, **facts)
    # the plan acted on is one plan_placement gives (all of its rules hold), never worse than the slot
    assert p.loaded >= k and p.prefill >= 1
    assert p.first_block + p.blocks <= a.first_block + got or p.tail == 0 and p.blocks == 0
    if p.tail:                                                          # a tail only after every matched block
        assert fetched.complete and p.loaded == (a.first_block + got) * block + p.tail
    if snaps is not None:
        if p.loads:                                                     # the load ends at a state
            if p.tail:
                assert fetched.tail_state and fetched.tail_whole
            else:
                assert p.loaded % block == 0 and fetched.states[p.loaded // block - 1 - a.first_block]
        assert _resumable(snaps)(p.keep) == p.keep
        if ask.set_aside:                                               # set aside only for more than k
            assert (p.keep, p.loaded) == (k, k) or (p.keep == 0 and p.loaded > k)
    else:
        assert p == plan_placement(**(kw | {"tier_blocks": a.first_block + got,
                                            "tail_tokens": kw["tail_tokens"] if fetched.complete else 0}),
                                   store=True)


def test_tiers_examples():
    # a hybrid slot with snapshots at 0 and 100 of 120; tiers hold 3 blocks of 64 of a 300-token prompt:
    # continuing from block 1 would resume at 64, where the slot holds no state -> set aside, load from 0
    kw = dict(n=300, record_len=120, slot_usable=100, first_embed=300, min_reuse=16, block=64)
    ask = plan_tiers(**kw, tier_blocks=3, tail_tokens=0, resumable=lambda x: 100 if x >= 100 else 0)
    assert ask.set_aside and (ask.placement.keep, ask.placement.first_block, ask.placement.blocks) == (0, 0, 3)
    # every block carries a state: load all three
    p = settle_tiers(ask, Fetched(blocks=3, complete=True, states=(True, True, True)), **kw)
    assert (p.keep, p.loaded, p.blocks) == (0, 192, 3)
    # only block 0 carries one: the tiers reach 64 < the slot's 100, so the slot's prefix is kept after all
    p = settle_tiers(ask, Fetched(blocks=3, complete=True, states=(True, False, False)), **kw)
    assert (p.keep, p.loaded, p.blocks, p.loads) == (100, 100, 0, False)
    # attention alone: no set-aside, blocks 1-2 continue the slot's block 0
    ask = plan_tiers(**kw, tier_blocks=3, tail_tokens=0, resumable=None)
    assert not ask.set_aside
    p = settle_tiers(ask, Fetched(blocks=2, complete=True), **kw)
    assert (p.keep, p.loaded, p.first_block, p.blocks) == (64, 192, 1, 2)
    # a caller embedding at position 1 cuts the load inside block 0: a state-carrying tail after that block
    # would put the state at 5 for a slot ending at 1, so nothing is loaded (found by the property above)
    kw = dict(n=6, record_len=0, slot_usable=0, first_embed=1, min_reuse=0, block=4)
    ask = plan_tiers(**kw, tier_blocks=1, tail_tokens=1, resumable=lambda x: 0)
    p = settle_tiers(ask, Fetched(blocks=1, complete=True, tail_tokens=1, tail_whole=True, states=(False,),
                                  tail_state=True), **kw)
    assert (p.loaded, p.loads) == (0, False)


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
