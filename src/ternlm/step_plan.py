"""Who feeds how many rows in the next step (continuous batching policy). Pure: no torch, no engine.

One scheduler step is one forward pass. Decoding sequences each feed their one sampled token: they
are what a user watches, so they always run. Prefilling sequences feed chunks of their prompt tail,
oldest admission first, within a token budget, so a 4,000-token cold prompt advances a chunk per step
beside the decodes instead of freezing them for its whole prefill (chunked prefill, as vLLM and
SGLang schedule it). While nothing decodes there is no one to protect: prefills take whole chunks.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Want:
    """What one running sequence could feed now."""
    pending: int          # ids waiting to be fed (>= 1)
    decoding: bool        # the one pending id is a sampled token (latency-critical)


def plan_step(wants: list[Want], budget: int, chunk: int) -> list[int]:
    """Rows each sequence feeds this step, aligned with `wants` (0: it waits).

    - every decoding sequence feeds 1;
    - while any sequence decodes, all rows together stay within `budget` (when decodes alone reach
      it, the oldest prefill still gets one row so it is never starved); otherwise within
      max(budget, chunk);
    - prefills, in order, feed min(pending, chunk, room left): a later one gets rows only when every
      earlier one got all it could take.
    """
    if budget < 1 or chunk < 1:
        raise ValueError("budget and chunk must be >= 1")
    out = [1 if w.decoding else 0 for w in wants]
    decodes = sum(out)
    room = (budget if decodes else max(budget, chunk)) - decodes
    first = True
    for i, w in enumerate(wants):
        if w.decoding:
            continue
        take = min(w.pending, chunk, max(room, 1 if first else 0))
        out[i] = take
        room -= take
        first = False
        if room <= 0:
            break
    return out
