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
606-725 without; measured in the fourth kernels session, commit history of RESULTS.md), so the engine raises them only when it has to fall back.
Loader temporaries returned (`loading`, around every model load): glibc's mmap threshold is dynamic —
freeing an mmap'ed block raises it to that block's size (up to 32 MiB), so the loader's next converted-
then-freed temporaries of that size come from the heap and, fragmented, stay there. An earlier fix
gave every block of 1 MiB and more its own mapping while loading (returned on free), but then every
temporary was page-faulted in afresh: qwen2.5 gguf's load took 2.2 million faults and 8 s of system
time, 16 s in all. Now the loader reuses the heap (thresholds 256 MiB / 1 GiB while loading: few
faults) and `malloc_trim(0)` hands the freed pages back at the end (glibc releases every whole free
page inside the heap, not only its top): the same load 8.9 s, 0.46 M faults, and a lower RSS after it
(753 against 791 MiB in the same process; measured at the loader change, see git log of this file). After the load the
thresholds are set where the dynamic ones end up (32 MiB, trim 64 MiB), so serving keeps its large
buffers as it did.
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
_LOAD_MMAP = 256 << 20     # while loading: temporaries reuse the heap (see the module docstring)
_SERVE_MMAP = 32 << 20     # after: glibc's own dynamic maximum (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
_STREAM_MMAP = 256 << 10   # while experts stream: freed experts go back (streamed_blocks_return)
_state = {"arena": False, "large": False}


def _libc():
    """glibc, or None (not glibc: musl, macOS; or TERNLM_MALLOC_TUNE=0)."""
    if os.environ.get("TERNLM_MALLOC_TUNE", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt():
    """glibc's mallopt, or None (see _libc)."""
    libc = _libc()
    return libc.mallopt if libc else None


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


def streamed_blocks_return() -> bool:
    """While experts stream (models/moe.py StreamedExperts): blocks of 256 KiB and more get their own
    mappings, so an evicted expert (1-3 MB of codes and scales, and its conversion's temporaries) goes
    back to the system when freed. With the serving thresholds (32 MiB) they came from the heap and
    stayed there, fragmented: under a cgroup cap a 583 MiB expert cache grew the anonymous set by
    ~830 MiB and the server was OOM-killed (benchmarks/results/moe-capped); a 256 KiB threshold held it
    to ~450 MiB. The cost, a fresh mapping's page faults per miss, is small beside the miss's read and
    conversion. Side effect: process-wide allocator setting (not with keep_large_buffers, whose 1 GiB
    thresholds then stay). Returns whether it is in force (False off glibc or TERNLM_MALLOC_TUNE=0)."""
    libc = _libc()
    if libc is None or _state["large"]:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _STREAM_MMAP) and libc.mallopt(_M_TRIM_THRESHOLD, 2 * _STREAM_MMAP))


def large_buffers_kept() -> bool:
    """Whether keep_large_buffers is in force in this process (no side effect)."""
    return _state["large"]


def release_freed() -> None:
    """Hand the heap's whole free pages back to the system now (malloc_trim(0)), for a loader that frees
    its source tensors as it goes: inside `loading()` nothing is trimmed, so the pages freed by one step
    would stay resident until the end while the next steps fault in others (issue 61: the model build's
    peak). The pages are faulted in again where the heap reuses them. Off glibc or with
    TERNLM_MALLOC_TUNE=0: a no-op."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a model load: blocks below 256 MiB come from the heap and nothing is trimmed while it
    runs (the loader's temporaries reuse pages instead of faulting fresh ones in); after it, the freed
    pages go back to the system (malloc_trim) and the thresholds are fixed where glibc's dynamic ones
    end up (mmap 32 MiB, trim 64 MiB). Side effects: process-wide allocator settings, and glibc's
    threshold stops adapting; off glibc or with TERNLM_MALLOC_TUNE=0 a no-op; once keep_large_buffers
    is in force its 1 GiB thresholds stay, and only the trim runs."""
    libc = _libc()
    tune = libc is not None and not _state["large"]
    if tune:
        libc.mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP)
        libc.mallopt(_M_TRIM_THRESHOLD, _LIMIT)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)       # every whole free page of the heap back to the system
        if tune and not _state["large"]:
            libc.mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _SERVE_MMAP)
