"""Where a request's prompt comes from: the slot's own KV, blocks and a tail entry from the tiers, or
a prefill. A pure planner (no torch, no I/O) returning a frozen plan; the engine acts on it.

    [0, keep) reused from the slot | [keep, loaded) loaded from tier blocks, then the tail entry |
    [loaded, n) prefilled

Why a plan: deciding and acting used to be interleaved (save, match, fetch, maybe load, maybe
truncate), which could only be tested with a model and a store. Here every rule is a line of
arithmetic that a property test checks for any record length, prompt length and tier match:
- the tiers are used only when they give more than the slot alone and at least `min_reuse`;
- the slot keeps whole blocks below its usable prefix, tier blocks continue from there (a block's
  key chains every id before it, so block i of the prompt follows block i - 1 wherever it came from);
- a tail entry continues the prompt after the tiers' last whole block, and only after all of them
  (its key chains that block's): it is used when the plan reaches past that block;
- never past `limit` = min(n - 1, first caller embedding): [FRESH-LOGITS] at least one token is
  fed, and a stored block or tail never carries a caller embedding;
- the slot's blocks are saved down a tier before any of its positions is discarded.

Hybrid models (a recurrent state beside the attention KV) add two rules, planned here too
(`plan_tiers` before the fetch, `settle_tiers` after it) so the engine acts on one plan:
- [RESUME-AT-SNAPSHOT] the state resumes only where one was kept: where the tiers would continue from a
  slot position that holds no state, the slot's prefix is set aside (saved, then not kept) and the tiers
  load from block 0; if what they give then reaches no further than the slot's own resume point, the
  slot's prefix is kept after all (an edit replay's turn re-processed 10,201 of 10,393 tokens when a
  tier's early state replaced the slot's snapshot 6 tokens before the divergence);
- a tier load ends where a loaded entry carries the state: the whole tail when it is used in full and
  carries one, else the last fetched block that carries one within the limit (`stateful_reach`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .blocks import BLOCK_TOKENS


@dataclass(frozen=True)
class Placement:
    """A frozen plan for one request in one slot. [0, keep) reused from the slot |
    [keep, loaded) loaded from tier blocks, then `tail` positions of a tail entry | [loaded, n) prefilled."""
    n: int                   # prompt length
    keep: int                # positions of the slot's KV kept
    loaded: int              # end of the positions loaded from tiers (== keep: none)
    first_block: int         # index (in the prompt's blocks) of the first block to load
    blocks: int              # blocks to fetch from first_block on (the last may be cut at `loaded`)
    save_slot: bool          # save the slot's blocks into the store before discarding any position
    tail: int = 0            # positions loaded from the tail entry, the last of [keep, loaded)

    @property
    def reused(self) -> int:
        return self.loaded

    @property
    def prefill(self) -> int:
        return self.n - self.loaded

    @property
    def reset(self) -> bool:
        """The slot keeps nothing: clear its record (and take the request's namespace)."""
        return self.keep == 0

    @property
    def loads(self) -> bool:
        """Something comes from the tiers."""
        return self.loaded > self.keep


def plan_placement(*, n: int, record_len: int, slot_usable: int, tier_blocks: int, first_embed: int,
                   min_reuse: int, store: bool, tail_tokens: int = 0, block: int = BLOCK_TOKENS) -> Placement:
    """Plan a request's placement. Pure.

    n: prompt length (>= 1); record_len: positions the slot holds; slot_usable: what the reuse decision
    lets the prompt keep of them (kv/record.decide_reuse: <= n - 1, 0 or >= min_reuse);
    tier_blocks: how many of the prompt's leading blocks the tiers hold (store.match; after a fetch,
    how many were actually read); tail_tokens: positions after those blocks a tail entry gives
    (store.find_tail; 0: none; < block); first_embed: first position fed from a caller embedding
    (n if none); store: whether tiers exist at all.
    """
    k = slot_usable
    save = store and k < record_len
    if store:
        limit = min(n - 1, first_embed)                 # [FRESH-LOGITS]; embeds are always prefilled
        first = k // block                              # blocks [0, first) are in the slot already
        beat = max(k, min_reuse - 1)                    # the tiers are used only for more than this
        whole = tier_blocks * block
        loaded = min(whole + tail_tokens, limit)
        if loaded > beat and (tier_blocks > first or loaded > whole):
            keep = first * block                        # <= whole: else the slot alone reaches further
            tail = max(0, loaded - whole)
            return Placement(n, keep, loaded, first, -(-(loaded - tail - keep) // block), save, tail)
    return Placement(n, k, k, k // block, 0, save)


@dataclass(frozen=True)
class TierPlan:
    """What to fetch from the tiers, before the fetch: `placement` names the blocks; `set_aside`: the slot's
    prefix is to be saved and not kept ([RESUME-AT-SNAPSHOT]: it holds no state where the tiers go on)."""
    placement: Placement
    set_aside: bool


@dataclass(frozen=True)
class Fetched:
    """What the fetch gave, as `settle_tiers` needs it. blocks: how many were read from the plan's
    first_block on (fewer than asked when an entry vanished between match and fetch); complete: they
    run to the last block the tiers matched (a tail follows only that one); tail_tokens: the tail entry's
    positions (0: none); tail_whole: the tail is used with all of its ids; states: per block read,
    whether it carries a recurrent state, and `tail_state` for the tail (None: the model has no state)."""
    blocks: int
    complete: bool
    tail_tokens: int = 0
    tail_whole: bool = False
    states: tuple[bool, ...] | None = None
    tail_state: bool = False


def plan_tiers(*, n: int, record_len: int, slot_usable: int, tier_blocks: int, tail_tokens: int,
               first_embed: int, min_reuse: int, resumable: Callable[[int], int] | None,
               block: int = BLOCK_TOKENS) -> TierPlan:
    """The fetch, for a slot with tiers behind it. Pure (given a pure `resumable`).

    resumable: the slot's `Slot.resumable` for a hybrid slot (the longest prefix <= k it can keep), None
    for attention alone. The other arguments as plan_placement's (store=True)."""
    def plan(usable: int) -> Placement:
        return plan_placement(n=n, record_len=record_len, slot_usable=usable, tier_blocks=tier_blocks,
                              first_embed=first_embed, min_reuse=min_reuse, store=True,
                              tail_tokens=tail_tokens, block=block)
    p = plan(slot_usable)
    if p.loads and resumable is not None and resumable(p.keep) != p.keep:
        return TierPlan(plan(0), set_aside=True)
    return TierPlan(p, set_aside=False)


def stateful_reach(fetched: Fetched, first_block: int, limit: int, block: int = BLOCK_TOKENS) -> tuple[int, int]:
    """A hybrid slot's (tier blocks, tail positions) for plan_placement: the whole tail when it is used in
    full, carries a state and lies within `limit` (store.find_tail gives no other, but a load cut short of
    the tail's end would resume from a state at the wrong position), else up to the last fetched block
    that carries one and lies within `limit` ((first_block, 0) when none does). Pure."""
    end = (first_block + fetched.blocks) * block + fetched.tail_tokens
    if fetched.tail_tokens and fetched.tail_state and fetched.tail_whole and end <= limit:
        return first_block + fetched.blocks, fetched.tail_tokens
    ends = [i + 1 for i, s in enumerate(fetched.states or ()) if s and (first_block + i + 1) * block <= limit]
    return first_block + (ends[-1] if ends else 0), 0


def settle_tiers(before: TierPlan, fetched: Fetched, *, n: int, record_len: int, slot_usable: int,
                 first_embed: int, min_reuse: int, block: int = BLOCK_TOKENS) -> Placement:
    """The plan the engine acts on, after the fetch of `before`. Pure.

    The tiers count only for what was read (and a tail only after the last matched block); a hybrid slot's
    load ends at a state (`stateful_reach`); a set-aside slot's prefix is kept after all when the tiers
    then reach no further than it. slot_usable: as given to plan_tiers (before any set-aside)."""
    first = before.placement.first_block
    tier_blocks = first + fetched.blocks
    tail_tokens = fetched.tail_tokens if fetched.complete else 0
    if fetched.states is not None:
        tier_blocks, tail_tokens = stateful_reach(
            Fetched(fetched.blocks, fetched.complete, tail_tokens, fetched.tail_whole, fetched.states,
                    fetched.tail_state), first, min(n - 1, first_embed), block)

    def plan(usable: int, blocks: int, tail: int) -> Placement:
        return plan_placement(n=n, record_len=record_len, slot_usable=usable, tier_blocks=blocks,
                              first_embed=first_embed, min_reuse=min_reuse, store=True, tail_tokens=tail,
                              block=block)
    p = plan(0 if before.set_aside else slot_usable, tier_blocks, tail_tokens)
    if before.set_aside and (not p.loads or p.loaded <= slot_usable):
        return plan(slot_usable, 0, 0)
    return p
