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
"""
from __future__ import annotations

from dataclasses import dataclass

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
