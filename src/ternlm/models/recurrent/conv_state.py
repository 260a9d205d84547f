"""The short causal depthwise convolution the three recurrent mixers share (deltanet.py, mamba2.py,
shortconv.py; issue 60): its window over a sequence's kept inputs and this call's, the conv over it, and the
state it leaves (the last K - 1 inputs) in the slot and in the snapshots a call asked for.

The conv's state (a slot's kv/recurrent.RecurrentState `conv[ri]`, (C, K - 1), oldest first) is its inputs at
[start - K + 1, start). A call's window puts them before the call's T inputs, so window row j is position
start - K + 1 + j, and the state after position e - 1 is window rows [e - start, e - start + K - 1).
Every output is a sum over the K taps in a fixed order, per position and per element, so a row's bits never
depend on the rows beside it or on how a sequence is cut into calls ([ROW-EXACT], [RESUME-EXACT]).
"""
from __future__ import annotations

from typing import Callable

import torch


def conv_taps(weight: torch.Tensor, channels: int, kernel: int) -> torch.Tensor:
    """A depthwise conv1d weight as loaded ((C, 1, K) or (C, K)) -> (K, C): row i is tap i's weights, the
    layout conv_window reads. Pure (a new fp32 tensor)."""
    return weight.float().reshape(channels, kernel).T.contiguous()


def require_kernels(kernels, what: str):
    """The native kernels a mixer's scan runs on (kernels/recurrent.c): returned as given, or ValueError
    naming the layer kind (there is no torch fallback for the scans). Pure."""
    if kernels is None:
        raise ValueError(f"{what} layers need the native kernels (kernels/recurrent.c)")
    return kernels


def conv_window(kept: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kept (C, K - 1): the inputs at [start - K + 1, start) (a state's conv[ri]); x (T, C): this call's
    inputs at [start, start + T); w (K, C): tap i's weights (no bias: a mixer adds its own).
    -> (window (T + K - 1, C), conv (T, C)) with conv[t] = w[0] window[t] + ... + w[K-1] window[t + K - 1],
    taps added in order. Pure: kept is read, never written (advance writes the state back)."""
    T, K = x.shape[0], w.shape[0]
    # [start - K + 1, start) kept inputs | [start, start + T) this call: window row j = position start - K + 1 + j
    window = torch.cat([kept.T, x])                                              # (T + K - 1, C)
    conv = w[0] * window[0:T]
    for i in range(1, K):                                                        # taps in order: position-local sums
        conv = conv + w[i] * window[i:i + T]
    return window, conv                                                          # (T + K - 1, C), (T, C)


def advance(p, ri: int, window: torch.Tensor, scan: Callable[[int, int], None] | None = None) -> None:
    """Advance one sequence's state of recurrent layer `ri` over its T rows, split at the captures.
    p: a llama._Part (`start`, `state` a RecurrentState at start, `captures` {position: (conv, ssm)} or None);
    window (T + K - 1, C): conv_window's, for this call's rows [start, start + T).
    scan(t0, t1): the mixer's recurrence over rows [t0, t1), advancing p.state.ssm[ri] in place; called for
    each non-empty segment in order, None for a mixer with no ssm state (shortconv).
    Side effects: at each captured position e in (start, start + T], after the rows before it are scanned,
    p.captures[e][0][ri] = window rows [e - start, e - start + K - 1) transposed (C, K - 1), and with a scan
    p.captures[e][1][ri] = p.state.ssm[ri]; last, p.state.conv[ri] = window rows [T, T + K - 1) transposed."""
    st = p.state
    keep = st.conv.shape[2]                                                      # K - 1
    T = window.shape[0] - keep
    cuts = sorted(e - p.start for e in (p.captures or {}) if p.start < e <= p.start + T)
    t0 = 0
    for t1 in cuts + ([T] if not cuts or cuts[-1] != T else []):
        if scan is not None and t1 > t0:
            scan(t0, t1)
        e = p.start + t1
        if p.captures is not None and e in p.captures:                          # the state after position e - 1
            c_conv, c_ssm = p.captures[e]
            c_conv[ri].copy_(window[t1:t1 + keep].T)
            if scan is not None:
                c_ssm[ri].copy_(st.ssm[ri])
        t0 = t1
    st.conv[ri].copy_(window[T:T + keep].T)
