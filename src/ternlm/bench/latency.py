"""Streaming latency figures from client-side token arrival times (pure; numpy only).

Used by `ternlm bench multiturn --concurrency N` and `ternlm bench streams`: what users of N concurrent
streams see.
- ITL (inter-token latency): gaps between consecutive content chunks of one answer.
- Aggregate decode tok/s: tokens that arrived after each answer's first, over the time at least one
  answer was streaming (the union of [first token, last token] intervals), so idle gaps between
  turns and prefills before anyone streams do not count, and overlapping streams are not double-timed.
- Steady decode tok/s (streams): tokens inside the window where all N answers stream at once.
- A cold prompt's window: the ITL gaps of the other streams that overlap its prefill (sent -> its
  first token), against the others. Overlap, not "ended inside": a server that freezes every stream
  for the whole prefill shows one long gap that ends after the window.
"""
from __future__ import annotations

import numpy as np


def gaps(times: list[float]) -> list[float]:
    """Successive differences of one answer's token arrival times."""
    return [b - a for a, b in zip(times, times[1:])]


def union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def aggregate_decode_tok_s(answers: list[list[float]]) -> float | None:
    """answers: token arrival times per answer. Tokens after each first / union of streaming time."""
    spans = [(t[0], t[-1]) for t in answers if len(t) >= 2]
    covered = union_length(spans)
    tokens = sum(len(t) - 1 for t in answers if len(t) >= 2)
    return tokens / covered if covered > 0 else None


def split_gaps(answers: list[list[float]], windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """ITL gaps overlapping any window (during), and the others (outside)."""
    during, outside = [], []
    for times in answers:
        for a, b in zip(times, times[1:]):
            (during if any(a < w1 and b > w0 for w0, w1 in windows) else outside).append(b - a)
    return during, outside


def pcts(xs: list[float]) -> dict:
    """{"p50", "p99", "n"} in seconds (None when empty)."""
    if not xs:
        return {"p50": None, "p99": None, "n": 0}
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99)), "n": len(xs)}


def steady_window(answers: list[list[float]]) -> tuple[float, float] | None:
    """The interval in which every answer was streaming: [the last first token, the first last token];
    None if some answer has no token or the answers never all streamed at once."""
    if not answers or any(not t for t in answers):
        return None
    start, end = max(t[0] for t in answers), min(t[-1] for t in answers)
    return (start, end) if end > start else None


def steady_decode_tok_s(answers: list[list[float]]) -> float | None:
    """Aggregate decode tok/s while all N answers stream at once (steady_window): tokens that arrived
    after the window's start and by its end, over its length. What N concurrent users get from a
    server in steady state, without the prefills and the stragglers at either end."""
    w = steady_window(answers)
    if w is None:
        return None
    start, end = w
    return sum(1 for t in answers for x in t if start < x <= end) / (end - start)
