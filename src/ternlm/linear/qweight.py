"""GGUF weights kept quantized: the layouts the native kernels multiply. GGML's blocks convert to the row
layouts below (exact values, tested against the gguf package), then to_lanes interleaves 16 rows: the lanes
layouts kernels/qlanes.c multiplies in every build (kernels/qamx.c multiplies the row layouts themselves on
AMX tiles, the opt-in TERNLM_AMX=1 build).

  q4g32: 4-bit codes, groups of 32 along the input: codes (out, in/2) bytes, byte j of a group holding
         elements j (low nibble) and j+16 (high nibble); scale/bias (out, in/32).
  q5g32: 5-bit codes: q4g32's nibbles plus `high` (out, in/8) bytes, 4 a group, bit j (little-endian)
         the fifth bit of element j; scale/bias (out, in/32).
  q8g16: 8-bit codes 0..255, groups of 16: codes (out, in) bytes; Q6_K's int8 scales (out, in/16) ("k6").
  q8g32: the same with groups of 32.

Scales and biases come in modes (kernels/qlanes.c's LM_*): "f16s" where GGML derives the offset from
d (Q4_0 -8d, Q5_0 -16d, Q8_0 -128d): fp16 scales and one fp32 constant for the matrix; "f16" when every
scale and offset is exactly an fp16 (GGML's own d and m: Q4_1, Q5_1); "k" (Q4_K, Q5_K) and "k6" (Q6_K): GGML's own
sub-block scales (uint8 sc and m, int8 sc for Q6_K) with the fp16 super-block d (and dmin) in `sup`,
multiplied out in the kernel (exact products); "f32" otherwise. Decode reads every weight byte once per
token, so the bytes per weight set its speed (Q8_0: 1.0625 instead of 1.5; Q5_0 0.6875 instead of 1.5;
Q4_1 0.625 instead of 0.75; Q6_K 1.07 instead of 1.5; Q4_K 0.58 instead of 0.75: GGML's own sizes but
Q6_K's).

A weight is w = fma(scale, code, bias). Every GGML type below maps onto one layout with that value
*exactly* equal to the fp32 GGML dequantization (gguf.quants.dequantize): the products d*sc, d*q and
dmin*m are exact in fp32 (at most 11 + 8 significant bits), so the only rounding is the final add,
which the fma does once, as GGML's fp32 code does. tests/test_qweight.py checks it against the gguf
package: equal values (only the sign of an exact zero can differ: fma(d, 8, -8d) is +0 where
d * (8 - 8) is -0 for a negative d, which no sum can tell apart).

  Q4_0  d*(q-8)          -> q4g32 scale d, bias -8d          Q8_0 d*q       -> q8g32 code q+128, bias -128d
  Q4_1  d*q + m          -> q4g32 scale d, bias m            Q5_0 d*(q-16)  -> q5g32 scale d, bias -16d
  Q4_K  d*sc*q - dmin*m  -> q4g32 (sub-blocks of 32)         Q5_1 d*q + m   -> q5g32
  Q5_K  (sub-blocks of 32) -> q5g32                          Q6_K (sub-blocks of 16) -> q8g16
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from ..invariants import check
from .ggml_blocks import _bits, _f16, _k_low_nibbles, _k_scales_mins, _nibbles, pack_bits

Q4, Q5, Q8, Q8W = "q4g32", "q5g32", "q8g16", "q8g32"
# The lanes layouts (kernels/qlanes.c): the same codes and scales, 16 weight rows interleaved so that a
# vector's lane j is row j of its block. Made at load by to_lanes(); see there.
Q4L, Q5L, Q8L, Q6L = "q4x16", "q5x16", "q8x16", "q6x16"
# (row layout, scale mode) -> its lanes layout: every GGML type's (Q6_K's q8g16 "k6" is q6x16: groups of 16)
LANES = {(Q4, m): Q4L for m in ("f32", "f16", "f16s", "k")} | {(Q5, m): Q5L for m in ("f32", "f16", "f16s", "k")} \
    | {(Q8W, m): Q8L for m in ("f32", "f16", "f16s")} | {(Q8, "k6"): Q6L}
# The int layouts (kernels/qint8.c, int8 activations): the lanes layouts' scales, biases and super-block
# scales, their codes and high bits rearranged so that a 32-bit lane holds 4 codes of one row. Made at
# load by to_int8() from a lanes layout; see there.
Q4I, Q5I, Q8I, Q6I = "i4x16", "i5x16", "i8x16", "i6x16"
INT_OF = {Q4L: Q4I, Q5L: Q5I, Q8L: Q8I, Q6L: Q6I}
BLOCK_ROWS = 16
GROUP = {Q4: 32, Q5: 32, Q8: 16, Q8W: 32, Q4L: 32, Q5L: 32, Q8L: 32, Q6L: 16, Q4I: 32, Q5I: 32, Q8I: 32, Q6I: 16}
NIBBLES = (Q4, Q5)       # row layouts whose codes are packed nibbles (GGML's order)


@dataclass(frozen=True)
class QWeight:
    """An (out, in) weight in one of the kernel's layouts (see the module docstring)."""
    fmt: str                   # "q4g32" | "q5g32" | "q8g16" | "q8g32" | lanes: "q4x16" | "q5x16" | "q8x16" | "q6x16"
    codes: torch.Tensor        # uint8 (out, in/2) for q4g32 and q5g32, (out, in) for the q8 layouts;
                               # lanes: (out/16, in/2, 16) q4x16, q5x16; (out/16, in, 16) q8x16, q6x16
    scale: torch.Tensor        # (out, in/group): fp32 | fp16 | uint8 sc ("k") | int8 sc ("k6");
                               # lanes: (out/16, in/group, 16) of the same types
    bias: torch.Tensor | None  # (out, in/group): fp32 | fp16 | uint8 m ("k"); (1,) fp32 constant c ("f16s":
                               # bias = c * scale); None for "k6" (-32 * scale); lanes: as scale, or (1,)
    high: torch.Tensor | None = None   # uint8 (out, in/8) for q5g32; lanes q5x16: uint8 (out/16, in, 2),
                                       # a little-endian uint16 per (block, input): bit j = row j's bit 4
    sup: torch.Tensor | None = None    # fp16 super-block scales: (out, in/256, 2) d, dmin ("k"); (out, in/256) d ("k6");
                                       # lanes: (out/16, in/256, 2, 16) "k", (out/16, in/256, 16) "k6"
    out: int | None = None     # lanes with out % 16 != 0: the real output count (the last block padded with
                               # zero codes and scales; out/16 above rounds up); None: every row of every block

    @property
    def lanes(self) -> bool:
        """Whether this is a lanes layout (16 weight rows interleaved: kernels/qlanes.c), or an int layout
        (the same, codes rearranged for int8 activations: kernels/qint8.c)."""
        return self.fmt in (Q4L, Q5L, Q8L, Q6L) or self.int8

    @property
    def int8(self) -> bool:
        """Whether this is an int layout (kernels/qint8.c: multiplied with int8 activations)."""
        return self.fmt in (Q4I, Q5I, Q8I, Q6I)

    @property
    def shape(self) -> tuple[int, int]:
        if self.lanes:
            return self.out or self.scale.shape[0] * BLOCK_ROWS, self.scale.shape[1] * GROUP[self.fmt]
        return self.scale.shape[0], self.scale.shape[1] * GROUP[self.fmt]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.bias, self.high, self.sup) if t is not None)

    @property
    def mode(self) -> str:
        """The scale mode: "f32" | "f16" | "k" | "k6" (see the module docstring)."""
        if self.sup is not None:
            return "k6" if self.bias is None else "k"
        if self.bias is not None and self.bias.dim() == 1:
            return "f16s"
        return "f16" if self.scale.dtype == torch.float16 else "f32"

    def scale_bias(self, rows: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 (len(rows), groups) scale and bias of every group: exact (the products below are
        exact in float64, and equal the kernel's fp32 ones, which are exact too)."""
        mode = self.mode
        scale, bias, sup = self._row_fields(rows)
        sc = scale.double()
        if mode in ("f32", "f16"):
            return sc, bias.double()
        if mode == "f16s":
            return sc, sc * float(self.bias[0])
        sup = sup.double()
        if mode == "k":                                  # (n, in/256, 2) -> per group of 32: 8 a block
            d, dmin = sup[..., 0].repeat_interleave(8, dim=1), sup[..., 1].repeat_interleave(8, dim=1)
            return d * sc, -(dmin * bias.double())
        s = sup.repeat_interleave(16, dim=1) * sc        # "k6": groups of 16, 16 a block
        return s, s * -32.0

    def _row_fields(self, rows: torch.Tensor | slice):
        """(scale, bias, sup) of `rows` as a row layout holds them: (n, groups), (n, groups) or the
        "f16s" constant or None, (n, in/256, 2) / (n, in/256) or None."""
        if not self.lanes:
            bias = self.bias if self.bias is None or self.bias.dim() == 1 else self.bias[rows]
            return self.scale[rows], bias, None if self.sup is None else self.sup[rows]
        block, lane = _block_lane(rows, self.shape[0])
        bias = self.bias if self.bias is None or self.bias.dim() == 1 else self.bias[block, :, lane]
        sup = None
        if self.sup is not None:        # "k": (n/16, in/256, 2, 16); "k6": (n/16, in/256, 16)
            sup = self.sup[block, :, :, lane] if self.sup.dim() == 4 else self.sup[block, :, lane]
        return self.scale[block, :, lane], bias, sup

    def codes_of_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Each weight's code, (len(rows), in) uint8, in input order."""
        if self.int8:
            return _int_codes(self, *_block_lane(rows, self.shape[0]))
        if self.lanes:
            block, lane = _block_lane(rows, self.shape[0])
            c = self.codes[block, :, lane]                                      # (n, in/2 or in)
            if self.fmt in (Q8L, Q6L):
                return c
            q = torch.stack((c & 0x0F, c >> 4), dim=-1).reshape(c.shape[0], -1)  # (n, in): inputs 2p, 2p+1
            if self.fmt == Q5L:
                h = self.high[block, :, lane // 8]                              # (n, in): the byte with bit j
                q = q | (((h >> (lane % 8).to(torch.uint8).unsqueeze(1)) & 1) << 4)
            return q
        c = self.codes[rows]
        if self.fmt not in NIBBLES:
            return c
        g = c.reshape(c.shape[0], -1, 16)
        q = torch.cat((g & 0x0F, g >> 4), dim=-1)                               # (n, groups, 32)
        if self.fmt == Q5:
            h = self.high[rows].reshape(c.shape[0], -1, 4)                      # (n, groups, 4)
            bits = (h.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1   # (n, groups, 4, 8)
            q = q | (bits.reshape(q.shape) << 4)
        return q.reshape(c.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """fp32 (len(rows), in): the exact weights (fma: computed in float64, then rounded once).
        Used for embedding lookups (a few rows) and dense fallbacks."""
        q = self.codes_of_rows(rows).double()
        n = q.shape[0]
        q = q.view(n, -1, GROUP[self.fmt])
        scale, bias = self.scale_bias(rows)
        w = q * scale.unsqueeze(-1) + bias.unsqueeze(-1)
        return w.float().reshape(n, -1)

    def permute_rows(self, order: torch.Tensor) -> "QWeight":
        """Rows reordered (output features): new row i is old row order[i]. Row layouts only (the
        loader permutes before to_lanes)."""
        if self.lanes:
            raise ValueError("permute_rows needs a row layout: permute before to_lanes")

        def take(t):
            return None if t is None else t[order].contiguous()
        bias = self.bias if self.mode == "f16s" else take(self.bias)   # one constant: not per row
        return QWeight(self.fmt, take(self.codes), take(self.scale), bias, take(self.high), take(self.sup))


def _block_lane(rows: torch.Tensor | slice, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a lanes layout -> (block, lane) index tensors."""
    r = torch.arange(n)[rows] if isinstance(rows, slice) else torch.as_tensor(rows).reshape(-1)
    return r // BLOCK_ROWS, r % BLOCK_ROWS


def to_lanes(q: QWeight) -> QWeight | None:
    """q in its lanes layout (kernels/qlanes.c; the same codes, scales and biases, so the same weights,
    with 16 rows interleaved; an output count not a multiple of 16 padded to whole blocks with zero weights,
    `out` the real count), or None where qlanes.c has no kernel for it (q8g16 in a mode other than Q6_K's
    "k6": no GGML type makes one). Already lanes: q itself. Pure: q is not changed and the result holds no
    view of it (the caller drops q: the same bytes once loading is done). Converted CHUNK_ROWS rows at a
    time into tensors allocated once (_chunked)."""
    if q.lanes:
        return q
    fmt = LANES.get((q.fmt, q.mode))
    if fmt is None:
        return None
    return _chunked(q.shape[0], lambda r0, r1: _lanes_of(_row_slice(q, r0, r1), fmt))


def to_int8(q: QWeight) -> QWeight:
    """A lanes layout -> its int layout (kernels/qint8.c's top comment: the codes' byte order and the high
    bits' packing; scales, biases, super-block scales and `out` are q's own tensors, shared). Already int:
    q itself. Pure: q is not changed. Converted INT_CHUNK_BLOCKS blocks at a time (bounded temporaries:
    qwen2.5's 151,936-row LM head unpacks to a byte a weight)."""
    if q.int8:
        return q
    fmt = INT_OF.get(q.fmt)
    if fmt is None:
        raise ValueError(f"no int layout for {q.fmt} (a lanes layout is needed: to_lanes first)")
    nb, k = q.scale.shape[0], q.shape[1]
    codes = torch.empty((nb, k // 4 if fmt == Q8I else k // 8, BLOCK_ROWS, 4), dtype=torch.uint8)
    high = {Q5I: torch.empty((nb, k // 32, BLOCK_ROWS, 4), dtype=torch.uint8),
            Q6I: torch.empty((nb, k // 16, BLOCK_ROWS, 4), dtype=torch.uint8)}.get(fmt)
    for b0 in range(0, nb, INT_CHUNK_BLOCKS):
        b1 = min(nb, b0 + INT_CHUNK_BLOCKS)
        c = _lanes_codes(q, b0, b1)                                             # (n, in, 16) 0..255
        n = b1 - b0
        if fmt == Q8I:
            codes[b0:b1] = c.view(n, k // 4, 4, BLOCK_ROWS).permute(0, 1, 3, 2)
            continue
        o = (c & 0x0F).view(n, k // 8, 2, 4, BLOCK_ROWS).permute(0, 1, 4, 3, 2)   # (n, octet, lane, i, half)
        codes[b0:b1] = o[..., 0] | (o[..., 1] << 4)
        if fmt == Q5I:          # byte i, bit s = 2 * octet + half of the group of 32
            h = ((c >> 4) & 1).view(n, k // 32, 8, 4, BLOCK_ROWS).permute(0, 1, 4, 3, 2)   # (n, g, lane, i, s)
            high[b0:b1] = (h << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        elif fmt == Q6I:        # byte i, bits 2s, 2s+1 = bits 4-5 of input 4s + i of the 16
            h = (c >> 4).view(n, k // 16, 4, 4, BLOCK_ROWS).permute(0, 1, 4, 3, 2)         # (n, h, lane, i, s)
            high[b0:b1] = (h << (2 * torch.arange(4, dtype=torch.uint8))).sum(-1, dtype=torch.uint8)
    return QWeight(fmt, codes, q.scale, q.bias, high, q.sup, q.out)


INT_CHUNK_BLOCKS = 256      # blocks of 16 rows to_int8 unpacks at a time


def _lanes_codes(q: QWeight, b0: int, b1: int) -> torch.Tensor:
    """Blocks [b0, b1) of a lanes layout's codes, one byte a weight: (b1 - b0, in, 16) uint8."""
    c = q.codes[b0:b1]
    if q.fmt in (Q8L, Q6L):
        return c
    t = torch.stack((c & 0x0F, c >> 4), dim=2).reshape(c.shape[0], -1, BLOCK_ROWS)       # inputs 2p, 2p+1
    if q.fmt == Q5L:
        bits = (q.high[b0:b1].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1   # (n, in, 2, 8)
        t = t | (bits.reshape(t.shape) << 4)
    return t


def _int_codes(q: QWeight, block: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """An int layout's codes of the rows (block, lane), (n, in) uint8 in input order: to_int8's inverse."""
    k = q.shape[1]
    c = q.codes[block, :, lane]                                                 # (n, in/8 or in/4, 4)
    n = c.shape[0]
    if q.fmt == Q8I:
        return c.reshape(n, k)
    codes = torch.stack((c & 0x0F, c >> 4), dim=2).reshape(n, k)                # octet: i, then 4 + i
    if q.fmt == Q5I:
        h = q.high[block, :, lane]                                              # (n, in/32, 4): byte i, bit s
        bits = (h.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1      # (n, g, i, s)
        codes = codes | (bits.permute(0, 1, 3, 2).reshape(n, k) << 4)           # s = 2 octet + half: input 4s + i
    elif q.fmt == Q6I:
        h = q.high[block, :, lane]                                              # (n, in/16, 4)
        f = (h.unsqueeze(-1) >> (2 * torch.arange(4, dtype=torch.uint8))) & 3   # (n, h, i, s)
        codes = codes | (f.permute(0, 1, 3, 2).reshape(n, k) << 4)
    return codes


def _row_slice(q: QWeight, r0: int, r1: int) -> QWeight:
    """Rows [r0, r1) of a row layout: views, no copy."""
    def rows(t):
        return None if t is None else t[r0:r1]
    return QWeight(q.fmt, rows(q.codes), rows(q.scale), q.bias if q.mode == "f16s" else rows(q.bias),
                   rows(q.high), rows(q.sup))


def _lanes_of(q: QWeight, fmt: str) -> QWeight:
    """A row layout -> lanes layout `fmt`: every field copied, 16 rows interleaved (rows past n in the last
    block: zero codes, scales, biases and super-block scales, so zero weights the kernel never writes out)."""
    n, k = q.shape
    nb = -(-n // BLOCK_ROWS)

    def interleave(t: torch.Tensor) -> torch.Tensor:        # (n, w...) -> (ceil(n/16), w..., 16)
        if n % BLOCK_ROWS:
            t = torch.cat((t, t.new_zeros((nb * BLOCK_ROWS - n, *t.shape[1:]))))
        t = t.reshape(nb, BLOCK_ROWS, *t.shape[1:])
        return t.permute(0, *range(2, t.dim()), 1).contiguous()

    t = interleave(q.codes_of_rows(slice(None)))                                              # (n/16, in, 16)
    high = None
    if fmt in (Q8L, Q6L):
        codes = t
    else:
        low = t & 0x0F
        codes = (low[:, 0::2] | (low[:, 1::2] << 4)).contiguous()                             # (n/16, in/2, 16)
        if fmt == Q5L:
            high = pack_bits((t >> 4) & 1)                                                     # (n/16, in, 2): lanes 0-7, 8-15
    bias = q.bias if q.bias is None or q.mode == "f16s" else interleave(q.bias)
    sup = None if q.sup is None else interleave(q.sup)   # "k": (n/16, in/256, 2, 16); "k6": (n/16, in/256, 16)
    return QWeight(fmt, codes, interleave(q.scale), bias, high, sup, n if n % BLOCK_ROWS else None)


CHUNK_ROWS = 4096   # rows converted at a time (a multiple of 16): bounds the conversions' temporaries


def _chunked(n: int, make) -> QWeight:
    """make(r0, r1) -> the QWeight of rows [r0, r1), for each CHUNK_ROWS rows of n, written into tensors
    allocated once for all n rows: no whole-matrix temporaries, no list of parts and cat copy (qwen2.5's
    151,936-row embedding and LM head: +1.5 GiB of peak RSS when converted whole). The parts must share
    one layout and scale mode ("f16s": one constant), so the result is the whole matrix's conversion bit
    for bit. One chunk: make's own result."""
    if n <= CHUNK_ROWS:
        return make(0, n)
    check(CHUNK_ROWS % BLOCK_ROWS == 0, f"CHUNK_ROWS {CHUNK_ROWS}: a lanes part is whole blocks of 16 rows")
    out: QWeight | None = None
    for r0 in range(0, n, CHUNK_ROWS):
        r1 = min(n, r0 + CHUNK_ROWS)
        part = make(r0, r1)
        per = BLOCK_ROWS if part.lanes else 1                # lanes: dim 0 counts blocks of 16 rows
        if out is None:
            out = QWeight(part.fmt, *(t if t is None or (f == "bias" and part.mode == "f16s")
                                      else torch.empty((-(-n // per), *t.shape[1:]), dtype=t.dtype)
                                      for f, t in _fields(part)), n if part.lanes and n % BLOCK_ROWS else None)
        check(part.fmt == out.fmt and part.mode == out.mode,
              f"chunked conversion: a part in {part.fmt}/{part.mode}, the matrix in {out.fmt}/{out.mode}")
        for (f, dst), (_, src) in zip(_fields(out), _fields(part)):
            if dst is not None and not (f == "bias" and out.mode == "f16s"):
                dst[r0 // per:-(-r1 // per)] = src          # (the last lanes part: its padded block too)
    return out


def _fields(q: QWeight) -> list[tuple[str, torch.Tensor | None]]:
    return [("codes", q.codes), ("scale", q.scale), ("bias", q.bias), ("high", q.high), ("sup", q.sup)]


# ---- GGML blocks -> layouts. Each takes (n_blocks, type_size) uint8 and returns
#      (codes (n_blocks, bytes), scale (n_blocks, groups), bias (n_blocks, groups)) of one block. -----

def _pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """(n, groups, 32) values 0..15 -> (n, groups * 16) bytes: byte j = v[j] | v[j + 16] << 4."""
    return (v[..., :16] | (v[..., 16:] << 4)).reshape(v.shape[0], -1)


def _pack_q5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) values 0..31, k a multiple of 32 -> (nibbles (n, k/2), high (n, k/8)): bit j of a
    group's 4 high bytes (little-endian) is element j's bit 4."""
    g = q.reshape(q.shape[0], -1, 32)
    high = pack_bits((q >> 4) & 1)                                               # (n, k/8)
    return _pack_nibbles(g & 0x0F), high


def _q4_0(b):
    d = _f16(b, 0)
    return b[:, 2:].clone(), d, d * -8.0


def _q4_1(b):
    return b[:, 4:].clone(), _f16(b, 0), _f16(b, 2)


def _q4_k(b):
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = _f16(b, 0) * sc.float()                  # (n, 8): exact products
    bias = -(_f16(b, 2) * mn.float())
    return _pack_nibbles(_k_low_nibbles(b[:, 16:])), scale, bias


def _q8_0(b):
    d = _f16(b, 0)
    return b[:, 2:] ^ 0x80, d, d * -128.0           # int8 q + 128 as a byte: q's byte with the top bit flipped


# The 5-bit converters return each element's full code 0..31 (n, 32 or 256): from_gguf packs them.
def _q5_0(b):
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    d = _f16(b, 0)
    return q, d, d * -16.0


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return q, _f16(b, 0), _f16(b, 2)


def _q5_k(b):
    sc, mn = _k_scales_mins(b[:, 4:16])
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    q = (_k_low_nibbles(b[:, 48:]) | (high << 4)).reshape(b.shape[0], -1)     # (n, 256)
    return q, _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float())              # scale/bias (n, 8)


def _q6_k(b):
    ql = b[:, :128].reshape(-1, 2, 64)
    low = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    high = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(-1, 8, 32)
    q = (low | (high << 4)).reshape(b.shape[0], -1)                             # (n, 256) 0..63
    scale = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()               # (n, 16)
    return q, scale, scale * -32.0


# qtype -> (layout, block elements, bytes per block, converter)
_CONVERT = {
    QT.Q4_0: (Q4, 32, 18, _q4_0), QT.Q4_1: (Q4, 32, 20, _q4_1), QT.Q4_K: (Q4, 256, 144, _q4_k),
    QT.Q8_0: (Q8W, 32, 34, _q8_0), QT.Q5_0: (Q5, 32, 22, _q5_0), QT.Q5_1: (Q5, 32, 24, _q5_1),
    QT.Q5_K: (Q5, 256, 176, _q5_k), QT.Q6_K: (Q8, 256, 210, _q6_k),
}
QUANTIZED_TYPES = frozenset(_CONVERT)


def _k_sub(b):
    """Q4_K / Q5_K: GGML's own sub-block scales: sc, m (n, 8) uint8 and sup (n, 2) fp16 d, dmin."""
    sc, mn = _k_scales_mins(b[:, 4:16])
    return sc, mn, b[:, 0:4].contiguous().view(torch.float16)


def _k6_sub(b):
    """Q6_K: sc (n, 16) int8, no bias array, sup (n, 1) fp16 d."""
    return b[:, 192:208].contiguous().view(torch.int8), None, b[:, 208:210].contiguous().view(torch.float16)


# the K-quants keep GGML's sub-scales (modes "k", "k6") instead of fp32 products
_SUB_SCALES = {QT.Q4_K: _k_sub, QT.Q5_K: _k_sub, QT.Q6_K: _k6_sub}
# the types whose offset GGML derives from d: offset = constant * d (mode "f16s")
_DERIVED_OFFSET = {QT.Q4_0: -8.0, QT.Q5_0: -16.0, QT.Q8_0: -128.0}


def _fp16_exact(t: torch.Tensor) -> bool:
    """Whether every value of t (fp32) is exactly an fp16 (GGML's own fp16 fields)."""
    h = t.half()
    return torch.equal(h.float(), t) and bool(torch.isfinite(h).all())


def _scale_bias(b: torch.Tensor, qtype: QT) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_blocks, type_size) blocks of a type with one scale a block (not the K-quants) -> fp32 (n_blocks, 1)
    scale and bias, as its converter computes them, from the fp16 fields alone."""
    d, c = _f16(b, 0), _DERIVED_OFFSET.get(qtype)
    return (d, d * c) if c is not None else (d, _f16(b, 2))


def _scale_mode(rows: torch.Tensor, qtype: QT) -> str:
    """The whole matrix's scale mode (the module docstring's; `rows`: (out, bytes a row) GGML blocks): the
    K-quants' own, else decided on every block's scale and bias, read CHUNK_ROWS rows at a time. Decided
    before any chunk is converted, so that every chunk is converted alike."""
    if qtype in _SUB_SCALES:
        return "k6" if qtype == QT.Q6_K else "k"
    size, c = _CONVERT[qtype][2], _DERIVED_OFFSET.get(qtype)
    exact_s = exact_b = derived = True
    for r0 in range(0, rows.shape[0], CHUNK_ROWS):
        scale, bias = _scale_bias(rows[r0:r0 + CHUNK_ROWS].reshape(-1, size), qtype)
        exact_s = exact_s and _fp16_exact(scale)
        exact_b = exact_b and _fp16_exact(bias)
        derived = derived and c is not None and torch.equal(scale * c, bias)
    if exact_s and derived:
        return "f16s"
    return "f16" if exact_s and exact_b else "f32"     # one dtype for both: one kernel variant reads them


def _convert_rows(rows: torch.Tensor, qtype: QT, in_features: int, mode: str) -> QWeight:
    """(n, bytes a row) GGML blocks -> the row layout of those n rows, in scale mode `mode` (_scale_mode's)."""
    fmt, block, size, fn = _CONVERT[qtype]
    n = rows.shape[0]
    b = rows.reshape(-1, size)
    codes, scale, bias = fn(b)
    high = None
    if fmt == Q5:
        codes, high = _pack_q5(codes.reshape(n, -1))
        high = high.contiguous()
    codes = codes.reshape(n, -1).contiguous()
    if qtype in _SUB_SCALES:
        sc, mn, sup = _SUB_SCALES[qtype](b)
        sup = sup.reshape(n, in_features // block, -1).squeeze(-1).contiguous()
        return QWeight(fmt, codes, sc.reshape(n, -1).contiguous(),
                       None if mn is None else mn.reshape(n, -1).contiguous(), high, sup)
    scale = scale.float().reshape(n, -1).contiguous()
    bias = bias.float().reshape(n, -1).contiguous()
    if mode == "f16s":
        return QWeight(fmt, codes, scale.half(), torch.tensor([_DERIVED_OFFSET[qtype]], dtype=torch.float32), high)
    if mode == "f16":
        return QWeight(fmt, codes, scale.half(), bias.half(), high)
    return QWeight(fmt, codes, scale, bias, high)


def from_gguf(raw: torch.Tensor, qtype: QT, out_features: int, in_features: int, lanes: bool = False) -> QWeight:
    """Raw GGML bytes (flat uint8) of an (out, in) weight -> QWeight in its row layout; with ``lanes``, in
    its lanes layout where it has one (the bits of ``to_lanes(q) or q``), straight from the blocks.
    Converted CHUNK_ROWS rows at a time into tensors allocated once (_chunked), the scale mode decided on
    the whole matrix first: the same bits as converting it whole. Raises KeyError for a type with no exact layout (float types stay dense: the caller checks
    QUANTIZED_TYPES first)."""
    fmt, block = _CONVERT[qtype][:2]
    if in_features % block:
        raise ValueError(f"input size {in_features} is not a multiple of the {qtype.name} block {block}")
    rows = raw.view(out_features, -1)                    # (out, bytes a row): blocks run along the input
    mode = _scale_mode(rows, qtype)
    lanes_fmt = LANES.get((fmt, mode)) if lanes else None

    def make(r0: int, r1: int) -> QWeight:
        q = _convert_rows(rows[r0:r1], qtype, in_features, mode)
        return _lanes_of(q, lanes_fmt) if lanes_fmt else q
    return _chunked(out_features, make)
