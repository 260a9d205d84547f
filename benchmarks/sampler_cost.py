"""The cost of one token's choice on one logits row, the sampler before issue 59 beside today's, interleaved
(A B A B), medians: greedy, temperature 1, temperature 0.7 + top_p 0.95 (+ presence_penalty 0.5 today), top_k 40,
for the vocabularies of the registry's models (49,152 smollm2, 151,936 qwen2.5, 262,144 Gemma 3).

    python benchmarks/sampler_cost.py [--threads 2] [--repeats 200]

"before" is the torch path as it was (two log-softmaxes, a full sort for the nucleus, torch.multinomial over the
whole vocabulary; its code is kept here for this comparison only). Rows: N(0, 3^2) logits (flatter than a model's:
the nucleus is larger, the worst case for the new threshold search).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ternlm.engine.sampling import Penalties, Sampler, SamplingParams, draw_seed


def before(x: torch.Tensor, p: SamplingParams, gen: torch.Generator, index: int) -> int:
    """Sampler.sample of 9c55889 (no penalties existed)."""
    if p.greedy:
        return int(x.numpy().argmax())
    z = x / p.temperature
    if p.top_k and p.top_k < z.shape[-1]:
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    logp = torch.log_softmax(z, dim=-1)
    if p.top_p < 1.0:
        sorted_lp, order = torch.sort(logp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= p.top_p
        logp = logp.scatter(0, order[drop], float("-inf"))
    probs = torch.log_softmax(logp, dim=-1).exp()
    gen.manual_seed(draw_seed(p.seed or 0, index))
    return int(torch.multinomial(probs, 1, generator=gen))


SETTINGS = {"greedy": SamplingParams(), "t1": SamplingParams(1.0, seed=1),
            "t0.7-p0.95": SamplingParams(0.7, top_p=0.95, seed=1),
            "t0.7-p0.95-pres0.5": SamplingParams(0.7, top_p=0.95, seed=1, penalties=Penalties(presence=0.5)),
            "t0.8-k40": SamplingParams(0.8, top_k=40, seed=1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print(f"ms per choice, median of {a.repeats}, {a.threads} torch threads")
    print(f"{'vocabulary':>10} {'setting':20s} {'before':>8} {'now':>8} {'ratio':>8}")
    for vocab in (49152, 151936, 262144):
        x = torch.randn(vocab, generator=g) * 3
        for name, p in SETTINGS.items():
            s, gen = Sampler(p, prompt=list(range(0, 3000, 7))), torch.Generator()
            old, new = [], []
            for i in range(a.repeats):
                t0 = time.perf_counter()
                if not p.penalties.active:
                    before(x, p, gen, i)
                t1 = time.perf_counter()
                s.push(s.sample(x, i))
                t2 = time.perf_counter()
                old.append(t1 - t0)
                new.append(t2 - t1)
            o, n = statistics.median(old) * 1e3, statistics.median(new) * 1e3
            print(f"{vocab:>10} {name:20s} {o if p.penalties.active is False else float('nan'):8.3f} {n:8.3f} "
                  f"{(n / o) if not p.penalties.active else float('nan'):8.3f}", flush=True)


if __name__ == "__main__":
    main()
