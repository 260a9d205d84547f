"""Where a decode step's time goes, greedy next to sampled (issue 59): the forward (engine.step minus the
choice) and the choice itself (Sampler.sample: bias, penalties, mask, draw), per step, medians over --tokens
steps after a --context-token prompt, one token a step (speculation off).

    python benchmarks/sample_step_profile.py -m gemma3-270m [--context 1024] [--tokens 128]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from ternlm.bench.common import synthetic_text
from ternlm.engine.core import Engine
from ternlm.engine.sampling import Penalties, Sampler

SETTINGS = {"greedy": {}, "t1": {"temperature": 1.0, "seed": 1},
            "t0.7-p0.95-pres0.5": {"temperature": 0.7, "top_p": 0.95, "seed": 1, "penalties": Penalties(presence=0.5)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    e = Engine.load(a.model, slots=1, prefix_reuse=False, speculative=False)
    ids = e.tokenizer.encode(synthetic_text(random.Random(0), a.context * 2), add_special_tokens=False)[:a.context]
    spent: list[float] = []
    inner = Sampler.sample

    def timed(self, logits, index, mask=None):
        t0 = time.perf_counter()
        try:
            return inner(self, logits, index, mask)
        finally:
            spent.append(time.perf_counter() - t0)

    Sampler.sample = timed
    print(f"{a.model}: {a.context}-token prompt, {a.tokens} decode steps, vocabulary {e.config.vocab_size}")
    for rnd in range(2):                       # the second round is reported (the first warms up)
        for name, kw in SETTINGS.items():
            spent.clear()
            steps = []
            t = time.perf_counter()
            for ev in e.stream(ids, max_tokens=a.tokens + 1, ignore_eos=True, **kw):
                now = time.perf_counter()
                steps.append(now - t)
                t = now
            steps, choice = steps[2:], spent[2:]      # decode steps only (the prefill's and first token's out)
            if rnd:
                st, ch = statistics.median(steps) * 1e3, statistics.median(choice) * 1e3
                print(f"  {name:20s} step {st:6.2f} ms = forward and the rest {st - ch:6.2f} ms + choice {ch:5.3f} ms "
                      f"({100 * ch / st:.1f}%)")


if __name__ == "__main__":
    main()
