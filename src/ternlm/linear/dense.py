"""y = x W^T (+ b) with the weight pre-packed for oneDNN when that is available.

Why: on CPU, PyTorch's plain bf16 matmul re-lays-out the weight on every call; for a decode step
(one row of activations) that costs as much as the product itself. A weight reordered once at load
(`mkldnn._reorder_linear_weight`) runs measured ~1.5-2x faster at M=1 and the same at large M, with
bit-identical bf16 results (tests/test_model.py checks). Falls back to F.linear elsewhere
(CUDA, float16, builds without oneDNN).

[BATCH-INVARIANT] Reuse must not change an answer, so a row's result must not depend on how many rows
were computed with it. The packed kernels give bit-identical rows for any M >= 2, but a single row
takes another path: always in fp32, and in bf16 too on CPUs without AMX (AVX-512 EPYC: 4 of 64 rows
of a 1536 -> 576 projection differed; on an AMX Xeon they did not). So a single row is computed as
two, whatever the dtype. (The F.linear fallback is not batch-invariant: reuse is then exact only to
~1e-6.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _can_pack(w: torch.Tensor) -> bool:
    """oneDNN can hold this weight packed. bf16 also needs oneDNN's bf16 ISA (AVX-512 BW/VL/DQ,
    AVX-NE-CONVERT, AMX): on an AVX2-only CPU the reorder raises instead (cpu.py picks fp32 there)."""
    if not (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return w.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """Not an nn.Module: a frozen inference-only projection. weight: (out, in); bias: (out,)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack and _can_pack(weight)
        # batch-size hint 1: tuned for the decode step; measured no slower for prefill-sized M
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in) -> (T, out)."""
        if self.packed:
            if x.shape[0] == 1:
                x2 = x.expand(2, -1)       # [BATCH-INVARIANT] the one-row path sums differently
                return torch.ops.mkldnn._linear_pointwise(x2, self.weight, self.bias, "none", [], "")[:1]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
