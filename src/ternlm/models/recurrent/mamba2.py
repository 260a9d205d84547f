"""A Mamba-2 layer's token mixer (Nemotron-H's "linear_attention" blocks, issue 47), in place of attention.

    h (M, hidden) -> in_proj: z (H P), xBC (H P + 2 G N), dt (H)
    xBC -> short causal depthwise conv (kernel K, bias, over each sequence's positions) -> SiLU -> x, B, C
    dt = max(softplus(dt + dt_bias), dt_min); A = -exp(A_log) (as loaded)
    the SSD recurrence over the sequence (kernels/recurrent.c tq_ssd_scan, one token at a time [RESUME-EXACT]),
    y + D x inside it
    gated RMSNorm: y * SiLU(z), normalised per group of H P / G channels, times w -> out_proj
transformers' NemotronHMamba2Mixer computes the same (its chunked SSD in prefill: other roundings, so parity is
within fp32 rounding; our own paths agree bit for bit: cold, resumed, chunked, batched, decoded).
[ROW-EXACT] SiLU and softplus come from kernels/recurrent.c's tq_pointwise (per element, whatever the rows
beside it); the conv's taps are summed per position in a fixed order, elementwise.

State (a slot's kv/recurrent.RecurrentState, this layer's index `ri` in it): the conv's last K - 1 inputs
(conv_dim, K - 1) and the SSD state (H, P, N), both after the segment's `start`. Side effects of a call:
each part's state advanced to its end, and the snapshots its part asked for (`captures`) filled.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ...kernels.build import Kernels
from .conv_state import advance, conv_taps, conv_window, require_kernels


class Mamba2:
    """Frozen weights of one layer; `build` makes its projection (models/qlinear.projection)."""

    def __init__(self, cfg: ModelConfig, w: dict, build, ri: int, kernels: Kernels | None):
        self.cfg, self.ri, self.kernels = cfg, ri, require_kernels(kernels, "Mamba-2")
        H, P, N, G = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state, cfg.mamba_groups
        self.inner = H * P
        self.conv_dim = self.inner + 2 * G * N
        self.in_proj = build([w["mixer.in_proj.weight"]])                      # (inner + conv_dim + H, hidden)
        self.out = build([w["mixer.out_proj.weight"]])                         # (hidden, inner)
        K = cfg.mamba_conv_kernel
        self.conv_w = conv_taps(w["mixer.conv1d.weight"], self.conv_dim, K)   # (K, conv_dim)
        self.conv_b = w["mixer.conv1d.bias"].float()                           # (conv_dim,)
        self.neg_a = w["mixer.A"].float().reshape(H).contiguous()              # (H,) -exp(A_log), as loaded
        self.d = w["mixer.D"].float().reshape(H).contiguous()                  # (H,)
        self.dt_bias = w["mixer.dt_bias"].float().reshape(H)                   # (H,)
        self.norm = w["mixer.norm.weight"].float().reshape(self.inner)         # (inner,)

    def __call__(self, h: torch.Tensor, parts: list) -> torch.Tensor:
        """h: (M, hidden), the normed input of every part's rows; parts: llama._Part with `state` (a
        RecurrentState at the part's start) and `captures` ({position: (conv, ssm)} to fill, or None).
        -> (M, hidden) in h's dtype."""
        cfg = self.cfg
        H, P, G = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_groups
        proj = self.in_proj(h).float()                                           # (M, inner + conv_dim + H)
        z, xbc, dt = torch.split(proj, [self.inner, self.conv_dim, H], dim=1)
        pw = self.kernels.pointwise         # [ROW-EXACT] an element's bits never depend on its neighbours
        dt = pw("softplus", dt + self.dt_bias)                                   # (M, H)
        if cfg.mamba_dt_min > 0:
            dt = dt.clamp(min=cfg.mamba_dt_min)
        y = torch.empty(h.shape[0], H, P)
        for p in parts:
            self._sequence(xbc[p.r0:p.r1], dt[p.r0:p.r1], p, y[p.r0:p.r1])
        # the gated RMSNorm (norm_before_gate False): g = y * silu(z); per group: g * rsqrt(mean(g^2) + eps) * w
        g = (y.reshape(-1, self.inner) * pw("silu", z)).reshape(-1, G, self.inner // G)
        var = g.pow(2).mean(-1, keepdim=True)
        normed = self.norm * (g * torch.rsqrt(var + cfg.rms_norm_eps)).reshape(-1, self.inner)
        return self.out(normed.to(h.dtype))

    def _sequence(self, xbc: torch.Tensor, dt: torch.Tensor, p, out: torch.Tensor) -> None:
        """One sequence's rows [start, start + T): conv, the scan (split at the captures).
        xbc (T, conv_dim); dt (T, H); out (T, H, P) written. Side effects: p.state's conv and ssm of this
        layer advanced to start + T; p.captures[pos] filled at this layer's index."""
        cfg, st, ri = self.cfg, p.state, self.ri
        N, G = cfg.mamba_state, cfg.mamba_groups
        window, conv = conv_window(st.conv[ri], xbc, self.conv_w)               # (T + K - 1, conv_dim), (T, conv_dim)
        xs = self.kernels.pointwise("silu", conv + self.conv_b)                  # (T, conv_dim)
        x, B, C = torch.split(xs, [self.inner, G * N, G * N], dim=1)
        x, B, C, dt = x.contiguous(), B.contiguous(), C.contiguous(), dt.contiguous()
        ssm = st.ssm[ri]                                                         # (H, P, N), in place

        def scan(t0: int, t1: int) -> None:
            self._scan(x[t0:t1], B[t0:t1], C[t0:t1], dt[t0:t1], ssm, out[t0:t1])

        advance(p, ri, window, scan)

    def _scan(self, x, B, C, dt, ssm, out) -> None:
        """x (T, H P), B/C (T, G N), dt (T, H) contiguous fp32 slices; ssm (H, P, N) and out (T, H, P) written."""
        cfg = self.cfg
        rc = self.kernels.lib.tq_ssd_scan(x.data_ptr(), B.data_ptr(), C.data_ptr(), dt.data_ptr(),
                                          self.neg_a.data_ptr(), self.d.data_ptr(), x.shape[0], cfg.mamba_heads,
                                          cfg.mamba_groups, cfg.mamba_head_dim, cfg.mamba_state, ssm.data_ptr(),
                                          out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError("Mamba-2 scan: a shape the kernel does not take")
