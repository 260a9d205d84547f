"""y = x W^T (+ b) with W kept quantized (qweight.py), multiplied by the native kernel (kernels/).

Activations and results are fp32; the weights are exactly GGML's dequantized values, so the output
equals a dense fp32 matmul of the dequantized weights up to summation order.

[BATCH-INVARIANT] by construction (kernels/qlanes.c): a row's bits never depend on how many rows
are multiplied with it or on the thread count, so no single-row trick is needed here.
"""
from __future__ import annotations

import ctypes

import torch

from ..kernels.build import LAYOUT_CODE, MODE_CODE, Kernels, Part
from .qweight import QWeight, to_lanes


class QLinear:
    """Not an nn.Module: a frozen projection whose weight is one or more QWeights stacked along the
    outputs (a fused q/k/v may mix layouts: Q4_K_M files keep some v projections in Q6_K).
    parts: [(out_i, in)]; bias: fp32 (sum out_i,) or None. Where the kernels take lanes layouts
    (kernels.lanes), each part is held in its lanes layout (qweight.to_lanes; self.parts are those).
    Raises ValueError for a part with no kernel (a layout and scale mode no GGML type makes)."""

    def __init__(self, parts: list[QWeight], bias: torch.Tensor | None, kernels: Kernels):
        if kernels.lanes:
            lanes = [to_lanes(p) for p in parts]
            for p, q in zip(parts, lanes):
                if q is None:
                    raise ValueError(f"no kernel for layout {p.fmt} with {p.mode} scales (no GGML type makes it)")
            parts = lanes
        ins = {p.shape[1] for p in parts}
        if len(ins) != 1:
            raise ValueError(f"parts disagree on the input size: {sorted(ins)}")
        self.parts, self.kernels = parts, kernels
        self.in_features = ins.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        self.bias = None if bias is None else bias.float().contiguous()
        # several int-layout parts: one qint8.c call (x quantized once, one parallel region), same bits
        self._fused = _int8_parts(parts) if len(parts) > 1 and all(p.int8 for p in parts) else None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, in) fp32 -> (M, out) fp32."""
        x = x.float().contiguous()
        M, K = x.shape
        if K != self.in_features:
            raise ValueError(f"input has {K} features, the weight {self.in_features}")
        y = torch.empty(M, self.out_features)
        threads = torch.get_num_threads()
        if self._fused is not None and self.kernels.lib.tq_int8_parts(
                x.data_ptr(), M, K, ctypes.addressof(self._fused), len(self.parts), y.data_ptr(), self.out_features,
                threads) == 0:
            return y if self.bias is None else y.add_(self.bias)
        off = 0
        for p in self.parts:   # each part writes its own column slice of y (row stride out_features)
            n = p.shape[0]
            self.kernels.mm(p.fmt, p.mode, x.data_ptr(), M, K, p.codes.data_ptr(), _ptr(p.high),
                            p.scale.data_ptr(), _ptr(p.bias), _ptr(p.sup), n, y.data_ptr() + 4 * off,
                            self.out_features, threads)
            off += n
        return y if self.bias is None else y.add_(self.bias)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _int8_parts(parts: list[QWeight]):
    """The parts as qint8.c's IPart array (kernels/build.Part); it points into the parts' tensors, which the
    QLinear keeps."""
    arr = (Part * len(parts))()
    for i, w in enumerate(parts):
        arr[i] = Part(LAYOUT_CODE[w.fmt], MODE_CODE[w.mode], w.shape[0], w.codes.data_ptr(), _ptr(w.high),
                      w.scale.data_ptr(), _ptr(w.bias), _ptr(w.sup))
    return arr


def projection(parts: list, bias: torch.Tensor | None, dtype: torch.dtype, pack: bool,
               kernels: Kernels | None):
    """The projection for weights stacked along the outputs: a QLinear when every part is a QWeight
    and the kernels are here, else a dense Linear (QWeights dequantized exactly, then cast to dtype).
    parts: [(out_i, in)] tensors (already in dtype) and/or QWeights."""
    from .dense import Linear
    if kernels is not None and all(isinstance(p, QWeight) for p in parts):
        return QLinear(parts, bias, kernels)
    dense = [p.dequantize().to(dtype) if isinstance(p, QWeight) else p for p in parts]
    return Linear(dense[0] if len(dense) == 1 else torch.cat(dense), bias, pack)
