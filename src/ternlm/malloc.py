"""glibc allocator settings: one malloc arena for every thread; large freed buffers kept only where the
torch attention still makes them.

One arena (`one_arena`, always): glibc gives threads their own arenas (up to 8 per core), and freed
memory in one is not reused by another: under a 10-minute soak (32 chats, uvicorn's threads beside the
engine's worker) the server's RSS crept +11-20% after warm-up, +2.5-4.2% with a single arena, at the
same throughput (benchmarks/RESULTS.md, Soak). Call it before the server starts its threads: arenas
already made stay.

Large buffers kept (`keep_large_buffers`, only without the native kernels): the torch attention at a
4k context builds score/probability buffers of 30+ MiB per layer and chunk; glibc serves blocks that
large with a fresh mmap and unmaps them on free, so every layer of every chunk page-faults them in
again (measured: 5-6 million faults, ~10 s of system time in a 16-18 s smollm2 4,000-token prefill;
with 1 GiB thresholds ~0 faults and 10.5 s). The native attention (kernels/attention.c) never builds
them: with it, raising the thresholds changed a 4,000-token prefill by <1% (gguf) / ~2% (dense) and
only kept the loader's freed temporaries resident (qwen gguf: load adds 1,020 MiB with the thresholds,
606-725 without; RESULTS.md, Kernels fourth pass), so the engine raises them only when it has to fall back.
TERNLM_MALLOC_TUNE=0 leaves the allocator alone altogether.
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
_state = {"arena": False, "large": False}


def _mallopt():
    """glibc's mallopt, or None (not glibc: musl, macOS; or TERNLM_MALLOC_TUNE=0)."""
    if os.environ.get("TERNLM_MALLOC_TUNE", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def one_arena() -> bool:
    """Cap glibc at one malloc arena, once per process. Side effect: process-wide allocator setting.
    Returns whether it is in force (False off glibc or with TERNLM_MALLOC_TUNE=0)."""
    if not _state["arena"]:
        mallopt = _mallopt()
        _state["arena"] = bool(mallopt and mallopt(_M_ARENA_MAX, 1))   # best effort: RSS creep, not correctness
    return _state["arena"]


def keep_large_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB (freed large buffers stay for reuse), once per
    process. Side effect: process-wide allocator settings; up to 1 GiB of freed memory stays mapped.
    Returns whether they are in force (False off glibc or with TERNLM_MALLOC_TUNE=0)."""
    if not _state["large"]:
        mallopt = _mallopt()
        _state["large"] = bool(mallopt and mallopt(_M_MMAP_THRESHOLD, _LIMIT) and mallopt(_M_TRIM_THRESHOLD, _LIMIT))
        if mallopt and not _state["large"]:
            log.debug("mallopt refused the thresholds; large buffers stay mmap'ed")
    return _state["large"]


def large_buffers_kept() -> bool:
    """Whether keep_large_buffers is in force in this process (no side effect)."""
    return _state["large"]

