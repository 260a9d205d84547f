"""Content-addressed KV blocks: fixed runs of BLOCK_TOKENS positions named by a chained hash.

    key_0 = H(ROOT,  ids[0:B],   namespace)             B = BLOCK_TOKENS
    key_i = H(key_{i-1}, ids[B*i:B*(i+1)], namespace)

Why chained: a block's KV depends on every token before it, not only on its own B ids, so its
name must too. Two prompts share block i exactly when they share ids [0, B(i+1)) and the
namespace (model sha256 + dtype + tenant), which is exactly when the KV is the same; conversations
with one system prompt therefore share its blocks, and a lookup walks keys from the prompt's start
and stops at the first miss. Pure Python: no torch, no files.

Tails: a conversation's last partial block (the ids after its last whole block, fewer than B) is a
tail entry, so a conversation comes back from a tier as whole as from its slot:

    tail key     = H_tail(parent, ids[B*m:], namespace)     parent = key_{m-1}, or ROOT when m = 0
    tail locator = H_loc(parent, namespace)                 what a lookup knows before reading any ids

A tail's key chains like a block's (its KV depends on every id before it); its locator names the
parent only, so a lookup that walked m whole blocks finds the tails that may follow them, reads their
ids and takes the one sharing the longest prefix with the rest of the prompt. ROOT is the parent of
a conversation shorter than one block; the namespace in both hashes scopes it.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

# Positions per block. Only whole blocks are stored, so a tier hit re-prefills up to B - 1 tokens
# beyond what a live slot would: at a 4k context 256-token blocks made a RAM hit cost ~1 s more than
# a slot hit; 64 keeps that near a slot hit for 4x the files (a smollm2 block is 2.9 MiB). Storage
# blocks are independent of the attention's 256-key blocks (slot capacity is rounded separately).
BLOCK_TOKENS = 64
ROOT = b"\0" * 32                  # the parent of block 0
_DOMAIN = b"ternlm-kv-block-v1\0"  # separates these hashes from any other sha256 use
_TAIL_DOMAIN = b"ternlm-kv-tail-v1\0"
_LOCATOR_DOMAIN = b"ternlm-kv-tail-locator-v1\0"


def _chained(domain: bytes, parent: bytes, ids: list[int], namespace: bytes) -> bytes:
    if len(parent) != 32:
        raise ValueError("parent key must be 32 bytes")
    h = hashlib.sha256(domain)
    h.update(parent)
    h.update(struct.pack("<I", len(namespace)) + namespace)
    h.update(struct.pack(f"<{len(ids)}i", *ids))    # last: its length follows from the input's
    return h.digest()


def block_key(parent: bytes, ids: list[int], namespace: bytes) -> bytes:
    """32-byte key of one block: H(domain, parent key, namespace, ids as little-endian int32)."""
    return _chained(_DOMAIN, parent, ids, namespace)


def tail_key(parent: bytes, ids: list[int], namespace: bytes) -> bytes:
    """32-byte key of a tail entry (1 <= len(ids) < BLOCK_TOKENS ids after the parent block)."""
    return _chained(_TAIL_DOMAIN, parent, ids, namespace)


def tail_locator(parent: bytes, namespace: bytes) -> bytes:
    """32 bytes shared by every tail that follows `parent` in `namespace` (the tails a lookup asks for)."""
    return _chained(_LOCATOR_DOMAIN, parent, [], namespace)


def tail_name(parent: bytes, ids: list[int], namespace: bytes) -> bytes:
    """64-byte name of a tail entry in the tiers: locator + key (a block's name is its 32-byte key)."""
    return tail_locator(parent, namespace) + tail_key(parent, ids, namespace)


@dataclass(frozen=True)
class BlockRef:
    """Block `index` of a token sequence: positions [start, start + BLOCK_TOKENS)."""
    index: int
    key: bytes
    parent: bytes
    ids: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.index * BLOCK_TOKENS

    @property
    def end(self) -> int:
        return self.start + BLOCK_TOKENS


def block_refs(ids: list[int], namespace: bytes, upto: int | None = None) -> list[BlockRef]:
    """The full blocks of ids[0:upto] with their chained keys (a partial tail block has no key).
    Cost: one sha256 over ~1 KiB per block, microseconds next to a forward pass."""
    n = len(ids) if upto is None else min(upto, len(ids))
    refs: list[BlockRef] = []
    parent = ROOT
    for i in range(n // BLOCK_TOKENS):
        chunk = tuple(ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS])
        key = block_key(parent, list(chunk), namespace)
        refs.append(BlockRef(i, key, parent, chunk))
        parent = key
    return refs


def tail_parent(refs: list[BlockRef]) -> bytes:
    """The parent of the tail after these whole blocks: the last one's key, ROOT when there is none."""
    return refs[-1].key if refs else ROOT
