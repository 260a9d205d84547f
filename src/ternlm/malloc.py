"""Keep large freed buffers in the process instead of handing them back to the kernel (glibc only).

Why: attention at a 4k context builds score/probability buffers of 30+ MiB per layer and chunk.
glibc serves blocks that large with a fresh mmap and unmaps them on free, so every layer of every
chunk page-faults its buffers in again: measured 5-6 million faults and ~10 s of system time in a
4,000-token smollm2 prefill (16-18 s in all) on this 2-core VM; with the thresholds raised, ~0
faults and 10.5 s. Cost: up to 1 GiB of freed memory stays mapped in the process for reuse.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("ternlm")

_M_TRIM_THRESHOLD = -1     # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_LIMIT = 1 << 30
_done = False


def keep_large_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds to 1 GiB, once per process. Side effect: process-wide
    allocator setting. No-op (returns False) off glibc or with TERNLM_MALLOC_TUNE=0."""
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
    _done = bool(mallopt(_M_MMAP_THRESHOLD, _LIMIT)) & bool(mallopt(_M_TRIM_THRESHOLD, _LIMIT))
    if not _done:
        log.debug("mallopt refused the thresholds; large buffers stay mmap'ed")
    return _done
