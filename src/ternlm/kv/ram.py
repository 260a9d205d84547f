"""The host-RAM tier: verified-at-birth blocks in an LRU dict within a byte budget.

Blocks enter only from our own slots (copies of KV the runner wrote and recorded), so they are not
re-verified on use; what leaves by LRU is handed back to the caller, which spills it to disk.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .blockfile import BlockKV


@dataclass
class RamStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_s: float = 0.0


class RamTier:
    """Not thread-safe: the engine's worker thread is its only user."""

    def __init__(self, budget: int):
        self.budget = budget
        self.stats = RamStats()
        self._blocks: OrderedDict[bytes, BlockKV] = OrderedDict()   # oldest first
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def blocks(self) -> int:
        """Blocks held (a property, not __len__: an empty tier must not be falsy)."""
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> BlockKV | None:
        """The block, marked most recently used; None on a miss."""
        block = self._blocks.get(key)
        if block is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(key)
        self.stats.hits += 1
        return block

    def touch(self, key: bytes) -> None:
        if key in self._blocks:
            self._blocks.move_to_end(key)

    def put(self, block: BlockKV) -> list[BlockKV]:
        """Insert as most recently used. Returns the blocks evicted to make room (oldest first), which
        the caller may spill to disk; a block larger than the whole budget is returned itself."""
        if block.meta.key in self._blocks:
            self._blocks.move_to_end(block.meta.key)
            return []
        if block.nbytes > self.budget:
            return [block]
        out = []
        while self._used + block.nbytes > self.budget:
            _, old = self._blocks.popitem(last=False)
            self._used -= old.nbytes
            self.stats.evictions += 1
            out.append(old)
        self._blocks[block.meta.key] = block
        self._used += block.nbytes
        return out

    def oldest_first(self) -> list[BlockKV]:
        return list(self._blocks.values())
