"""Prefill and decode: THE place where KV is written, and therefore where the record is written.

Every write into a slot's KV goes through `prefill`, `decode` or `load_blocks` below, and each appends
to the slot's PrefixRecord right after the write that filled those positions returned
([RECORD-WHERE-FED]); for `load_blocks` the ids are the verified block's own.
An exception inside a model call leaves the record at the last completed write: positions the
failed call touched are beyond len(record) and therefore never read as reusable.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from .kv.blockfile import BlockKV
from .kv.slots import Slot
from .models.llama import ATTN_BLOCK, KV_DTYPE, Transformer


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


class Runner:
    def __init__(self, model: Transformer, chunk_size: int = 256):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.model = model
        self.chunk_size = chunk_size

    def _inputs(self, ids: list[int], start: int, embeds: dict[int, Embed] | None) -> torch.Tensor:
        """(T, hidden) input embeddings for positions [start, start + len(ids))."""
        x = self.model.embed_ids(torch.tensor(ids, dtype=torch.long))
        if embeds:
            for pos, e in embeds.items():
                if start <= pos < start + len(ids):
                    x[pos - start] = e.vector.to(x.dtype)
        return x

    @torch.inference_mode()
    def prefill(self, slot: Slot, ids: list[int], embeds: dict[int, Embed] | None = None,
                on_chunk: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed ids as positions [len(record), len(record) + len(ids)), chunk by chunk.
        Side effects: writes KV and appends to slot.record after each chunk; `on_chunk(end)` runs
        after each recorded chunk (cancellation and fault hooks; an exception there stops the
        prefill with the record exact). Returns fp32 logits (vocab,) of the last position."""
        if not ids:
            raise ValueError("prefill needs at least one token")  # [FRESH-LOGITS]
        start = len(slot.record)
        logits = None
        for c0 in range(0, len(ids), self.chunk_size):
            chunk = ids[c0:c0 + self.chunk_size]
            pos = start + c0
            slot.ensure_capacity(pos + len(chunk))
            x = self._inputs(chunk, pos, embeds)
            logits = self.model(x, pos, slot.k, slot.v)
            digests, taint_at = {}, None
            for p in range(pos, pos + len(chunk)):
                e = embeds.get(p) if embeds else None
                if e is not None:
                    if e.digest is None and taint_at is None:
                        taint_at = p
                    digests[p] = e.digest or b""
            slot.record.append(chunk, digests, taint_at)  # [RECORD-WHERE-FED]
            if on_chunk is not None:
                on_chunk(pos + len(chunk))
        return logits[-1]

    @torch.inference_mode()
    def decode(self, slot: Slot, token: int) -> torch.Tensor:
        """Feed one sampled token at position len(record). Side effects: writes KV, appends the
        token to the record. Returns fp32 logits (vocab,)."""
        pos = len(slot.record)
        slot.ensure_capacity(pos + 1)
        x = self.model.embed_ids(torch.tensor([token], dtype=torch.long))
        logits = self.model(x, pos, slot.k, slot.v)
        slot.record.append([token])  # [RECORD-WHERE-FED]
        return logits[-1]

    @torch.inference_mode()
    def load_blocks(self, slot: Slot, blocks: list[BlockKV]) -> None:
        """Copy stored blocks into the slot at positions [len(record), ...), block after block.
        Each block must start where the record ends (the store's chained keys guarantee the ids
        before it are the record's). Side effects: writes KV, appends each block's ids to the record."""
        for b in blocks:
            pos = len(slot.record)
            n = b.meta.shape[2]
            assert b.meta.shape == (slot.shape.layers, slot.shape.kv_heads, n, slot.shape.head_dim)
            slot.ensure_capacity(pos + n)
            slot.k[:, :, pos:pos + n].copy_(b.k)   # k, v: (layers, kv_heads, n, head_dim)
            slot.v[:, :, pos:pos + n].copy_(b.v)
            slot.record.append(list(b.meta.ids))  # [RECORD-WHERE-FED]

    @torch.inference_mode()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """One full forward pass on a private, exact-size KV (no slot, no cache): (len(ids), vocab)."""
        m = self.model
        cfg = m.cfg
        capacity = -(-len(ids) // ATTN_BLOCK) * ATTN_BLOCK
        k = torch.zeros(cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim, dtype=KV_DTYPE)
        v = torch.zeros_like(k)
        return m(self._inputs(ids, 0, None), 0, k, v, all_logits=True)
