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

import torch
from gguf import GGMLQuantizationType as QT

from ..kernels.build import Kernels, Unavailable, load
from .qweight import BLOCK_ROWS, GROUP, Q4L, Q5L, Q6L, Q8L, QWeight

# qtype -> (lanes layout, scale mode, inputs a GGML block, bytes a block, the "f16s" constant or None)
NATIVE = {
    QT.Q4_0: (Q4L, "f16s", 32, 18, -8.0), QT.Q4_1: (Q4L, "f16", 32, 20, None),
    QT.Q5_0: (Q5L, "f16s", 32, 22, -16.0), QT.Q5_1: (Q5L, "f16", 32, 24, None),
    QT.Q8_0: (Q8L, "f16s", 32, 34, -128.0),
    QT.Q4_K: (Q4L, "k", 256, 144, None), QT.Q5_K: (Q5L, "k", 256, 176, None), QT.Q6_K: (Q6L, "k6", 256, 210, None),
}


# Below this many source bytes one thread converts: an expert (~1 MB a matrix) takes ~0.3 ms alone, and on
# a busy 2-core host a 2-thread parallel region waited on a descheduled thread for ~10 ms (miss_cost.py,
# benchmarks/results/moe-capped2). Large matrices (embeddings, LM heads at load) use torch's threads.
PARALLEL_BYTES = 16 << 20


def lanes_from_gguf(raw: torch.Tensor, qtype: QT, rows: int, cols: int, order: torch.Tensor | None = None,
                    kernels: Kernels | Unavailable | None = None) -> QWeight | None:
    """raw: flat uint8 GGML bytes of a (src_rows, cols) weight -> the lanes QWeight of its rows `order`
    (int64 source row indices, the output's rows in order; None: all src_rows as they are, rows ==
    src_rows), or None where convert.c does not cover it (see the module docstring; the caller falls back
    to qweight.from_gguf + to_lanes). The scale mode is decided on the whole of `raw`, as from_gguf decides
    it before any split. Pure: raw is read, new tensors are returned. kernels: the loaded native kernels
    (default: kernels.build.load())."""
    spec = NATIVE.get(qtype)
    if spec is None:
        return None
    fmt, mode, block, size, const = spec
    if kernels is None:
        kernels = load()
    if isinstance(kernels, Unavailable) or rows <= 0 or rows % BLOCK_ROWS or cols <= 0 or cols % block:
        return None
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
    rc = kernels.convert_lanes(int(qtype), raw.data_ptr(), src_rows, 0 if order is None else order.data_ptr(),
                               rows, cols, codes.data_ptr(), _ptr(high), scale.data_ptr(), _ptr(bias), _ptr(sup),
                               torch.get_num_threads() if raw.numel() >= PARALLEL_BYTES else 1)
    if rc != 0:
        raise ValueError(f"native conversion of a {rows}x{cols} {qtype.name} weight failed ({rc}): "
                         "shapes were checked, so this is a bug")
    if mode == "f16s":
        bias = torch.tensor([const], dtype=torch.float32)
    return QWeight(fmt, codes, scale, bias, high, sup)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
