"""Keep large freed buffers in the process instead of handing them back to the kernel (glibc only).

Why: attention at a 4k context builds score/probability buffers of 30+ MiB per layer and chunk.
glibc serves blocks that large with a fresh mmap and unmaps them on free, so every layer of every
chunk page-faults its buffers in again: measured 5-6 million faults and ~10 s of system time in a
4,000-token smollm2 prefill (16-18 s in all) on this 2-core VM; with the thresholds raised, ~0
faults and 10.5 s. Cost: up to 1 GiB of freed memory stays mapped in the process for reuse.

One arena: glibc gives threads their own arenas (up to 8 per core), and freed memory in one is not
reused by another: under a 10-minute soak (32 chats, uvicorn's threads beside the engine's worker)
the server's RSS crept +11-20% after warm-up, +2.5-4.2% with a single arena, at the same throughput
(benchmarks/RESULTS.md, Soak). Call this before the server starts its threads: arenas already made
stay.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("ternlm")

_M_TRIM_THRESHOLD = -1     # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_LIMIT = 1 << 30
_done = False


def keep_large_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB and keep one malloc arena, once per process.
    Side effect: process-wide allocator settings. No-op (returns False) off glibc or with
    TERNLM_MALLOC_TUNE=0."""
    global _done
    if _done:
        return True
    if os.environ.get("TERNLM_MALLOC_TUNE", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False                          # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_ARENA_MAX, 1)                  # best effort: RSS creep, not correctness
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) & bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
    if not _done:
        log.debug("mallopt refused the thresholds; large buffers stay mmap'ed")
    return _done

