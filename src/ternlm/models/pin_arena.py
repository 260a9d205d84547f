"""[PIN-ARENA] The memory that pinned streamed experts are converted into (models/moe.py StreamedExperts).

Why: a pinned expert is converted once into memory of its own and kept for good. As fresh tensors, each of its
fields was a fresh mapping (above the 256 KiB mmap threshold that streaming sets, malloc.streamed_blocks_return)
page-faulted in 4 KiB at a time while converting: on the capped 30B benchmark's turn 1, ~1,950 pins cost 4.8-5.7 s of
conversion on the step's path against ~0.8 ms an expert converted into reused memory. Here the pins are carved, one
after another, out of one anonymous mapping advised for transparent huge pages (MADV_HUGEPAGE, where the kernel
has them): a 2 MiB page a fault. Pins are never evicted, so a bump allocator is all it takes; the mapping is
virtual until touched (the budget's accounting is unchanged: the same bytes, each field rounded up to 64).
"""
from __future__ import annotations

import mmap

import torch

from .qweight import QWeight

_ALIGN = 64
_FIELDS = ("codes", "scale", "bias", "high", "sup")


class PinArena:
    """nbytes of anonymous memory handed out in order (`like`), never given back before the arena is dropped."""

    def __init__(self, nbytes: int):
        self._map = mmap.mmap(-1, max(int(nbytes), mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:              # THP compiled out: 4 KiB pages, as fresh tensors had
                pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)   # holds the mapping while it lives
        self._at = 0

    @property
    def used(self) -> int:
        return self._at

    def _take(self, n: int) -> torch.Tensor | None:
        at = -(-self._at // _ALIGN) * _ALIGN
        if at + n > self._bytes.numel():
            return None
        self._at = at + n
        return self._bytes[at:at + n]

    def like(self, w: QWeight) -> QWeight | None:
        """A QWeight with w's format and every field's shape and dtype, its fields in the arena (w's one-element
        "f16s" constant is kept as it is: it is not a buffer the conversion writes), or None when the arena has no
        room left (nothing taken then). Side effect: the arena's space."""
        start = self._at
        fields = []
        for name in _FIELDS:
            t = getattr(w, name)
            if t is None or (name == "bias" and w.mode == "f16s"):
                fields.append(t)
                continue
            got = self._take(t.numel() * t.element_size())
            if got is None:
                self._at = start
                return None
            fields.append(got.view(t.dtype).view(t.shape))
        return QWeight(w.fmt, *fields)
