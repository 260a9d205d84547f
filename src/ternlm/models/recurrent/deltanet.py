"""A gated DeltaNet layer's token mixer (Qwen3.5's "linear attention", issue 47), in place of attention.

    h (M, hidden) -> in_proj: q|k|v (conv_dim), z (Hv dv), b, a (Hv each)
    q|k|v -> short causal depthwise conv (kernel K, over each sequence's positions) -> SiLU -> q, k, v
    q, k L2-normalised (eps 1e-6), q * dk^-0.5; beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
    the gated delta rule over the sequence (kernels/recurrent.c, one token at a time [RESUME-EXACT])
    RMSNorm of each head's output (weight w, eps) * SiLU(z) -> out_proj
transformers' Qwen3_5GatedDeltaNet computes the same (its chunked scan in prefill: other roundings, so parity
is within fp32 rounding; our own paths agree bit for bit: cold, resumed, chunked, batched, decoded).
[ROW-EXACT] sigmoid, SiLU and softplus come from kernels/recurrent.c's tq_pointwise: torch's give an element
other bits at a buffer's (or a thread chunk's) tail, so a row's bits depended on the rows beside it.

Qwen3-Next (qwen3next) fuses q|k|v|z into in_proj_qkvz and b|a into in_proj_ba, interleaved per key head;
`fused_rows` gives the rows that make them this layer's in_proj_qkv / _z / _b / _a (a layout at load, the same
mixer; whole rows, so exact for quantized matrices too).

State (a slot's kv/recurrent.RecurrentState, this layer's index `ri` in it): the conv's last K - 1 inputs and
the delta rule's (Hv, dk, dv) state, both after the segment's `start`. Side effects of a call: each part's
state advanced to its end, and the snapshots its part asked for (`captures`) filled.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ...kernels.build import Kernels
from .conv_state import advance, conv_taps, conv_window, require_kernels


def fused_rows(cfg: ModelConfig, fused: str) -> dict[str, torch.Tensor]:
    """Row indices into a fused qwen3next projection -> the parts this mixer reads. fused: "in_proj_qkvz"
    (Hk blocks of [q dk | k dk | v r dv | z r dv], r = Hv / Hk: transformers' fix_query_key_value_ordering)
    -> {"in_proj_qkv": (2 Hk dk + Hv dv,), "in_proj_z": (Hv dv,)}; "in_proj_ba" (Hk blocks of [b r | a r])
    -> {"in_proj_b": (Hv,), "in_proj_a": (Hv,)}. Value heads come out grouped (head h reads key head h // r),
    transformers' order, so linear_v_tiled stays False."""
    Hk, Hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    r = Hv // Hk
    if fused == "in_proj_qkvz":
        blocks = torch.arange(Hk * (2 * dk + 2 * r * dv)).reshape(Hk, -1)            # (Hk, 2 dk + 2 r dv)
        q, k, v, z = torch.split(blocks, [dk, dk, r * dv, r * dv], dim=1)
        return {"in_proj_qkv": torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), "in_proj_z": z.reshape(-1)}
    if fused == "in_proj_ba":
        blocks = torch.arange(2 * Hv).reshape(Hk, 2 * r)                               # (Hk, 2 r)
        return {"in_proj_b": blocks[:, :r].reshape(-1), "in_proj_a": blocks[:, r:].reshape(-1)}
    raise ValueError(f"{fused!r} is not a fused DeltaNet projection")


class DeltaNet:
    """Frozen weights of one layer; `build` makes its projection (models/qlinear.projection)."""

    def __init__(self, cfg: ModelConfig, w: dict, build, ri: int, kernels: Kernels | None):
        self.cfg, self.ri, self.kernels = cfg, ri, require_kernels(kernels, "gated DeltaNet")
        Hk, Hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        self.key_dim, self.value_dim = Hk * dk, Hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # one projection for q|k|v, z, b, a: (conv_dim + Hv dv + 2 Hv, hidden)
        self.in_proj = build([w[f"linear_attn.in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")])
        self.out = build([w["linear_attn.out_proj.weight"]])                   # (hidden, Hv dv)
        K = cfg.linear_conv_kernel
        self.conv_w = conv_taps(w["linear_attn.conv1d.weight"], self.conv_dim, K)   # (K, C)
        self.neg_a = w["linear_attn.A"].float()                                 # (Hv,) -exp(A_log), as loaded
        self.dt_bias = w["linear_attn.dt_bias"].float()                         # (Hv,)
        self.norm = w["linear_attn.norm.weight"].float()                        # (dv,)

    def __call__(self, h: torch.Tensor, parts: list) -> torch.Tensor:
        """h: (M, hidden), the normed input of every part's rows; parts: llama._Part with `state` (a
        RecurrentState at the part's start) and `captures` ({position: (conv, ssm)} to fill, or None).
        -> (M, hidden) in h's dtype."""
        cfg = self.cfg
        Hv, dv = cfg.linear_value_heads, cfg.linear_value_dim
        proj = self.in_proj(h).float()                                           # (M, C + Hv dv + 2 Hv)
        C = self.conv_dim
        mixed, z, b, a = torch.split(proj, [C, self.value_dim, Hv, Hv], dim=1)
        pw = self.kernels.pointwise         # [ROW-EXACT] an element's bits never depend on its neighbours
        beta = pw("sigmoid", b)                                                  # (M, Hv)
        g = self.neg_a * pw("softplus", a + self.dt_bias)                        # (M, Hv), <= 0
        core = torch.empty(h.shape[0], Hv, dv)
        for p in parts:
            self._sequence(mixed[p.r0:p.r1], g[p.r0:p.r1], beta[p.r0:p.r1], p, core[p.r0:p.r1])
        # the gated RMSNorm, each head's dv outputs: x * rsqrt(mean(x^2) + eps) * w * silu(z)
        var = core.pow(2).mean(-1, keepdim=True)
        normed = self.norm * (core * torch.rsqrt(var + cfg.rms_norm_eps))
        gated = normed * pw("silu", z.reshape(-1, Hv, dv))
        return self.out(gated.reshape(-1, self.value_dim).to(h.dtype))

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, p, out: torch.Tensor) -> None:
        """One sequence's rows [start, start + T): conv, q/k norms, the scan (split at the captures).
        mixed (T, C); g, beta (T, Hv); out (T, Hv, dv) written. Side effects: p.state's conv and ssm of
        this layer advanced to start + T; p.captures[pos] filled at this layer's index."""
        cfg, st, ri = self.cfg, p.state, self.ri
        T = mixed.shape[0]
        Hk, Hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        window, conv = conv_window(st.conv[ri], mixed, self.conv_w)             # (T + K - 1, C), (T, C)
        x = self.kernels.pointwise("silu", conv)                                 # (T, C)
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=1)
        q = _l2norm(q.reshape(T, Hk, dk)) * (dk ** -0.5)
        k = _l2norm(k.reshape(T, Hk, dk))
        q, k, v = q.contiguous(), k.contiguous(), v.reshape(T, Hv, dv).contiguous()
        g, beta = g.contiguous(), beta.contiguous()
        ssm = st.ssm[ri]                                                         # (Hv, dk, dv), in place

        def scan(t0: int, t1: int) -> None:
            self._scan(q[t0:t1], k[t0:t1], v[t0:t1], g[t0:t1], beta[t0:t1], ssm, out[t0:t1])

        advance(p, ri, window, scan)

    def _scan(self, q, k, v, g, beta, ssm, out) -> None:
        cfg = self.cfg
        rc = self.kernels.lib.tq_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                            q.shape[0], cfg.linear_key_heads, cfg.linear_value_heads,
                                            cfg.linear_key_dim, cfg.linear_value_dim, int(cfg.linear_v_tiled),
                                            ssm.data_ptr(),
                                            out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError("gated delta rule: a shape the kernel does not take")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim (transformers' / FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
