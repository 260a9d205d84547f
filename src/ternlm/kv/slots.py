"""KV tensors of one sequence (a slot) and the record that describes them.

The record's lifecycle is the KV's, and this file is the only place KV buffers are (re)allocated:
  allocate            -> record cleared in the same function
  copy-grow           -> KV copied, record kept (it still describes positions [0, len))
  failed grow         -> record dropped (we no longer know the buffers are intact)
  write past capacity -> record emptied, never left partial
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .record import PrefixRecord


class ContextOverflow(ValueError):
    """A write would go past the slot's maximum capacity (the context length)."""


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    max_capacity: int          # hard limit: the context length in tokens
    block: int = 1             # buffer capacity is a multiple of this (the model's attention needs it)

    def round_up(self, n: int) -> int:
        return -(-n // self.block) * self.block


class Slot:
    """One KV sequence. Not thread-safe: whoever holds the slot is its only user."""

    def __init__(self, index: int, shape: KVShape, initial_capacity: int = 256):
        self.index = index
        self.shape = shape
        self.record = PrefixRecord()
        self.last_used = 0.0                 # time.monotonic() of the last release, for LRU
        self._allocate(shape.round_up(min(initial_capacity, shape.max_capacity)))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _allocate(self, capacity: int) -> None:
        s = self.shape
        # k, v: (layers, kv_heads, capacity, head_dim)
        self.k = torch.zeros(s.layers, s.kv_heads, capacity, s.head_dim, dtype=s.dtype)
        self.v = torch.zeros_like(self.k)
        self.record.clear()  # new buffers hold nothing the record could describe

    def ensure_capacity(self, needed: int) -> None:
        """Make room for positions [0, needed). May reallocate (copy-grow keeps the record).
        Raises ContextOverflow (and empties the record) past max_capacity."""
        if needed <= self.capacity:
            return
        if needed > self.shape.max_capacity:
            self.record.clear()
            raise ContextOverflow(f"{needed} tokens exceed the context of {self.shape.max_capacity}")
        # rounding may pass max_capacity: those positions are padding, never written
        new_cap = self.shape.round_up(min(max(needed, 2 * self.capacity), self.shape.max_capacity))
        keep = len(self.record)
        try:
            k = torch.zeros(self.shape.layers, self.shape.kv_heads, new_cap, self.shape.head_dim,
                            dtype=self.shape.dtype)
            v = torch.zeros_like(k)
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        except BaseException:
            self.record.clear()   # failed grow: drop the record, the old buffers stay but describe nothing
            raise
        self.k, self.v = k, v     # copy-grow: record still describes positions [0, keep)

    def reset(self, namespace: bytes = b"") -> None:
        """Forget the contents (LRU reuse of the slot for another conversation). Keeps the buffers."""
        self.record.clear(namespace)

    def touch(self) -> None:
        self.last_used = time.monotonic()
