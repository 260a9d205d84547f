"""Rotary position embeddings as data: one frozen `Rope` per model, turned into cos/sin tables once.

Every RoPE variant the supported families use changes only the inverse frequencies (and a scale on
cos/sin), never the rotation itself, so the kernels stay one rotate-half `x*cos + [-x2, x1]*sin` over
precomputed (positions, head_dim) tables (llama.py's apply_rope, kernels/layer.c's rope_row):

  default   inv_freq[i] = theta^(-2i/d)
  factors   inv_freq[i] /= freq_factors[i]: Llama 3.1/3.2 GGUFs (`rope_freqs.weight`, the converter's
            precomputed llama3 rule) and Phi-3's longrope (short or long factors, chosen per context)
  linear    inv_freq /= factor (position interpolation)
  llama3    Hugging Face's llama3 rule from its parameters (config.json; GGUFs carry it as factors)
  yarn      per-frequency blend of interpolation and extrapolation (ramp between beta_fast/slow
            rotations), cos/sin scaled by the attention factor
  longrope  factors as above plus the attention factor sqrt(1 + ln(s)/ln(original context))

Partial rotary (Phi-4-mini rotates 96 of 128 dims): Hugging Face rotates pairs (i, i + r/2) of the
first r dims; the kernels rotate pairs (i, i + d/2) of all d. `rotary_row_order` reorders each head's
q/k projection rows so the r rotated dims sit at [0, r/2) and [d/2, d/2 + r/2); the pass-through
dims get inv_freq 0 (cos 1, sin 0: exact identity). q·k is a sum over the same products in another
order, so scores equal Hugging Face's to fp32 rounding; V and the output are untouched.

Formulas follow transformers' modeling_rope_utils (the parity tests' oracle), written here from
their definitions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

ROPE_KINDS = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class Rope:
    theta: float = 10000.0
    kind: str = "default"                      # one of ROPE_KINDS
    factor: float = 1.0                        # linear / llama3 / yarn / longrope scale
    original_context: int = 0                  # pretraining context (llama3, yarn, longrope)
    low_freq_factor: float = 1.0               # llama3
    high_freq_factor: float = 4.0              # llama3
    beta_fast: float = 32.0                    # yarn
    beta_slow: float = 1.0                     # yarn
    attention_factor: float | None = None      # scale on cos/sin; None: the kind's default
    freq_factors: tuple[float, ...] | None = None    # per-frequency divisors (r/2 of them)
    long_factors: tuple[float, ...] | None = None    # longrope: used when the context exceeds original
    rotary_dim: int = 0                        # dims rotated per head; 0: all of head_dim

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope kind {self.kind!r} is not one of {', '.join(ROPE_KINDS)}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta {self.theta} and factor {self.factor} must be positive")
        if self.kind in ("llama3", "yarn", "longrope") and self.original_context <= 0:
            raise ValueError(f"rope {self.kind} needs the original context length")
        if self.rotary_dim % 2 or self.rotary_dim < 0:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and non-negative")

    def for_context(self, ctx: int) -> "Rope":
        """The rope a `ctx`-token context runs with: longrope picks its long factors when ctx exceeds
        the original context, else the short ones (fixed per engine, as llama.cpp does, so a position's
        K never depends on how long the prompt turned out; Hugging Face switches per call). Pure."""
        if self.long_factors is None:
            return self
        chosen = self.long_factors if ctx > self.original_context else self.freq_factors
        return replace(self, freq_factors=chosen, long_factors=None)

    def scale(self) -> float:
        """The factor on cos/sin (yarn's mscale, longrope's attention factor; 1 elsewhere)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "yarn":
            return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0
        if self.kind == "longrope":
            return 1.0 if self.factor <= 1 else math.sqrt(1 + math.log(self.factor) / math.log(self.original_context))
        return 1.0

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """(r/2,) fp32 inverse frequencies of the rotated dims, r = rotary_dim or head_dim."""
        r = self.rotary_dim or head_dim
        exponents = torch.arange(0, r, 2, dtype=torch.int64).float() / r
        base = self.theta ** exponents                                   # (r/2,)
        if self.freq_factors is not None:
            ff = torch.tensor(self.freq_factors, dtype=torch.float32)
            if ff.numel() != r // 2:
                raise ValueError(f"{ff.numel()} rope frequency factors for {r // 2} frequencies")
            inv = 1.0 / (ff * base)
        else:
            inv = 1.0 / base
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3" and self.freq_factors is None:
            inv = _llama3(inv, self)
        elif self.kind == "yarn":
            inv = _yarn(base, r, self)
        return inv

    def tables(self, head_dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: (positions, head_dim) fp32 in the rotate-half layout of `rotary_row_order`'s
        rows: rotated pairs (i, i + d/2) for i < r/2, identity (cos 1, sin 0) for the rest."""
        r = self.rotary_dim or head_dim
        if r > head_dim:
            raise ValueError(f"rotary_dim {r} exceeds head_dim {head_dim}")
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), self.inv_freq(head_dim))  # (P, r/2)
        s = self.scale()
        cos_r, sin_r = freqs.cos() * s if s != 1.0 else freqs.cos(), freqs.sin() * s if s != 1.0 else freqs.sin()
        pad = (head_dim - r) // 2
        if pad:
            cos_r = torch.cat((cos_r, torch.ones(positions, pad)), dim=1)
            sin_r = torch.cat((sin_r, torch.zeros(positions, pad)), dim=1)
        return torch.cat((cos_r, cos_r), dim=1), torch.cat((sin_r, sin_r), dim=1)


def _llama3(inv: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Llama 3.1's rule: long wavelengths divided by factor, short kept, a smooth blend between."""
    old, lo, hi, factor = rope.original_context, rope.low_freq_factor, rope.high_freq_factor, rope.factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, blended, scaled)


def _yarn(base: torch.Tensor, r: int, rope: Rope) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), more than beta_fast extrapolated (kept), a linear ramp between."""
    def dim_of(rotations: float) -> float:
        return r * math.log(rope.original_context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
    low = max(math.floor(dim_of(rope.beta_fast)), 0)
    high = min(math.ceil(dim_of(rope.beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp                                     # 1: extrapolate (original frequency)
    ff = torch.tensor(rope.freq_factors, dtype=torch.float32) if rope.freq_factors is not None else 1.0
    extrapolated, interpolated = 1.0 / (ff * base), 1.0 / (ff * rope.factor * base)
    return interpolated * (1 - keep) + extrapolated * keep


def rotary_row_order(heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """(heads * head_dim,) int64: new row i of a q or k projection is old row order[i]. Identity for
    full rotary; for partial, each head's rows become [rot[:r/2], pass[:p/2], rot[r/2:], pass[p/2:]]
    (p = d - r), so the kernels' pairs (i, i + d/2) are Hugging Face's (i, i + r/2) and pass-through
    pairs. A per-head-dim vector (q/k norm weight) is reordered by order[:head_dim]."""
    d, r = head_dim, rotary_dim or head_dim
    if r == d:
        return torch.arange(heads * d)
    p = d - r
    one = torch.cat((torch.arange(0, r // 2), torch.arange(r, r + p // 2),
                     torch.arange(r // 2, r), torch.arange(r + p // 2, d)))
    return torch.cat([one + h * d for h in range(heads)])
