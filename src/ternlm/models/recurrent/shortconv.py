"""LFM2's gated short convolution (transformers' Lfm2ShortConv, llama.cpp's shortconv), a recurrent token mixer:

    h (M, hidden) -> in_proj: B | C | x (hidden each)
    B * x -> causal depthwise conv (kernel K, over each sequence's positions, no bias) -> * C -> out_proj

Its state (a slot's kv/recurrent.RecurrentState, this layer's index `ri` in it) is the conv's last K - 1 inputs
(B * x) only; the ssm part of the state is empty for this kind. Every operation is per element or a sum over the
K taps in a fixed order (position-local), so a row's bits never depend on the rows beside it or on how a
sequence is cut into calls ([RESUME-EXACT], [ROW-EXACT]): resumed == cold, chunked == one pass, batched == alone.
transformers convolves with torch's conv1d (another summation order): parity is within fp32 rounding.

Side effects of a call: each part's conv state advanced to its end, and the snapshots it asked for (`captures`)
filled with the conv inputs before each captured position.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .conv_state import advance, conv_taps, conv_window


class ShortConv:
    """Frozen weights of one layer; `build` makes its projections (models/qlinear.projection)."""

    def __init__(self, cfg: ModelConfig, w: dict, build, ri: int):
        self.cfg, self.ri = cfg, ri
        H, K = cfg.hidden_size, cfg.shortconv_kernel
        self.in_proj = build([w["conv.in_proj.weight"]])                      # (3 H, hidden): B | C | x
        self.out = build([w["conv.out_proj.weight"]])                         # (hidden, H)
        self.conv_w = conv_taps(w["conv.conv.weight"], H, K)   # (K, H): tap i's weights

    def __call__(self, h: torch.Tensor, parts: list) -> torch.Tensor:
        """h: (M, hidden), the normed input of every part's rows; parts: llama._Part with `state` (a
        RecurrentState at the part's start) and `captures` ({position: (conv, ssm)} to fill, or None).
        -> (M, hidden) in h's dtype."""
        H = self.cfg.hidden_size
        b, c, x = torch.split(self.in_proj(h).float(), [H, H, H], dim=1)       # (M, H) each
        bx = b * x
        y = torch.empty_like(bx)
        for p in parts:
            y[p.r0:p.r1] = c[p.r0:p.r1] * self._sequence(bx[p.r0:p.r1], p)
        return self.out(y.to(h.dtype))

    def _sequence(self, bx: torch.Tensor, p) -> torch.Tensor:
        """One sequence's rows [start, start + T): (T, H) conv outputs. Side effects: p.state's conv inputs of
        this layer advanced to start + T; p.captures[e][0] (conv) filled at this layer's index."""
        window, conv = conv_window(p.state.conv[self.ri], bx, self.conv_w)     # (T + K - 1, H), (T, H)
        advance(p, self.ri, window)
        return conv
