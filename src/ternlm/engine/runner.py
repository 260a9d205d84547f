"""Steps, prefill and decode: THE place where KV is written, and therefore where the record is written.

Every write into a slot's KV goes through `step` (one forward pass over the rows of many slots:
continuous batching), its one-slot conveniences `prefill` and `decode`, or `load_blocks`. Each slot's
PrefixRecord is appended right after the write that filled those positions returned
([RECORD-WHERE-FED]): for `step`, per slot, right after the batched forward returned; for
`load_blocks`, the verified block's own ids. An exception inside a model call leaves every record in
the batch at its last completed write: positions the failed call touched are beyond len(record) and
therefore never read as reusable.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..invariants import check
from ..kv.blockfile import BlockKV
from ..kv.recurrent import RecurrentState, recurrent_shape
from ..kv.slots import Slot
from ..models.llama import ATTN_BLOCK, Segment, Transformer


@dataclass(frozen=True)
class Embed:
    """A caller-supplied input embedding for one position (how image/audio features enter a model).
    Its token id does not describe it, so the record keeps `digest`; None means the payload could
    not be digested and the record is tainted from this position on."""
    vector: torch.Tensor          # (hidden,)
    digest: bytes | None


def digest_tensor(t: torch.Tensor) -> bytes:
    """Content digest of a tensor: dtype, shape and bytes (bit-exact payloads match)."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


@dataclass(frozen=True)
class Feed:
    """One slot's rows in a step: `ids` go to positions [len(record), len(record) + len(ids)).
    logits: "last" | "all" | "none" (see models.llama.Segment)."""
    slot: Slot
    ids: list[int]
    embeds: dict[int, Embed] | None = None    # absolute position -> caller embedding
    logits: str = "last"


def _captures(f: Feed) -> dict | None:
    """The recurrent snapshots a feed's step takes (kv/recurrent.py `wants`: the grid's positions it
    crosses, its end when it ends a prefill, i.e. a multi-token feed that asks for logits, and the state
    before each message-start token it feeds), as tensors the recurrent layers fill; None without a
    recurrent state. A mark at the feed's start is the live state itself: copied here, the layers never
    write a capture at the start (they fill positions in (start, end])."""
    st = f.slot.state
    if st is None:
        return None
    start = len(f.slot.record)
    # a prefill's last chunk asks for its last row; a verify step ("all": a token and its draft) is no prefill
    # end: a snapshot there every step would evict the message starts [VERIFY-REWIND]
    want = st.wants(start, f.ids, prefill_end=len(f.ids) > 1 and f.logits == "last")
    return {p: (st.conv.clone(), st.ssm.clone()) if p == start
            else (torch.empty_like(st.conv), torch.empty_like(st.ssm)) for p in want} or None


class Runner:
    def __init__(self, model: Transformer, chunk_size: int = 256):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.model = model
        self.chunk_size = chunk_size

    def _inputs(self, feeds: list[Feed]) -> torch.Tensor:
        """(M, hidden) input embeddings of every feed's rows, concatenated in order."""
        ids = [t for f in feeds for t in f.ids]
        x = self.model.embed_ids(torch.tensor(ids, dtype=torch.long))
        r0 = 0
        for f in feeds:
            if f.embeds:
                start = len(f.slot.record)
                for pos, e in f.embeds.items():
                    if start <= pos < start + len(f.ids):
                        x[r0 + pos - start] = e.vector.to(x.dtype)
            r0 += len(f.ids)
        return x

    @torch.inference_mode()
    def step(self, feeds: list[Feed]) -> list[torch.Tensor | None]:
        """One forward pass over the rows of all feeds (distinct slots): linears once over all rows,
        attention per slot. Returns per feed fp32 logits as its Feed.logits asks ((1, vocab) for "last").
        Side effects: may grow each slot (ensure_capacity; ContextOverflow empties that slot's record
        and raises before anything is computed); writes KV; then, per slot, appends its ids (and
        embedding digests / taint) to its record [RECORD-WHERE-FED], a recurrent state's position and the
        snapshots the step took with it. If the forward raises, no record changes, but for a slot with a
        recurrent state: it goes back to its latest snapshot (the state may be half-advanced)."""
        if not feeds or any(not f.ids for f in feeds):
            raise ValueError("a step feeds at least one token per slot")   # [FRESH-LOGITS]
        if len({id(f.slot) for f in feeds}) != len(feeds):
            raise ValueError("a slot appears twice in one step")
        for f in feeds:
            f.slot.ensure_capacity(len(f.slot.record) + len(f.ids))
        x = self._inputs(feeds)
        segs = [Segment(len(f.slot.record), len(f.ids), f.slot.k, f.slot.v, f.logits, f.slot.state,
                        _captures(f)) for f in feeds]
        try:
            logits = self.model.forward_batch(x, segs)
        except BaseException:
            for f in feeds:       # a recurrent state may be half-advanced: back to its latest snapshot
                if f.slot.state is not None:
                    f.slot.state.invalidate()
                    f.slot.truncate(f.slot.resumable(len(f.slot.record)))
            raise
        for f, seg in zip(feeds, segs):               # the forward returned: every write succeeded
            if seg.state is not None:                 # [RECORD-WHERE-FED] the state moves with the record
                seg.state.pos = seg.start + seg.length
                for at, (conv, ssm) in (seg.captures or {}).items():
                    seg.state.keep(at, conv, ssm)
        for f in feeds:
            pos = len(f.slot.record)
            digests, taint_at = {}, None
            for p, e in (f.embeds or {}).items():
                if pos <= p < pos + len(f.ids):
                    if e.digest is None:
                        taint_at = p if taint_at is None else min(taint_at, p)
                    digests[p] = e.digest or b""
            f.slot.record.append(f.ids, digests, taint_at)  # [RECORD-WHERE-FED]
        return logits

    def prefill(self, slot: Slot, ids: list[int], embeds: dict[int, Embed] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed ids as positions [len(record), len(record) + len(ids)), chunk by chunk (one step each).
        Side effects: writes KV and appends to slot.record after each chunk; `on_chunk(end)` runs
        after each recorded chunk (cancellation and fault hooks; an exception there stops the
        prefill with the record exact). Returns fp32 logits (vocab,) of the last position."""
        if not ids:
            raise ValueError("prefill needs at least one token")  # [FRESH-LOGITS]
        logits = None
        for c0 in range(0, len(ids), self.chunk_size):
            chunk = ids[c0:c0 + self.chunk_size]
            last = c0 + self.chunk_size >= len(ids)
            logits = self.step([Feed(slot, chunk, embeds, "last" if last else "none")])[0]
            if on_chunk is not None:
                on_chunk(len(slot.record))
        return logits[-1]

    def decode(self, slot: Slot, token: int) -> torch.Tensor:
        """Feed one sampled token at position len(record). Side effects: writes KV, appends the
        token to the record. Returns fp32 logits (vocab,)."""
        return self.step([Feed(slot, [token])])[0][-1]

    @torch.inference_mode()
    def load_blocks(self, slot: Slot, blocks: list[BlockKV]) -> None:
        """Copy stored blocks into the slot at positions [len(record), ...), block after block.
        Each block must start where the record ends (the store's chained keys guarantee the ids
        before it are the record's). Side effects: writes KV, appends each block's ids to the record;
        a hybrid slot's recurrent state moves with the record: it takes an entry's state (kept as a
        snapshot there), and after an entry without one describes nothing until one that has it."""
        for b in blocks:
            pos = len(slot.record)
            n = b.meta.shape[2]
            check(b.meta.shape == (slot.shape.layers, slot.shape.kv_heads, n, slot.shape.row),
                  f"a stored block of shape {b.meta.shape} does not fit this slot")
            slot.ensure_capacity(pos + n)
            slot.k[:, :, pos:pos + n].copy_(b.k)   # k, v: (layers, kv_heads, n, head_dim)
            slot.v[:, :, pos:pos + n].copy_(b.v)
            slot.record.append(list(b.meta.ids))  # [RECORD-WHERE-FED]
            if slot.state is not None:            # the state describes [0, pos + n) or nothing
                if b.state is not None:
                    slot.state.adopt(pos + n, *b.state)
                else:
                    slot.state.invalidate()

    def copy_prefix(self, src: Slot, dst: Slot, upto: int) -> None:
        """Copy KV positions [len(dst.record), upto) of `src` into `dst`: n > 1 choices of one prompt
        fork the KV its first choice prefilled instead of computing the same bits again. dst's record
        must be a prefix of src's; a hybrid src must hold its recurrent state at `upto` (src.resumable).
        Side effects: writes dst's KV, appends the ids to dst's record; dst's recurrent state becomes a
        copy of src's at `upto` (a snapshot there too)."""
        start = len(dst.record)
        state = src.state.at(upto) if src.state is not None else None
        check(src.state is None or state is not None, f"copy_prefix: the source holds no recurrent state at {upto}")
        check(start <= upto <= len(src.record) and src.record.fed[:start] == dst.record.fed
              and src.record.namespace == dst.record.namespace,
              "copy_prefix: the destination's record must be a prefix of the source's, same namespace")
        dst.ensure_capacity(upto)
        dst.k[:, :, start:upto].copy_(src.k[:, :, start:upto])   # k, v: (layers, kv_heads, positions, head_dim)
        dst.v[:, :, start:upto].copy_(src.v[:, :, start:upto])
        dst.record.append(src.record.fed[start:upto])            # [RECORD-WHERE-FED]
        if state is not None:                                    # the state moves with the record
            dst.state.adopt(upto, *state)

    @torch.inference_mode()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """One full forward pass on a private, exact-size KV (no slot, no cache): (len(ids), vocab)."""
        m = self.model
        cfg = m.cfg
        capacity = -(-len(ids) // ATTN_BLOCK) * ATTN_BLOCK
        k = torch.zeros(len(cfg.attention_layers), cfg.num_kv_heads, capacity, m.kv_type.width(cfg.head_dim),
                        dtype=m.kv_dtype)
        v = torch.zeros_like(k)
        shape = recurrent_shape(cfg)
        state = RecurrentState(shape) if shape is not None else None     # a hybrid model's, from position 0
        return m(m.embed_ids(torch.tensor(ids, dtype=torch.long)), 0, k, v, all_logits=True, state=state)
