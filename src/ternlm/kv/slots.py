"""KV tensors of one sequence (a slot) and the record that describes them.

The record's lifecycle is the KV's, and this file is the only place KV buffers are (re)allocated:
  allocate            -> record cleared in the same function
  copy-grow           -> KV copied, record kept (it still describes positions [0, len))
  failed grow         -> record dropped (we no longer know the buffers are intact)
  write past capacity -> record emptied, never left partial
A hybrid model's slot also owns its recurrent state (kv/recurrent.py), kept in step with the record here:
whatever clears the record resets the state; `truncate` resumes the state at the cut before cutting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .record import PrefixRecord
from .recurrent import RecurrentShape, RecurrentState


class ContextOverflow(ValueError):
    """A write would go past the slot's maximum capacity (the context length)."""


@dataclass(frozen=True)
class KVShape:
    layers: int                # attention layers (config.attention_layers): a hybrid model's others hold no KV
    kv_heads: int
    row: int                   # storage elements of one (token, kv head) row: kv/kvtype.py KVType.width(head_dim)
    dtype: torch.dtype         # the storage dtype (KVType.storage)
    max_capacity: int          # hard limit: the context length in tokens
    block: int = 1             # buffer capacity is a multiple of this (the model's attention needs it)

    def round_up(self, n: int) -> int:
        return -(-n // self.block) * self.block


class Slot:
    """One KV sequence. Not thread-safe: whoever holds the slot is its only user."""

    def __init__(self, index: int, shape: KVShape, initial_capacity: int = 256,
                 recurrent: RecurrentShape | None = None, state_interval: int = 64,
                 marks: frozenset[int] = frozenset()):
        """recurrent, state_interval, marks: a hybrid model's recurrent state, its snapshot grid and the
        message-start token ids it snapshots before (kv/recurrent.py)."""
        self.index = index
        self.shape = shape
        self.record = PrefixRecord()
        self.last_used = 0.0                 # time.monotonic() of the last release, for LRU
        # a hybrid model's recurrent layers: their state after the record's last position, and snapshots
        self.state = RecurrentState(recurrent, state_interval, marks=marks) if recurrent is not None else None
        self._allocate(shape.round_up(min(initial_capacity, shape.max_capacity)))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def _allocate(self, capacity: int) -> None:
        s = self.shape
        # k, v: (attention layers, kv_heads, capacity, row)
        self.k = torch.zeros(s.layers, s.kv_heads, capacity, s.row, dtype=s.dtype)
        self.v = torch.zeros_like(self.k)
        self._clear()  # new buffers hold nothing the record could describe

    def _clear(self, namespace: bytes | None = None) -> None:
        """The record emptied, and the recurrent state with it (it described the record's positions)."""
        self.record.clear(namespace)
        if self.state is not None:
            self.state.reset()

    def ensure_capacity(self, needed: int) -> None:
        """Make room for positions [0, needed). May reallocate (copy-grow keeps the record).
        Raises ContextOverflow (and empties the record) past max_capacity."""
        if needed <= self.capacity:
            return
        if needed > self.shape.max_capacity:
            self._clear()
            raise ContextOverflow(f"{needed} tokens exceed the context of {self.shape.max_capacity}")
        # rounding may pass max_capacity: those positions are padding, never written
        new_cap = self.shape.round_up(min(max(needed, 2 * self.capacity), self.shape.max_capacity))
        keep = len(self.record)
        try:
            k = torch.zeros(self.shape.layers, self.shape.kv_heads, new_cap, self.shape.row,
                            dtype=self.shape.dtype)
            v = torch.zeros_like(k)
            k[:, :, :keep] = self.k[:, :, :keep]
            v[:, :, :keep] = self.v[:, :, :keep]
        except BaseException:
            self._clear()         # failed grow: drop the record, the old buffers stay but describe nothing
            raise
        self.k, self.v = k, v     # copy-grow: record still describes positions [0, keep)

    def reset(self, namespace: bytes = b"") -> None:
        """Forget the contents (LRU reuse of the slot for another conversation). Keeps the buffers."""
        self._clear(namespace)

    def resumable(self, k: int) -> int:
        """The longest prefix <= k this slot can keep: k itself (attention KV cuts anywhere), or with a
        recurrent state the latest position <= k it can resume from [RESUME-AT-SNAPSHOT]. Pure."""
        return k if self.state is None else self.state.resumable(min(k, len(self.record)))

    def truncate(self, k: int) -> None:
        """Keep positions [0, k): k must be `resumable(k)` (ValueError otherwise, nothing changed). Side
        effects: the recurrent state restored at k, then the record cut (the KV past k is left as it is:
        nothing reads past the record)."""
        if self.state is not None:
            self.state.restore(k)
        self.record.truncate(k)

    def hold_for_verify(self) -> None:
        """[VERIFY-REWIND] Before a step that feeds draft rows to verify: a hybrid slot copies its recurrent
        state (its layers cannot be cut back past rows they took), so that `reject` can go back to it.
        Side effect: the state's held copy; nothing for attention alone (its rows are cut from the record)."""
        if self.state is not None:
            self.state.hold()

    def reject(self, rows: int) -> int:
        """[VERIFY-REWIND] After that step: drop its last `rows` rows (drafts the model did not take). Attention
        alone: the record is cut by `rows` (the KV past it is overwritten later). A hybrid slot goes back to the
        state held at the step's start and its record is cut there: the step's rows that stand must be fed
        again, with the same bits. Returns how many that is (0 for attention alone). Side effects: the
        record (and the recurrent state, its snapshots past the step's start)."""
        if self.state is None:
            self.record.truncate(len(self.record) - rows)
            return 0
        standing = len(self.record) - rows
        start = self.state.rewind()
        self.record.truncate(start)
        return standing - start

    def touch(self) -> None:
        self.last_used = time.monotonic()
