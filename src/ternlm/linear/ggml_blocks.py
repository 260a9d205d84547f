"""GGML block fields as torch tensors: the bit-level pieces both the dequantizers (gguf.py) and the
kernels' layouts (qweight.py) read. Pure functions of their inputs; apart so neither module imports the
other's internals (no import cycle)."""
from __future__ import annotations

import numpy as np
import torch


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``start`` of each block, as float32 (n_blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., k) bytes -> (..., 2k): low nibbles first, then high nibbles (the GGML layout)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 8k) uint8 0/1 where element i is bit (i % 8) of byte i // 8 (numpy's
    unpackbits, flat: one C pass, where shifting every byte eight ways took ~1.3 s of qwen2.5's load)."""
    flat = np.unpackbits(qh.contiguous().numpy().reshape(-1), bitorder="little")
    return torch.from_numpy(flat).reshape(qh.shape[0], -1)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 8m) uint8 0/1 -> (..., m) bytes, bit j of byte i = bits[..., 8i + j]: _bits' inverse.
    Packed flat (numpy's fast path; along a short last axis it was ~10x slower), which gives the same
    bytes because each row's length is a multiple of 8."""
    if bits.shape[-1] % 8:
        raise ValueError(f"pack_bits: a last axis of {bits.shape[-1]} is not whole bytes")
    flat = np.packbits(bits.contiguous().numpy().reshape(-1), bitorder="little")
    return torch.from_numpy(flat).reshape(*bits.shape[:-1], bits.shape[-1] // 8)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins, each (n, 8) uint8.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 likewise for
    mins; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mins = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: 128 bytes -> (n, 8, 32); each 32-byte run gives sub-block 2j (low) and 2j+1 (high)."""
    qs = qs.reshape(-1, 4, 32)
    return torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)
