"""Who feeds how many rows in the next step (continuous batching policy). Pure: no torch, no engine.

One scheduler step is one forward pass. Decoding sequences each feed their one sampled token: they
are what a user watches, so they always run. Prefilling sequences feed chunks of their prompt tail
within a token budget, so a 4,000-token cold prompt advances a chunk per step beside the decodes
instead of freezing them for its whole prefill (chunked prefill, as vLLM and SGLang schedule it).
Among prefills the shortest remaining goes first: a follow-up turn whose prefix was reused has a few
dozen tokens left and gets its first token in a step or two instead of queueing behind a cold prompt's
thousands (measured: turn-2 TTFT 10-13 s behind a 4,000-token prompt in admission order); the oldest
prefill still gets a row every step, so no prompt starves. While nothing decodes there is no one to
protect: prefills take whole chunks.
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

    - every decoding sequence feeds all it has pending: its sampled token, and the draft after it when
      it speculates (sequence.py: verified in the same step);
    - while any sequence decodes, all rows together stay within `budget` (when decodes alone reach
      it, the oldest prefill still gets one row so it is never starved); otherwise within
      max(budget, chunk);
    - the oldest prefill (first in `wants` among prefills: callers list sequences in admission order)
      always feeds at least 1 row;
    - prefills by fewest pending ids first (ties: admission order) feed up to min(pending, chunk)
      from the room left: one gets rows beyond that guaranteed row only when every prefill before
      it in this order got all it could take.
    """
    if budget < 1 or chunk < 1:
        raise ValueError("budget and chunk must be >= 1")
    out = [w.pending if w.decoding else 0 for w in wants]
    decodes = sum(out)
    room = (budget if decodes else max(budget, chunk)) - decodes
    prefills = [i for i, w in enumerate(wants) if not w.decoding]
    if not prefills:
        return out
    out[prefills[0]] = 1                       # never starved, however many shorter prompts arrive
    room -= 1
    for i in sorted(prefills, key=lambda i: (wants[i].pending, i)):
        if room <= 0:
            break
        take = min(min(wants[i].pending, chunk) - out[i], room)
        out[i] += take
        room -= take
    return out
