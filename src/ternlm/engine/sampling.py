"""Next-token choice from logits: logit bias, penalties, greedy, temperature, top-k, top-p, min-p, seeded.

The draw is part of the answer (docs/architecture.md: the invariants): a token depends only on its row's logits after the request's
bias, penalties and grammar mask, and on (seed, index of the token in its answer). Each draw takes its uniform
number from draw_seed(seed, index) (an inverse CDF, no generator state), so speculative decoding (sequence.py),
which samples several positions in one step and keeps a drafted token only if it equals the token sampled there,
gives the same answer on or off, batched or alone, cached or cold, at any temperature. Penalties count exactly
the tokens before the position (`Penalties.push` after each sampled token). A request without a seed gets a
random one, and is exact with respect to it.

Cost [SAMPLE-COST]: the filtered draw is kernels/sample.c (a few vector passes over the row: selection, not
sorting); the bias and penalties touch only their own ids, written into the row and restored after the choice
(no copy of the vocabulary). Without native kernels, `_reference_draw` (numpy, float64) draws from the same
distribution by the same rule.

Penalties, as each ecosystem defines them (applied after logit_bias, in this order):
- repetition (transformers' RepetitionPenaltyLogitsProcessor, vLLM, llama.cpp's repeat_penalty): a logit of a
  token in scope is divided by the penalty when > 0 and multiplied by it otherwise;
- frequency / presence (OpenAI): logit -= count * frequency + (count > 0) * presence.
Scope: `last_n` None (OpenAI, vLLM): repetition over prompt + generated, frequency/presence over the generated
tokens; `last_n` n (llama.cpp's repeat_last_n, Ollama's options): all three over the last n tokens of prompt +
generated (-1: all of them, 0: penalties off).
"""
from __future__ import annotations

import math
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The random stream of draw `index` of a request seeded `seed`: splitmix64 of the pair (neighbouring
    indices give unrelated streams). Pure."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def draw_uniform(seed: int, index: int) -> float:
    """u in [0, 1) of draw `index`: the top 53 bits of draw_seed, exactly representable. Pure."""
    return (draw_seed(seed, index) >> 10) * 2.0 ** -53


@dataclass(frozen=True)
class Penalties:
    """Repetition, frequency and presence penalties and their scope (see the module docstring)."""
    repetition: float = 1.0      # 1 -> off; > 0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int | None = None    # None: OpenAI/vLLM scopes; n >= 0 or -1: llama.cpp's window

    def __post_init__(self) -> None:
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise ValueError(f"repetition penalty must be > 0, got {self.repetition}")
        if not (math.isfinite(self.frequency) and math.isfinite(self.presence)):
            raise ValueError("frequency and presence penalties must be finite")
        if self.last_n is not None and self.last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.last_n}")

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 -> greedy
    top_k: int = 0               # 0 -> off
    top_p: float = 1.0           # 1 -> off
    min_p: float = 0.0           # 0 -> off
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit) before any choice
    penalties: Penalties = Penalties()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class PenaltyState:
    """The counts the penalties read, kept as tokens arrive: `ids` (distinct token ids, first seen first) and, per
    id, its count in the repetition scope and in the frequency/presence scope. Fed the prompt at construction and
    each sampled token by `push`; a window (last_n) also forgets the oldest."""

    def __init__(self, pen: Penalties, prompt: list[int]):
        self.pen = pen
        self._pos: dict[int, int] = {}
        self._ids = np.empty(64, np.int64)
        self._rep = np.zeros(64, np.int64)     # counts in the repetition scope
        self._fp = np.zeros(64, np.int64)      # counts in the frequency/presence scope
        self._n = 0
        window = pen.last_n is not None and pen.last_n > 0
        self._window: deque[int] | None = deque() if window else None
        if pen.last_n is None:                 # OpenAI/vLLM: the prompt counts for repetition only
            if pen.repetition != 1.0:
                for t in dict.fromkeys(prompt):
                    j = self._slot(t)        # (first: it may grow the arrays)
                    self._rep[j] = 1
        else:
            for t in prompt:
                self._add(t)

    def _slot(self, t: int) -> int:
        j = self._pos.get(t)
        if j is None:
            j = self._pos[t] = self._n
            if j == len(self._ids):
                self._ids, self._rep, self._fp = (np.concatenate([a, np.zeros_like(a)])
                                                  for a in (self._ids, self._rep, self._fp))
            self._ids[j] = t
            self._n += 1
        return j

    def _add(self, t: int) -> None:
        """llama.cpp's window: t enters both scopes; the oldest leaves once the window is full."""
        j = self._slot(t)
        self._rep[j] += 1
        self._fp[j] += 1
        if self._window is not None:
            self._window.append(t)
            if len(self._window) > self.pen.last_n:
                k = self._pos[self._window.popleft()]
                self._rep[k] -= 1
                self._fp[k] -= 1

    @property
    def ids(self) -> np.ndarray:
        """(distinct,) int64: every id ever counted (a window's forgotten ones too: `apply` skips zero counts).
        A view: valid until the next `push`."""
        return self._ids[:self._n]

    def push(self, t: int) -> None:
        """A token was sampled (and joins the answer). Side effect: the counts."""
        if self.pen.last_n is None:
            j = self._slot(t)
            self._rep[j] += 1
            self._fp[j] += 1
        else:
            self._add(t)

    def apply(self, x: np.ndarray) -> None:
        """Penalize the logits row x (vocab,) fp32 in place, only at ids with a count (float32 arithmetic, as
        transformers and llama.cpp compute it)."""
        n, p = self._n, self.pen
        ids, rep, fp = self._ids[:n], self._rep[:n], self._fp[:n]
        live = (rep > 0) | (fp > 0)
        if not live.all():
            ids, rep, fp = ids[live], rep[live], fp[live]
        if not len(ids):
            return
        v = x[ids]
        if p.repetition != 1.0:
            r = np.float32(p.repetition)
            v = np.where(rep > 0, np.where(v < 0, v * r, v / r), v)
        if p.frequency or p.presence:
            v = v - (fp.astype(np.float32) * np.float32(p.frequency) + (fp > 0).astype(np.float32) * np.float32(p.presence))
        x[ids] = v


class _Scratch:
    """sample.c's working memory for one vocabulary size (allocated once a sampler first draws)."""

    def __init__(self, vocab: int):
        self.e = np.empty(vocab, np.float32)
        self.w = np.empty(vocab, np.float32)
        self.cand = np.empty(vocab, np.int32)
        self.bsum = np.empty((vocab + 1023) // 1024, np.float64)


def _native():
    from ..kernels.build import Kernels, load
    k = load()
    return k if isinstance(k, Kernels) else None


def kth_largest(x: np.ndarray, k: int) -> float:
    """The k-th largest value of x (1 <= k <= len(x)). Pure."""
    return float(np.partition(x, len(x) - k)[len(x) - k])


def reference_probs(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution sample.c draws from, in float64 with a stable sort: (vocab,) probabilities, 0 outside the
    kept set F. The fallback without native kernels, and the tests' rendering of the rule. Pure."""
    x = x.astype(np.float64)
    m = x.max()
    if not m > -np.inf:
        raise ValueError("no token can be sampled: every logit is -inf")
    keep = np.ones(len(x), bool)
    if 0 < top_k < len(x):
        keep &= x >= kth_largest(x, top_k)
    e = np.where(keep, np.exp((x - m) / temperature), 0.0)
    z = e.sum()
    if min_p > 0:
        keep &= e >= min_p
    if top_p < 1:
        order = np.argsort(-e, kind="stable")             # p desc, index asc
        before = np.cumsum(e[order]) - e[order]
        cut = np.zeros(len(x), bool)
        cut[order[before >= top_p * z]] = True
        keep &= ~cut
    f = np.where(keep, e, 0.0)
    return f / f.sum()


def _reference_draw(probs: np.ndarray, u: float) -> int:
    """Inverse CDF in index order: the first token whose running sum exceeds u (rounding past the end: the last
    token with probability). Pure."""
    cum = np.cumsum(probs)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return i if i < len(probs) else int(np.flatnonzero(probs)[-1])


class Sampler:
    """One request's (one choice's) sampling: its parameters, seed and penalty counts. Not thread-safe."""

    def __init__(self, params: SamplingParams, prompt: list[int] = ()):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        bias = params.logit_bias
        self._bias_ids = np.array([t for t, _ in bias], np.int64)
        self._bias = np.array([b for _, b in bias], np.float32)
        self.penalties = PenaltyState(params.penalties, list(prompt)) if params.penalties.active else None
        self._scratch: _Scratch | None = None
        self._kernels = None if params.greedy else _native()

    def push(self, token: int) -> None:
        """`token` was sampled and joins the answer: the penalties count it from the next position on."""
        if self.penalties is not None:
            self.penalties.push(token)

    def sample(self, logits: torch.Tensor, index: int,
               mask: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
        """logits: (vocab,) fp32, the model's row (left as it came: the bias and penalties are written into it for
        the choice and restored); index: the token's index in the answer (its draw); mask: the grammar's (returns
        a masked copy). Returns a token id. Raises ValueError when no token can be sampled."""
        row = logits if logits.dtype == torch.float32 and logits.is_contiguous() else logits.float().contiguous()
        x = row.numpy()
        touched = self._touched()
        saved = x[touched].copy() if len(touched) else None
        try:
            if len(self._bias_ids):
                x[self._bias_ids] += self._bias
            if self.penalties is not None:
                self.penalties.apply(x)
            if mask is not None:
                x = mask(row).numpy()
            return self._choose(x, index)
        finally:
            if saved is not None:
                x_orig = row.numpy()
                x_orig[touched] = saved

    def _touched(self) -> np.ndarray:
        if self.penalties is None:
            return self._bias_ids
        ids = self.penalties.ids
        return np.union1d(self._bias_ids, ids) if len(self._bias_ids) else ids.copy()

    def _choose(self, x: np.ndarray, index: int) -> int:
        """x: (vocab,) fp32 after bias, penalties and mask -> a token id."""
        p = self.params
        if p.greedy:
            # numpy's argmax: the same first-maximum rule as torch.argmax, ~10x less time over a
            # vocabulary (151,936 logits: 16 against 159 us a step, on the serial path of decode)
            return int(x.argmax())
        u = draw_uniform(self.seed, index)
        if self._kernels is None:
            return _reference_draw(reference_probs(x, p.temperature, p.top_k, p.top_p, p.min_p), u)
        if self._scratch is None or len(self._scratch.e) != len(x):
            self._scratch = _Scratch(len(x))
        s = self._scratch
        x = np.ascontiguousarray(x, np.float32)
        tok = self._kernels.sample(x.ctypes.data, len(x), p.temperature, p.top_k, p.top_p, p.min_p, u,
                                   s.e.ctypes.data, s.w.ctypes.data, s.cand.ctypes.data, s.bsum.ctypes.data)
        if tok < 0:
            raise ValueError("no token can be sampled: every logit is -inf")
        return tok

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a draw from the native kernel takes (vocab,) for the row as given (no bias,
        penalties or mask applied here). For tests and diagnostics. Pure but for the scratch."""
        p = self.params
        x = np.ascontiguousarray(logits, np.float32)
        if self._kernels is None:
            return reference_probs(x, p.temperature, p.top_k, p.top_p, p.min_p).astype(np.float32)
        s = _Scratch(len(x))
        out = np.empty(len(x), np.float32)
        self._kernels.sample(x.ctypes.data, len(x), p.temperature, p.top_k, p.top_p, p.min_p, 0.0,
                             s.e.ctypes.data, s.w.ctypes.data, s.cand.ctypes.data, s.bsum.ctypes.data,
                             out.ctypes.data)
        return out
