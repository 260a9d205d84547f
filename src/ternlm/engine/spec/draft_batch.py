"""Batched drafting: a draft model's greedy drafts for many requests, one forward per draft position for all.

Why: a draft model drafts k tokens by k one-token steps; run request after request, a step with eight drafting
requests pays 8k small forwards, each reading every weight of the small model, and the draft model buys nothing.
Batched, one forward feeds a row per request (linears once over all rows, attention per slot, as the target's
continuous batching does), so a step pays about k small forwards whatever the number of requests.

    round 0          each lane feeds its catch-up (the tokens its slot has not seen; "last": the first draft)
    rounds 1..k-1    each lane still drafting feeds its latest drafted token, one row
A long catch-up (a request's first draft after a cold prompt) goes chunk by chunk, a chunk a round, its lane
drafting once the last chunk returned; the other lanes draft meanwhile. A lane ends at k tokens or a stop token
(nothing after a stop is ever verified); its last drafted token is never fed (the target verifies it first).

Each draft slot's record is appended per step by the runner [RECORD-WHERE-FED]; cutting rejected drafts back is the
drafter's (draft_model.ModelDrafter.verified).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...kv.slots import Slot
from ..runner import Feed, Runner


@dataclass
class Lane:
    """One request's draft in a batched draft: feed `catch_up` (chunk by chunk), then draft up to `k` tokens.
    `out` holds the drafted tokens once `draft_together` returned."""
    slot: Slot
    catch_up: list[int]          # >= 1 id: the slot's record + catch_up = the request's tokens so far
    k: int                       # >= 1
    out: list[int] = field(default_factory=list)

    def rows(self, chunk: int) -> tuple[list[int], str]:
        """This round's ids and what logits they ask for (runner.Feed). Pure."""
        if self.catch_up:
            ids = self.catch_up[:chunk]
            return ids, "last" if len(ids) == len(self.catch_up) else "none"
        return [self.out[-1]], "last"


def draft_together(runner: Runner, lanes: list[Lane], vocab: int, stops: frozenset[int]) -> int:
    """Fill each lane's `out` with its greedy draft (argmax over ids < vocab). Returns the forwards it ran (the
    rounds). Side effects: runner.step per round over the lanes still going (writes their slots' KV and records).
    If a step raises, the lanes' slots hold what earlier rounds recorded; the caller decides what to keep."""
    live = [lane for lane in lanes if lane.k >= 1]
    rounds = 0
    while live:
        plan = [lane.rows(runner.chunk_size) for lane in live]
        logits = runner.step([Feed(lane.slot, ids, None, want) for lane, (ids, want) in zip(live, plan)])
        rounds += 1
        going = []
        for lane, (ids, want), rows in zip(live, plan, logits):
            if lane.catch_up:
                del lane.catch_up[:len(ids)]
            if want == "last":              # rows: (1, vocab) after the lane's latest token
                tok = int(torch.argmax(rows[-1, :vocab]))
                lane.out.append(tok)
                if len(lane.out) == lane.k or tok in stops:
                    continue
            going.append(lane)
        live = going
    return rounds
