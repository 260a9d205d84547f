"""A slot's recurrent state (hybrid models' gated-DeltaNet, Mamba-2 or short-conv layers) and its snapshots.

Why snapshots: attention KV can be cut back to any prefix, a recurrent layer's state cannot (it folds every
token in). So the slot keeps the state at the end of its record (`pos`) and copies of it at earlier
positions: every `interval` absolute positions (the grid), at the end of each prefill, and before every
message-start token fed (`marks`: the chat template's, message_marks.py), where an edit of that message
diverges. Reuse resumes from the latest of those at or before the divergence ([RESUME-AT-SNAPSHOT]); at
most the grid's interval of tokens (plus what was decoded since the last snapshot) is prefilled again. The scan takes the same per-token
steps on every path (kernels/recurrent.c [RESUME-EXACT]), so a resumed state has the cold run's bits.

Invariant: `pos == len(record)` whenever the slot is idle, and the state (and every snapshot at s) describes
record.fed[0:pos] (resp. [0:s]): the runner advances `pos` where it appends the record [RECORD-WHERE-FED],
truncation restores a snapshot before cutting the record, and a failed step invalidates the state (the
record is then cleared by the runner: any doubt, recompute).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentShape:
    """ssm (layers, heads, key_dim, value_dim) is the delta rule's (Hv, dk, dv) per gated-DeltaNet layer, and a
    Mamba-2 layer's (H, head_dim P, d_state N): the same three dims by other names (recurrent_shape)."""
    layers: int          # recurrent layers (the model's gated-DeltaNet or Mamba-2 layers, in order)
    conv_dim: int        # channels of the short causal convolution (q | k | v, or Mamba-2's x | B | C, before it)
    conv_keep: int       # inputs the convolution keeps: kernel - 1
    heads: int           # value heads Hv | Mamba-2 heads H
    key_dim: int         # dk | head_dim P
    value_dim: int       # dv | d_state N

    @property
    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv, ssm) tensor shapes: what a stored entry's state must have (kv/blockfile.BlockMeta.state)."""
        return (self.layers, self.conv_dim, self.conv_keep), (self.layers, self.heads, self.key_dim, self.value_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of one state (every recurrent layer's conv inputs and delta-rule state, fp32)."""
        return 4 * self.layers * (self.conv_dim * self.conv_keep + self.heads * self.key_dim * self.value_dim)


def recurrent_shape(cfg) -> RecurrentShape | None:
    """What a slot's recurrent state holds for a model (config.ModelConfig), None when no layer is recurrent."""
    if not cfg.recurrent_layers:
        return None
    if cfg.kind(cfg.recurrent_layers[0]) == "shortconv":  # lfm2: the conv's inputs only, no ssm (zero-sized)
        return RecurrentShape(len(cfg.recurrent_layers), cfg.hidden_size, cfg.shortconv_kernel - 1, 0, 0, 0)
    if cfg.kind(cfg.recurrent_layers[0]) == "mamba2":     # every recurrent layer is one kind (models/config.py checks)
        H, P, N, G = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state, cfg.mamba_groups
        return RecurrentShape(len(cfg.recurrent_layers), H * P + 2 * G * N, cfg.mamba_conv_kernel - 1, H, P, N)
    conv_dim = 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * cfg.linear_value_dim
    return RecurrentShape(len(cfg.recurrent_layers), conv_dim, cfg.linear_conv_kernel - 1,
                          cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim)


# Snapshots a slot keeps, in bytes: a Qwen3.5-like 24 x 1024 model's state is 19.3 MiB, so at one every 64
# positions snapshots outweigh its KV ~3x; the newest are kept (an appended turn resumes at the last prefill's
# end, an edit a few turns back at a grid point near it), the oldest dropped first.
SNAPSHOT_BUDGET = 256 << 20


class RecurrentState:
    """One slot's recurrent state. Not thread-safe: the slot's holder is its only user."""

    def __init__(self, shape: RecurrentShape, interval: int = 64, max_snapshots: int | None = None,
                 marks: frozenset[int] = frozenset()):
        """max_snapshots: None = as many as SNAPSHOT_BUDGET holds (at least 2, at most 4096). marks: token ids
        that open a message (message_marks.py); the state before each one fed is snapshot (`wants`)."""
        if max_snapshots is None:
            max_snapshots = self.snapshots_for(shape)
        if interval < 1 or max_snapshots < 1:
            raise ValueError("state interval and max snapshots must be >= 1")
        self.shape, self.interval, self.max_snapshots = shape, interval, max_snapshots
        self.marks = frozenset(marks)
        s = shape
        self.conv = torch.zeros(s.layers, s.conv_dim, s.conv_keep)            # (R, conv_dim, K - 1), oldest first
        self.ssm = torch.zeros(s.layers, s.heads, s.key_dim, s.value_dim)     # (R, Hv, dk, dv)
        self.pos = 0                 # the state describes positions [0, pos); -1: invalid (a failed step)
        self.snaps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # position -> (conv, ssm) copies
        # [VERIFY-REWIND] the state before a speculative verify step (hold), outside the snapshot budget
        self.held: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def snapshots_for(shape: RecurrentShape) -> int:
        """How many snapshots SNAPSHOT_BUDGET holds for this shape (at least 2, at most 4096). Pure."""
        return min(4096, max(2, SNAPSHOT_BUDGET // max(shape.nbytes, 1)))

    def reset(self) -> None:
        """The state before position 0 (zeros), no snapshots."""
        self.conv.zero_()
        self.ssm.zero_()
        self.pos = 0
        self.snaps.clear()
        self.held = None

    def invalidate(self) -> None:
        """A step failed with the state half-advanced: nothing describes it (the snapshots still do their
        positions)."""
        self.pos = -1
        self.held = None

    def hold(self) -> None:
        """[VERIFY-REWIND] Copy the live state before a speculative verify step, so that `rewind` can take it
        back when drafted rows are rejected (the recurrent layers cannot be cut back past rows they took). One
        copy a slot, replaced by the next hold; not a snapshot (it neither counts against max_snapshots nor
        evicts one). Side effect: held."""
        if self.held is None or self.held[1].shape != self.conv.shape:
            self.held = (self.pos, self.conv.clone(), self.ssm.clone())
        else:
            self.held[1].copy_(self.conv)
            self.held[2].copy_(self.ssm)
            self.held = (self.pos, self.held[1], self.held[2])

    def rewind(self) -> int:
        """Make the held state (`hold`) the live one again and return its position; snapshots past it go
        (the verify step's, about to be rewritten). Side effects: conv, ssm, pos, snaps; held stays (it is the
        live state's copy until the next hold). ValueError when nothing is held."""
        if self.held is None or self.held[0] < 0:
            raise ValueError("no recurrent state held to rewind to")
        k, conv, ssm = self.held
        self.conv.copy_(conv)
        self.ssm.copy_(ssm)
        self.pos = k
        for s in [s for s in self.snaps if s > k]:
            del self.snaps[s]
        return k

    def resumable(self, k: int) -> int:
        """The latest position <= k this state can resume from: `pos` itself, a snapshot, or 0. Pure."""
        if 0 <= self.pos <= k:
            return self.pos
        return max((s for s in self.snaps if s <= k), default=0)

    def restore(self, k: int) -> None:
        """Make the state describe [0, k): k must be `resumable(k)`. Drops the snapshots past k (their
        positions are about to be rewritten). Side effects: conv, ssm, pos, snaps."""
        if k != self.resumable(k):
            raise ValueError(f"no recurrent snapshot at {k} (latest at or before it: {self.resumable(k)})")
        if k == 0:
            self.reset()
            return
        if k != self.pos:
            conv, ssm = self.snaps[k]
            self.conv.copy_(conv)
            self.ssm.copy_(ssm)
            self.pos = k
        for s in [s for s in self.snaps if s > k]:
            del self.snaps[s]

    def at(self, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The state describing [0, k) as (conv, ssm) views (the live state when pos == k, else a snapshot;
        the caller copies what it keeps), or None: none is held for k. Pure."""
        if k == self.pos:
            return self.conv, self.ssm
        return self.snaps.get(k)

    def adopt(self, k: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Make (conv, ssm), a state describing [0, k) that came from elsewhere (a tier entry, another
        slot), the live state at k, and keep a copy as a snapshot there. The caller has made the record
        describe [0, k). Drops snapshots past k. Side effects: conv, ssm, pos, snaps."""
        self.conv.copy_(conv)
        self.ssm.copy_(ssm)
        self.pos = k
        for s in [s for s in self.snaps if s > k]:
            del self.snaps[s]
        self.keep(k, self.conv.clone(), self.ssm.clone())

    def wants(self, start: int, ids: list[int], prefill_end: bool) -> list[int]:
        """Positions a step feeding `ids` at [start, end) should snapshot, ascending: the grid's multiples in
        (start, end], `end` itself at the end of a prefill, and each p whose fed token is a mark (the state
        before a message starts), at most the newest max_snapshots // 2 of them (the boundary pool's share:
        keep() would drop older ones at once, and each costs a state's bytes during the step). A mark at
        `start` itself is wanted only when the live state is there (pos == start): the caller copies it, the
        step does not cross it. Pure."""
        end = start + len(ids)
        grid = range((start // self.interval + 1) * self.interval, end + 1, self.interval)
        marks = [start + i for i, t in enumerate(ids) if t in self.marks and (i or self.pos == start)]
        marks = marks[-(self.max_snapshots // 2):] if self.max_snapshots // 2 else []
        return sorted(set(grid) | set(marks) | ({end} if prefill_end and end > start else set()))

    def keep(self, pos: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """A snapshot at `pos` (copies made by the caller). Over max_snapshots one goes, never the newest:
        the oldest boundary (a position off the grid: a prefill's end or a message start) while boundaries
        hold more than half the budget, else the oldest grid point. Why two pools: an edit a few messages
        back diverges just after that message's start, which only a boundary reaches closely; an append or a
        trimmed answer diverges near the end, which the newest grid points (and the last prefill's end)
        serve. With one oldest-first pool the grid evicted every boundary (a 24-layer model holds 13
        snapshots in its 256 MiB: 832 tokens of grid). Oldest first in each pool: edits and appends land
        near the end of a chat, and a restore drops what lies past it, so the newest boundaries are the
        ones a chat edited every turn needs (each re-prefill snapshots the message starts it feeds)."""
        self.snaps[pos] = (conv, ssm)
        while len(self.snaps) > self.max_snapshots:
            newest = max(self.snaps)
            bounds = sorted(s for s in self.snaps if s % self.interval and s != newest)
            grid = sorted(s for s in self.snaps if not s % self.interval and s != newest)
            pool = bounds if len(bounds) > self.max_snapshots // 2 or not grid else grid
            del self.snaps[pool[0]]

    @property
    def nbytes(self) -> int:
        """Bytes held: the live state and every snapshot."""
        return self.shape.nbytes * (1 + len(self.snaps))
