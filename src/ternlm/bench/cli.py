"""`ternlm bench engine|reuse` argument parsing."""
from __future__ import annotations

import os

PEERS_PYTHON = ".venv-peers/bin/python"


def add_bench_parser(sub, engine_args, load_engine) -> None:
    bench = sub.add_parser("bench", help="benchmarks (side by side, medians and ratios)")
    which = bench.add_subparsers(dest="bench", required=True)

    p = which.add_parser("engine", help="prefill/decode tok/s vs transformers and llama.cpp")
    engine_args(p)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--peers", default="transformers,llamacpp", help="comma list: transformers,llamacpp")
    _common(p)
    p.set_defaults(func=lambda a: _run("engine", a, load_engine))

    p = which.add_parser("reuse", help="time to first token of a long conversation's next turn")
    engine_args(p)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    _common(p)
    p.set_defaults(func=lambda a: _run("reuse", a, load_engine))


def _common(p) -> None:
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llamacpp-python", default=PEERS_PYTHON, help="python of the venv with llama-cpp-python")
    p.add_argument("--out", default="benchmarks/results")


def _run(which: str, args, load_engine) -> int:
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if which == "engine":
        from .engine import run
        if "llamacpp" in args.peers and not os.path.exists(args.llamacpp_python):
            raise FileNotFoundError(f"{args.llamacpp_python} not found: run `make bench-peers` or pass --peers transformers")
    else:
        from .reuse import run
    run(args, load_engine)
    return 0
