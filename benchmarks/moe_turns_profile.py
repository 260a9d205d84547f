"""Where a streamed mixture of experts' turn 2 goes, in process (issue 49): turn 1 (random token ids) and turn 2
(turn 1 + more ids, turn 1 reused from the slot) to their first token on a GGUF whose experts stream through a
cache of --expert-cache bytes, no memory cap, then cProfile of turn 2: the native layer's calls (attention and
products), the conversions (`convert_int`), the Python around each miss. The expert counters' read wait and
conversion times come with each turn. Quiet machine, one process: timings only mean something alone.

    .venv/bin/python benchmarks/moe_turns_profile.py -m FILE.gguf --expert-cache 5705181440 [--t1 1990 --t2 238]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ternlm.engine.core import Engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--expert-cache", type=int, required=True, help="bytes (what the 8 GiB cap's plan gives)")
    ap.add_argument("--t1", type=int, default=1990)
    ap.add_argument("--t2", type=int, default=238)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    e = Engine.load(str(args.model), expert_cache=args.expert_cache, min_reuse=1, ctx=4096)
    rng = random.Random(0)
    vocab = e.config.vocab_size
    p1 = [rng.randrange(100, vocab - 100) for _ in range(args.t1)]
    p2 = p1 + [rng.randrange(100, vocab - 100) for _ in range(args.t2)]
    st = e.model.experts.stats
    t = time.perf_counter()
    e.generate(p1, max_tokens=1, slot=0)
    print(f"turn 1 {time.perf_counter() - t:.2f} s  {st.snapshot()}", flush=True)
    before = st.snapshot()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    out = e.generate(p2, max_tokens=1, slot=0)
    prof.disable()
    print(f"turn 2 {time.perf_counter() - t:.2f} s, {out.cached_tokens} reused  {st.minus(before)}")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
