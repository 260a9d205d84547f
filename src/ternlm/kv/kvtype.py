"""The KV cache's formats (`--kv-dtype`): what a cache row holds, how wide it is, what it costs a token.

A row is one token's head_dim values of one kv head. Every tier (slot, RAM, disk, Redis) keeps rows as the
slot holds them, so a format is a storage dtype plus a row width in that dtype:
  float32  head_dim floats (the torch layers' cache)
  float16  head_dim fp16, nearest even (where attention runs in C)
  q8_0     head_dim int8 codes, then head_dim / 32 fp16 scales, as uint8: head_dim + head_dim / 16 bytes,
           0.53x fp16's (GGML's Q8_0 numbers; kernels/attention.c tq_kv_q8_row writes them, vec.h KV_Q8 reads).
           Key rows are stored rotated, each block of 32 times a Hadamard matrix, and queries rotated to match
           (attention.c [KV-ROTATE]): an outlier dimension no longer sets the step of its whole block
`mode` is the kernels' code for the format (vec.h KV_F32 / KV_F16 / KV_Q8). A row's bytes depend on that row
alone in every format, which is what makes cached == cold and batched == alone hold (ARCHITECTURE.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVType:
    name: str             # what --kv-dtype, the namespace, block headers and /metrics call it
    storage: torch.dtype  # the cache tensors' dtype
    mode: int             # kernels/vec.h's KV_* code
    needs_kernels: bool   # written and read by the C kernels only (no torch attention reads it)

    def width(self, head_dim: int) -> int:
        """Storage elements of one row: the cache's last dimension."""
        return head_dim + head_dim // 16 if self.name == "q8_0" else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.width(head_dim) * torch.empty(0, dtype=self.storage).element_size()

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int) -> int:
        """K and V of one token over the attention layers."""
        return layers * kv_heads * 2 * self.row_bytes(head_dim)

    def fits(self, head_dim: int) -> str | None:
        """None, or why this format cannot hold rows of head_dim values."""
        if self.name == "q8_0" and head_dim % 32:
            return f"--kv-dtype q8_0 needs a head_dim that is a multiple of 32 (this model's is {head_dim})"
        return None


KV_TYPES = {
    "float32": KVType("float32", torch.float32, 0, False),
    "float16": KVType("float16", torch.float16, 1, True),
    "q8_0": KVType("q8_0", torch.uint8, 2, True),
}
KV_CHOICES = ("auto", *KV_TYPES)     # --kv-dtype's choices; auto: Transformer._choose_kv_type


def kv_type(name: str) -> KVType:
    """The format called `name`; ValueError naming the choices for any other."""
    if name not in KV_TYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose {', '.join(KV_CHOICES)}")
    return KV_TYPES[name]


def hadamard32(x: torch.Tensor) -> torch.Tensor:
    """(..., 32 k) -> each block of 32 times the 32 x 32 Hadamard matrix (+-1 entries), attention.c's butterflies
    in their order (fp32 additions: the same bits) [KV-ROTATE]. A new tensor."""
    b = x.float().reshape(*x.shape[:-1], -1, 32).clone()
    h = 1
    while h < 32:
        v = b.view(*b.shape[:-1], 32 // (2 * h), 2, h)
        a, c = v[..., 0, :].clone(), v[..., 1, :].clone()
        v[..., 0, :], v[..., 1, :] = a + c, a - c
        h *= 2
    return b.reshape(x.shape)


def q8_0_reference(x: torch.Tensor, keys: bool) -> torch.Tensor:
    """(..., D) float -> (..., D + D/16) uint8, tq_kv_q8_row's rule in torch (the tests' second rendering):
    keys rotated first [KV-ROTATE]."""
    D = x.shape[-1]
    blocks = (hadamard32(x) if keys else x.float()).reshape(*x.shape[:-1], D // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127.0).clamp(max=65504.0).half()
    df = d.float()
    codes = torch.where(df > 0, torch.round(blocks / torch.where(df > 0, df, 1.0)), 0.0).clamp(-127, 127)
    codes = codes.nan_to_num(0.0).to(torch.int8).reshape(*x.shape[:-1], D)
    return torch.cat([codes.view(torch.uint8), d.reshape(*x.shape[:-1], D // 32).view(torch.uint8)], -1)


def q8_0_values(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(..., D + D/16) uint8 q8_0 rows -> (..., D) fp32: the values attention reads (code x scale, exact; a key
    row's in the rotated basis [KV-ROTATE])."""
    codes = rows[..., :head_dim].contiguous().view(torch.int8).float()
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return codes * scales.repeat_interleave(32, -1)
