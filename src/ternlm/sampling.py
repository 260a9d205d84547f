"""Next-token choice from logits: greedy, temperature, top-k, top-p, min-p, logit bias, seeded.

A sampled token's random draw depends only on (the request's seed, the index of the token in its answer): the
generator is seeded from those two before each draw. Why: speculative decoding (sequence.py) samples several
positions in one step and keeps a drafted token only if it equals the token sampled there; with per-position
draws that token is the one plain decoding samples, so the answer is the same with speculation on or off, at
any temperature. A request without a seed gets a random one, and is exact with respect to it.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of draw `index` of a request seeded `seed`: splitmix64 of the pair (neighbouring
    indices give unrelated streams). Pure."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 -> greedy
    top_k: int = 0               # 0 -> off
    top_p: float = 1.0           # 1 -> off
    min_p: float = 0.0           # 0 -> off
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit) before any choice

    def __post_init__(self) -> None:
        if self.temperature < 0:
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


class Sampler:
    """Pure but for its generator's state, which each draw re-seeds (draw_seed)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.gen = torch.Generator()
        bias = params.logit_bias
        self._bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long) if bias else None
        self._bias = torch.tensor([b for _, b in bias], dtype=torch.float32) if bias else None

    def biased(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (vocab,) fp32 with the request's logit_bias added (a copy; the same tensor without a bias)."""
        if self._bias_ids is None:
            return logits
        out = logits.clone()
        out.index_add_(0, self._bias_ids, self._bias)
        return out

    def filtered_logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (vocab,) fp32 -> log-probabilities after temperature/top-k/top-p/min-p (-inf = cut)."""
        p = self.params
        x = logits / p.temperature
        if p.top_k and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        logp = torch.log_softmax(x, dim=-1)
        if p.min_p > 0.0:
            # keep tokens whose probability is at least min_p times the most likely one's
            logp = logp.masked_fill(logp < logp.max() + torch.log(torch.tensor(p.min_p)), float("-inf"))
        if p.top_p < 1.0:
            sorted_lp, order = torch.sort(logp, descending=True)
            cum = sorted_lp.exp().cumsum(-1)
            drop = cum - sorted_lp.exp() >= p.top_p      # tokens entirely past the nucleus
            logp = logp.scatter(0, order[drop], float("-inf"))
        return torch.log_softmax(logp, dim=-1)

    def sample(self, logits: torch.Tensor, index: int) -> int:
        """logits: (vocab,) fp32, biased already (`biased`); index: the token's index in the answer (its
        draw). Returns a token id."""
        if self.params.greedy:
            # numpy's argmax: the same first-maximum rule as torch.argmax, ~10x less time over a
            # vocabulary (151,936 logits: 16 against 159 us a step, on the serial path of decode)
            return int(logits.float().numpy().argmax())
        probs = self.filtered_logprobs(logits).exp()
        self.gen.manual_seed(draw_seed(self.seed, index))
        return int(torch.multinomial(probs, 1, generator=self.gen))
