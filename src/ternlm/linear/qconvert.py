"""GGML blocks -> a lanes-layout QWeight in one native pass (kernels/convert.c): the bits of
qweight.to_lanes(qweight.from_gguf(raw, qtype, rows, cols)), every field, dtype and shape.

Why: a streamed expert is converted on every cache miss, and the Python/torch pair cost 31-39 ms of a
3 MB Qwen3 expert's ~57 ms miss (benchmarks/results/moe-capped); the resident load converts every
quantized matrix the same way. The Python path stays the reference and the fallback: `lanes_from_gguf`
returns None for anything convert.c does not cover (no native kernels, a type without a kernel, an
output count not a multiple of 16, a matrix whose fp16 scales are not all finite: qweight._scale_mode's
"f32" mode), and the caller converts in Python.
"""
from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType as QT

from ..kernels.build import Kernels, Unavailable, load
from .qweight import BLOCK_ROWS, GROUP, INT_OF, Q4L, Q5I, Q5L, Q6I, Q6L, Q8I, Q8L, QWeight

# qtype -> (lanes layout, scale mode, inputs a GGML block, bytes a block, the "f16s" constant or None)
NATIVE = {
    QT.Q4_0: (Q4L, "f16s", 32, 18, -8.0), QT.Q4_1: (Q4L, "f16", 32, 20, None),
    QT.Q5_0: (Q5L, "f16s", 32, 22, -16.0), QT.Q5_1: (Q5L, "f16", 32, 24, None),
    QT.Q8_0: (Q8L, "f16s", 32, 34, -128.0),
    QT.Q4_K: (Q4L, "k", 256, 144, None), QT.Q5_K: (Q5L, "k", 256, 176, None), QT.Q6_K: (Q6L, "k6", 256, 210, None),
}


# Below this many source bytes one thread converts (tiny matrices: the parallel region's start costs more
# than it saves). An expert matrix (0.9-1.3 MB on Qwen3-30B-A3B) converts with torch's threads, as the
# products beside it run: on a quiet 2-core host the capped benchmark's 238-row turn-2 chunk took 1.69-1.73 s
# instead of 1.91-1.99 s with one thread (benchmarks/results/moe-capped3). On an oversubscribed host a
# 2-thread region can wait ~10 ms on a descheduled thread (moe-capped2 measured that at load 4.5-7, when this
# was 16 MiB); the products' regions then wait alike.
PARALLEL_BYTES = 512 << 10


def lanes_from_gguf(raw: torch.Tensor, qtype: QT, rows: int, cols: int, order: torch.Tensor | None = None,
                    kernels: Kernels | Unavailable | None = None, out: QWeight | None = None,
                    int8: bool = False) -> QWeight | None:
    """raw: flat uint8 GGML bytes of a (src_rows, cols) weight -> the lanes QWeight of its rows `order`
    (int64 source row indices, the output's rows in order; None: all src_rows as they are, rows ==
    src_rows), or None where convert.c does not cover it (see the module docstring; the caller falls back
    to qweight.from_gguf + to_lanes). The scale mode is decided on the whole of `raw`, as from_gguf decides
    it before any split. kernels: the loaded native kernels (default: kernels.build.load()).
    out: None (new tensors are returned: pure) or the QWeight to write into and return, its fields'
    shapes and dtypes exactly `lanes_empty(qtype, rows, cols)`'s (else ValueError; a streamed expert's
    reused buffers, moe.StreamedExperts [RING]). Side effect with out: its fields are overwritten (not
    when None is returned: that is decided before anything is written).
    int8: the int layout instead (qweight.to_int8 of the lanes result, bit for bit, in the same one pass:
    what a streamed expert with int8 activations is read into)."""
    spec = NATIVE.get(qtype)
    if spec is None:
        return None
    _, mode, block, size, _ = spec
    if kernels is None:
        kernels = load()
    if isinstance(kernels, Unavailable) or rows <= 0 or rows % BLOCK_ROWS or cols <= 0 or cols % block:
        return None
    if out is not None:
        _checked(out, qtype, rows, cols, int8)   # before anything else: a misfit is the caller's bug
    raw = raw.reshape(-1)
    if raw.dtype != torch.uint8 or not raw.is_contiguous() or raw.numel() % (cols // block * size):
        return None
    src_rows = raw.numel() // (cols // block * size)
    if order is None and src_rows != rows:
        return None
    if order is not None:
        order = order.to(torch.int64).contiguous()
        if order.numel() != rows:
            return None
    if kernels.convert_finite(int(qtype), raw.data_ptr(), raw.numel() // size) != 1:
        return None                              # some fp16 d or m is inf/nan: the Python path's "f32" mode
    w = lanes_empty(qtype, rows, cols, int8) if out is None else out
    rc = (kernels.convert_int if int8 else kernels.convert_lanes)(int(qtype), raw.data_ptr(), src_rows, 0 if order is None else order.data_ptr(),
                               rows, cols, w.codes.data_ptr(), _ptr(w.high), w.scale.data_ptr(),
                               _ptr(None if mode == "f16s" else w.bias), _ptr(w.sup),
                               torch.get_num_threads() if raw.numel() >= PARALLEL_BYTES else 1)
    if rc != 0:
        raise ValueError(f"native conversion of a {rows}x{cols} {qtype.name} weight failed ({rc}): "
                         "shapes were checked, so this is a bug")
    return w


def lanes_empty(qtype: QT, rows: int, cols: int, int8: bool = False) -> QWeight | None:
    """The lanes QWeight that lanes_from_gguf makes of a (rows, cols) `qtype` weight, allocated and not
    filled (the "f16s" types' one-element bias holds its constant), or None where convert.c has no
    conversion for the type or the shape; int8: the int layout's (codes and high bits shaped as
    qweight.to_int8 makes them; scale, bias, sup as the lanes layout's). Pure."""
    spec = NATIVE.get(qtype)
    if spec is None:
        return None
    fmt, mode, block, _, const = spec
    if rows <= 0 or rows % BLOCK_ROWS or cols <= 0 or cols % block:
        return None
    nb, groups = rows // BLOCK_ROWS, cols // GROUP[fmt]
    codes = torch.empty((nb, cols // 2 if fmt in (Q4L, Q5L) else cols, BLOCK_ROWS), dtype=torch.uint8)
    high = torch.empty((nb, cols, 2), dtype=torch.uint8) if fmt == Q5L else None
    sup = bias = None
    if mode == "k":                               # GGML's uint8 sub-scales and mins; fp16 (d, dmin) per 256
        scale = torch.empty((nb, groups, BLOCK_ROWS), dtype=torch.uint8)
        bias = torch.empty((nb, groups, BLOCK_ROWS), dtype=torch.uint8)
        sup = torch.empty((nb, cols // 256, 2, BLOCK_ROWS), dtype=torch.float16)
    elif mode == "k6":                            # int8 sub-scales; fp16 d per 256; no bias
        scale = torch.empty((nb, groups, BLOCK_ROWS), dtype=torch.int8)
        sup = torch.empty((nb, cols // 256, BLOCK_ROWS), dtype=torch.float16)
    else:                                         # GGML's fp16 d (and m for "f16")
        scale = torch.empty((nb, groups, BLOCK_ROWS), dtype=torch.float16)
        if mode == "f16":
            bias = torch.empty((nb, groups, BLOCK_ROWS), dtype=torch.float16)
        else:                                     # "f16s": the type's constant, one fp32 element
            bias = torch.tensor([const], dtype=torch.float32)
    if int8:                                      # qweight.to_int8's codes and high bits (qint8.c's layouts)
        fmt = INT_OF[fmt]
        codes = torch.empty((nb, cols // 4 if fmt == Q8I else cols // 8, BLOCK_ROWS, 4), dtype=torch.uint8)
        high = {Q5I: torch.empty((nb, cols // 32, BLOCK_ROWS, 4), dtype=torch.uint8),
                Q6I: torch.empty((nb, cols // 16, BLOCK_ROWS, 4), dtype=torch.uint8)}.get(fmt)
    return QWeight(fmt, codes, scale, bias, high, sup)


_FIELDS = ("codes", "scale", "bias", "high", "sup")


@functools.lru_cache(maxsize=256)
def _want(qtype: QT, rows: int, cols: int, int8: bool) -> tuple:
    """(fmt, mode, each _FIELDS' (shape, dtype) or None, the "f16s" bias) of lanes_empty's weight: what `_checked`
    compares with, computed once a signature (a streamed expert's miss checks three slabs: building an empty
    weight each time was ~0.1 ms of Python a slab, 0.6 s of an 11.6 s turn on the capped 30B benchmark). Pure."""
    w = lanes_empty(qtype, rows, cols, int8)
    fields = tuple(None if getattr(w, n) is None else (tuple(getattr(w, n).shape), getattr(w, n).dtype)
                   for n in _FIELDS)
    return w.fmt, w.mode, fields, w.bias.clone() if w.mode == "f16s" else None


def _checked(out: QWeight, qtype: QT, rows: int, cols: int, int8: bool = False) -> QWeight:
    """out, when every field has the shape and dtype (and contiguity) lanes_empty gives; else ValueError."""
    fmt, mode, fields, const = _want(qtype, rows, cols, int8)
    bad = [] if isinstance(out, QWeight) and out.fmt == fmt else ["fmt"]
    for name, want in zip(_FIELDS, fields) if not bad else ():
        a = getattr(out, name)
        if (a is None) != (want is None) or (a is not None and (tuple(a.shape) != want[0] or a.dtype != want[1]
                                                                 or not a.is_contiguous())):
            bad.append(name)
    if not bad and mode == "f16s" and not torch.equal(out.bias, const):
        bad.append("bias (the type's constant)")
    if bad:
        raise ValueError(f"out= does not fit a {rows}x{cols} {qtype.name} lanes weight: {', '.join(bad)} "
                         f"(expected the fields of lanes_empty)")
    return out


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
