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
Loader temporaries returned (`loading`, around every model load): glibc's mmap threshold is dynamic —
freeing an mmap'ed block raises it to that block's size (up to 32 MiB), so the loader's next converted-
then-freed temporaries of that size come from the heap and, fragmented, stay there. Fixed at 1 MiB while
loading, they get their own mappings and leave on free. What the load adds (`ternlm bench quality`'s
measurement, dynamic -> fixed): qwen2.5-0.5b gguf 720 -> 581 MiB (597-720 over runs before), bf16
1,515 -> 1,303, fp32 2,561 -> 2,525; smollm2 gguf 147 -> 145, bf16 447 -> 418, fp32 786 -> 714. (Fixed
at 4-32 MiB it helped gguf but left the dense modes' mid-size temporaries in the heap: smollm2 bf16
594-600.) After the load the thresholds are set where the dynamic ones end up (32 MiB, trim 64 MiB),
so serving keeps its large buffers as it did.
TERNLM_MALLOC_TUNE=0 leaves the allocator alone altogether.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("ternlm")

_M_TRIM_THRESHOLD = -1     # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_LIMIT = 1 << 30
_LOAD_MMAP = 1 << 20       # while loading (see the module docstring)
_SERVE_MMAP = 32 << 20     # after: glibc's own dynamic maximum (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
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


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a model load: blocks of 1 MiB and more get their own mmap (returned on free); after it,
    fixed thresholds where glibc's dynamic ones end up (mmap 32 MiB, trim 64 MiB). Side effects:
    process-wide allocator settings, and glibc's threshold stops adapting; no-op off glibc, with
    TERNLM_MALLOC_TUNE=0, or once keep_large_buffers is in force (its 1 GiB thresholds stay)."""
    mallopt = None if _state["large"] else _mallopt()
    if mallopt:
        mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP)
    try:
        yield
    finally:
        if mallopt and not _state["large"]:
            mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP)
            mallopt(_M_TRIM_THRESHOLD, 2 * _SERVE_MMAP)
