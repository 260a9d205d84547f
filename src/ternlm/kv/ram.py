"""The host-RAM tier: verified-at-birth blocks and tail entries in an LRU dict within a byte budget.

Entries enter only from our own slots (copies of KV the runner wrote and recorded), so they are not
re-verified on use; what leaves by LRU is handed back to the caller, which spills it to disk.
Entries are filed by name (BlockMeta.name: a block's key, a tail's locator + key); tails are also
indexed by locator, the only thing a lookup knows about the tail that may follow its last block.
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
        self._blocks: OrderedDict[bytes, BlockKV] = OrderedDict()   # name -> entry, oldest first
        self._tails: dict[bytes, list[bytes]] = {}                  # locator -> names of its tails
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def blocks(self) -> int:
        """Entries held, blocks and tails (a property, not __len__: an empty tier must not be falsy)."""
        return len(self._blocks)

    @property
    def tail_entries(self) -> int:
        return sum(len(v) for v in self._tails.values())

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def get(self, name: bytes) -> BlockKV | None:
        """The entry, marked most recently used; None on a miss."""
        block = self._blocks.get(name)
        if block is None:
            self.stats.misses += 1
            return None
        self._blocks.move_to_end(name)
        self.stats.hits += 1
        return block

    def peek(self, name: bytes) -> BlockKV | None:
        """The entry without an LRU touch or a counter (None on a miss)."""
        return self._blocks.get(name)

    def touch(self, name: bytes) -> None:
        if name in self._blocks:
            self._blocks.move_to_end(name)

    def tails(self, locator: bytes) -> list[BlockKV]:
        """The tail entries following one parent (tail_locator). Reads only: no LRU touch, no counter."""
        return [self._blocks[n] for n in self._tails.get(locator, ())]

    def remove(self, name: bytes) -> BlockKV | None:
        """Drop an entry (a tail another one replaces); not an eviction, nothing to spill."""
        block = self._blocks.pop(name, None)
        if block is not None:
            self._forget(block)
        return block

    def put(self, block: BlockKV) -> list[BlockKV]:
        """Insert as most recently used. Returns the entries evicted to make room (oldest first), which
        the caller may spill to disk; an entry larger than the whole budget is returned itself."""
        name = block.meta.name
        if name in self._blocks:
            self._blocks.move_to_end(name)
            return []
        if block.nbytes > self.budget:
            return [block]
        out = []
        while self._used + block.nbytes > self.budget:
            _, old = self._blocks.popitem(last=False)
            self._forget(old)
            self.stats.evictions += 1
            out.append(old)
        self._blocks[name] = block
        self._used += block.nbytes
        if block.meta.tail:
            self._tails.setdefault(name[:32], []).append(name)
        return out

    def _forget(self, block: BlockKV) -> None:
        self._used -= block.nbytes
        if block.meta.tail:
            name = block.meta.name
            names = self._tails.get(name[:32], [])
            if name in names:
                names.remove(name)
            if not names:
                self._tails.pop(name[:32], None)

    def oldest_first(self) -> list[BlockKV]:
        return list(self._blocks.values())
