"""The on-disk format of one KV block, and its verification. No pickle: raw tensors behind a header.

    b"TERNLMKV" | u32 little-endian header length | header (JSON, UTF-8) | payload: k bytes, v bytes
                                                                          [, conv bytes, ssm bytes]

The header says everything the payload depends on (format version, block key, parent key,
namespace, model sha256, dtype, KV dtype, shape, the block's token ids) plus the payload's length
and sha256. `decode` trusts nothing: a file is used only when its header parses, names the key the
caller asked for, recomputes to that key from its own parent/ids/namespace, matches the caller's
namespace, shape and token ids, and its payload has the stated length and checksum. Anything else
is a BadBlock with a reason (truncated, corrupted, foreign model, foreign version, ...).

A tail entry (a conversation's last partial block, kv/blocks.py) is the same file with `"kind":"tail"`
in its header, 1 to BLOCK_TOKENS - 1 positions, and a key that recomputes with blocks.tail_key. Its
file name (locator + key) comes from a directory listing, so a tail's expectation names its key,
parent and namespace; its ids and length are read from the header, which must hash to that key.
Block files carry no "kind" and are byte-identical to those of earlier builds.

A hybrid model's entry may also carry the recurrent state after its last position (kv/recurrent.py:
conv inputs and delta-rule state, fp32; `"state": {"conv": shape, "ssm": shape}` in the header, their
bytes after v's, under the same checksum). Attention KV can be loaded up to any position, a recurrent
state only at an entry's end: the engine resumes at the last loaded entry that carries one
([RESUME-AT-SNAPSHOT]). An entry without "state" is KV only, as before.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Callable, ParamSpec, TypeVar

import torch

from .blocks import BLOCK_TOKENS, block_key, tail_key, tail_locator
from .kvtype import KV_TYPES

MAGIC = b"TERNLMKV"
VERSION = 1
SUFFIX = ".tkv"
MAX_HEADER = 1 << 20            # a header is ~2 KiB; anything near this is garbage
# a block's kv_dtype -> its payload's storage dtype (kv/kvtype.py's formats; bfloat16 from older writers)
_DTYPES = {"bfloat16": torch.bfloat16, **{name: t.storage for name, t in KV_TYPES.items()}}


P = ParamSpec("P")
R = TypeVar("R")


class BadBlock(ValueError):
    """A block file that must not be used. `reason` is one short log-ready phrase."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BlockMeta:
    """What a block's KV was computed from and how it is laid out (the header, minus checksums)."""
    key: bytes
    parent: bytes
    namespace: bytes
    model_sha256: str
    dtype: str                   # compute dtype of the model that wrote it ("torch.bfloat16")
    kv_dtype: str                # "float32" | "float16" | "q8_0" (kv/kvtype.py)
    shape: tuple[int, int, int, int]   # (layers, kv_heads, tokens, row) of k and of v: row = KVType.width(head_dim)
    ids: tuple[int, ...]         # tokens = BLOCK_TOKENS for a block, 1..BLOCK_TOKENS - 1 for a tail
    tail: bool = False           # a tail entry: the ids after the parent block, fewer than a block
    # the recurrent state's shapes, (conv (R, conv_dim, K - 1), ssm (R, Hv, dk, dv)): on a stored entry,
    # those of the state it carries (None: KV only); on an expectation, those a state must have (None: a
    # model without recurrent layers, whose entries carry none)
    state: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def name(self) -> bytes:
        """Where the tiers file it: a block's key (32 bytes); a tail's locator + key (64 bytes), so
        the tails following one parent can be listed without reading them."""
        return tail_locator(self.parent, self.namespace) + self.key if self.tail else self.key


@dataclass(frozen=True)
class BlockKV:
    """A verified block or tail: its meta and k, v each (layers, kv_heads, tokens, row); `state`: a
    hybrid model's recurrent state after its last position, (conv, ssm) fp32 shaped as meta.state, or None."""
    meta: BlockMeta
    k: torch.Tensor
    v: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        shapes = None if self.state is None else tuple(tuple(t.shape) for t in self.state)
        if shapes != self.meta.state:
            raise ValueError(f"a block's state {shapes} does not match its meta's {self.meta.state}")

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + sum(t.nbytes for t in self.state or ())


def encode(meta: BlockMeta, k: torch.Tensor, v: torch.Tensor,
           state: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[bytes, list[memoryview]]:
    """(header bytes, payload buffers) of one block file; the payload is written without copies.
    `state`: the recurrent state (conv, ssm) after the entry, fp32, shaped as meta.state."""
    tensors = (k, v) + tuple(t.to(torch.float32) for t in state or ())
    # flat byte views (reshape(-1) first: memoryview cannot cast a view with a zero in its shape, as lfm2's
    # empty ssm part of the state has)
    bufs = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()).cast("B") for t in tensors]
    h = hashlib.sha256()
    for b in bufs:
        h.update(b)
    header = {"format": VERSION, "key": meta.key.hex(), "parent": meta.parent.hex(),
              "namespace": meta.namespace.hex(), "model_sha256": meta.model_sha256, "dtype": meta.dtype,
              "kv_dtype": meta.kv_dtype, "shape": list(meta.shape), "ids": list(meta.ids),
              "payload_bytes": sum(len(b) for b in bufs), "payload_sha256": h.hexdigest()}
    if meta.tail:
        header["kind"] = "tail"
    if state is not None:
        header["state"] = {"conv": list(state[0].shape), "ssm": list(state[1].shape)}
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(body)) + body, bufs


def _only_bad_block(fn: Callable[P, R]) -> Callable[P, R]:
    """Whatever the bytes, a reader raises BadBlock and nothing else (tests/test_kv_fuzz.py holds it to
    that): any other exception (RecursionError from deep JSON, OverflowError from Infinity, struct.error
    from an id past int32, MemoryError) would reach the request as a 500 and leave the file in place to
    fail every later request with that prefix."""
    @functools.wraps(fn)
    def guarded(*args: P.args, **kw: P.kwargs) -> R:
        try:
            return fn(*args, **kw)
        except BadBlock:
            raise
        except Exception as e:
            raise BadBlock(f"undecodable ({type(e).__name__})") from None
    return guarded


@_only_bad_block
def read_header(data: bytes | memoryview) -> tuple[dict, int]:
    """(header dict, payload offset). Raises BadBlock when the file cannot even be parsed."""
    if len(data) < len(MAGIC) + 4:
        raise BadBlock("truncated (no header)")
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise BadBlock("not a ternlm KV block (bad magic)")
    (hlen,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if hlen > MAX_HEADER or start + hlen > len(data):
        raise BadBlock("truncated or corrupted header")
    try:
        header = json.loads(bytes(data[start:start + hlen]))
    except ValueError:
        raise BadBlock("corrupted header (not JSON)") from None
    if not isinstance(header, dict):
        raise BadBlock("corrupted header")
    if header.get("format") != VERSION:
        raise BadBlock(f"foreign format version {header.get('format')!r} (this build reads {VERSION})")
    return header, start + hlen


def read_file_header(path) -> dict:
    """The header of a block (or tail) file, reading only the header bytes, not the payload (listing a
    directory of them stays cheap). Raises BadBlock, OSError."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 4)
        if len(start) < len(MAGIC) + 4:
            raise BadBlock("truncated (no header)")
        (hlen,) = struct.unpack("<I", start[len(MAGIC):])
        data = start + f.read(min(hlen, MAX_HEADER))
    return read_header(data)[0]


@_only_bad_block
def meta_of(header: dict) -> BlockMeta:
    """The header as a BlockMeta; checks that its key recomputes from its own parent, ids, namespace."""
    try:
        meta = BlockMeta(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]),
                         bytes.fromhex(header["namespace"]), str(header["model_sha256"]), str(header["dtype"]),
                         str(header["kv_dtype"]), tuple(int(x) for x in header["shape"]),
                         tuple(int(x) for x in header["ids"]))
    except (KeyError, TypeError, ValueError):
        raise BadBlock("corrupted header (missing or malformed fields)") from None
    kind = header.get("kind", "block")
    if kind not in ("block", "tail"):
        raise BadBlock(f"unknown entry kind {kind!r}")
    tail = kind == "tail"
    tokens = len(meta.ids)
    if len(meta.shape) != 4 or meta.shape[2] != tokens or \
            not (0 < tokens < BLOCK_TOKENS if tail else tokens == BLOCK_TOKENS):
        raise BadBlock(f"wrong {kind} shape {meta.shape}")
    if meta.kv_dtype not in _DTYPES:
        raise BadBlock(f"unknown KV dtype {meta.kv_dtype!r}")
    keyed = tail_key if tail else block_key
    if len(meta.parent) != 32 or keyed(meta.parent, list(meta.ids), meta.namespace) != meta.key:
        raise BadBlock("header does not hash to its key (corrupted)")
    state = header.get("state")
    if state is not None:
        try:
            shapes = tuple(tuple(int(x) for x in state[part]) for part in ("conv", "ssm"))
        except (KeyError, TypeError, ValueError):
            raise BadBlock("corrupted header (state)") from None
        # every conv dim >= 1; the ssm part may be empty past its layer count (lfm2's short convs keep none)
        if [len(s) for s in shapes] != [3, 4] or any(x < 1 for x in shapes[0]) or any(x < 0 for x in shapes[1]) \
                or shapes[0][0] != shapes[1][0]:
            raise BadBlock(f"wrong state shape {shapes}")
        meta = dataclasses.replace(meta, state=shapes)
    return dataclasses.replace(meta, tail=True) if tail else meta


@_only_bad_block
def decode(data: bytes | bytearray | memoryview, expect: BlockMeta | None = None) -> BlockKV:
    """Verify and decode one block file's bytes. `expect`: what the caller needs (key, parent,
    namespace, model, dtype, shape, ids; for a tail, everything but its ids and their count, which
    the header gives and its key vouches for); None checks only the file's own consistency (cache
    verify). Raises BadBlock. The returned tensors share memory with `data`."""
    header, off = read_header(data)
    meta = meta_of(header)
    if expect is not None:
        if meta.model_sha256 != expect.model_sha256 or meta.dtype != expect.dtype:
            raise BadBlock(f"foreign model ({meta.model_sha256[:12]} {meta.dtype})")
        if meta.tail != expect.tail:
            raise BadBlock("kind (block or tail) differs from the request's")
        fields = ("key", "parent", "namespace", "kv_dtype") + (() if expect.tail else ("shape", "ids"))
        for field in fields:
            if getattr(meta, field) != getattr(expect, field):
                raise BadBlock(f"{field} differs from the request's")
        if expect.tail and (meta.shape[:2], meta.shape[3]) != (expect.shape[:2], expect.shape[3]):
            raise BadBlock("shape differs from the request's")
        if meta.state is not None and meta.state != expect.state:
            raise BadBlock("recurrent state shape differs from the request's")
    size = header.get("payload_bytes")
    if type(size) is not int:
        raise BadBlock("corrupted header (payload_bytes)")
    itemsize = torch.empty(0, dtype=_DTYPES[meta.kv_dtype]).element_size()
    one = meta.shape[0] * meta.shape[1] * meta.shape[2] * meta.shape[3] * itemsize
    state = [math.prod(s) * 4 for s in meta.state or ()]      # fp32 conv, ssm bytes
    if size != 2 * one + sum(state):
        raise BadBlock("payload size does not match the shape")
    if len(data) - off != size:
        raise BadBlock(f"truncated payload ({len(data) - off} of {size} bytes)"
                       if len(data) - off < size else "trailing bytes after the payload")
    payload = memoryview(data)[off:]
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise BadBlock("payload checksum mismatch (corrupted)")
    kv = 2 * one
    flat = torch.frombuffer(payload[:kv], dtype=_DTYPES[meta.kv_dtype]) if kv else torch.empty(0)
    half = one // itemsize
    got = None
    if meta.state is not None:       # (conv, ssm) fp32 after v, shaped as the header says
        conv = torch.frombuffer(payload[kv:kv + state[0]], dtype=torch.float32).view(meta.state[0])
        ssm = torch.frombuffer(payload[kv + state[0]:], dtype=torch.float32).view(meta.state[1]) if state[1] \
            else torch.zeros(meta.state[1])          # an empty ssm part (lfm2): frombuffer takes no empty buffer
        got = (conv, ssm)
    return BlockKV(meta, flat[:half].view(meta.shape), flat[half:].view(meta.shape), got)
