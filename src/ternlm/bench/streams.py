"""`ternlm bench streams`: steady-state decode throughput of N concurrent streams through the HTTP API,
ternlm (-m: one `ternlm serve` started here) beside any OpenAI-compatible --url (llama.cpp's server,
vLLM, ...), all driven by the same client (the chat's `OpenAIBackend`).

Each round sends N requests at once (distinct seeded prompts asking for a long story, greedy,
`max_tokens` each) and records every streamed piece's arrival time; the figure is the aggregate decode
tok/s inside the window where all N stream (latency.steady_decode_tok_s), with the inter-token latency
(p50/p99) in it. The multiturn benchmark's aggregate mixes prefills of the turns into the same clock;
this one isolates what the issue's "8 concurrent conversations decoding" costs.

Fairness: rounds interleave contenders and concurrencies (A1 B1 A8 B8, then again), each server warmed
up first; the report gives medians over --repeats and the ratios N vs 1 and ternlm ÷ each peer.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cli.chat_backends import OpenAIBackend
from .common import command_line, median, synthetic_text, write_json
from .latency import pcts, steady_decode_tok_s, steady_window
from .multiturn import ternlm_serve_args
from .procs import TernlmServe

TERNLM = "ternlm"


@dataclass
class Round:
    """One contender at one concurrency: every answer's piece arrival times (perf_counter seconds)."""
    contender: str
    concurrency: int
    times: list[list[float]] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)            # when each request was sent
    completion_tokens: list[int | None] = field(default_factory=list)

    def figures(self) -> dict:
        w = steady_window(self.times)
        inside = [b - a for t in self.times for a, b in zip(t, t[1:]) if w and a >= w[0] and b <= w[1]]
        pieces = sum(len(t) for t in self.times)
        tokens = [c for c in self.completion_tokens if c is not None]
        ttft = [t[0] - s0 for t, s0 in zip(self.times, self.sent) if t]
        return {"steady_tok_s": steady_decode_tok_s(self.times), "window_s": (w[1] - w[0]) if w else None,
                "itl_s": pcts(inside), "ttft_s": pcts(ttft), "pieces": pieces,
                "tokens_per_piece": (sum(tokens) / pieces) if tokens and pieces and len(tokens) == len(self.times) else None}


def prompts(n: int, seed: int) -> list[list[dict]]:
    """n distinct requests for a long answer (so every stream lasts the whole window)."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": f"Write a long, detailed story about {synthetic_text(rng, 6)}. "
                                          "Describe every scene at length."}] for _ in range(n)]


def one_round(backend: OpenAIBackend, label: str, n: int, max_tokens: int, seed: int) -> Round:
    """n concurrent greedy streams, released together; their arrival times."""
    r = Round(label, n, [[] for _ in range(n)], [0.0] * n, [None] * n)
    go = threading.Barrier(n)
    errors: list[BaseException] = []

    def stream(i: int, messages: list[dict]) -> None:
        try:
            go.wait()
            r.sent[i] = time.perf_counter()
            for piece in backend.stream(messages, max_tokens=max_tokens, temperature=0.0):
                if isinstance(piece, str):
                    r.times[i].append(time.perf_counter())
                else:
                    r.completion_tokens[i] = piece.completion_tokens
        except BaseException as e:  # noqa: BLE001 - re-raised below on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i, m), daemon=True) for i, m in enumerate(prompts(n, seed))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return r


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    levels = sorted(set(args.concurrency))
    if not levels or levels[0] < 1 or args.max_tokens < 2 or args.repeats < 1:
        raise ValueError("--concurrency >= 1, --max-tokens >= 2 and --repeats >= 1")
    urls, labels = list(args.url or []), list(args.label or [])
    if len(labels) > len(urls):
        raise ValueError(f"{len(labels)} --label for {len(urls)} --url")
    labels += [f"url{i + 1}" for i in range(len(labels), len(urls))]
    if not args.model and not urls:
        raise ValueError("nothing to measure: -m MODEL and/or --url URL")
    if args.model and TERNLM in labels:
        raise ValueError(f"the label {TERNLM!r} is the -m server's")
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    out_dir = Path(args.out)
    args.clients = max(levels)                        # ternlm_serve_args: slots = the top concurrency
    started = None
    rounds: list[Round] = []
    try:
        backends = {lb: OpenAIBackend(u, args.api_key, label=lb) for lb, u in zip(labels, urls)}
        if args.model:
            started = TernlmServe(*ternlm_serve_args(args, True), log_path=out_dir / "logs" / f"{TERNLM}.log").start()
            started.wait_ready()
            backends = {TERNLM: OpenAIBackend(started.url, None, label=TERNLM), **backends}
        for b in backends.values():      # untimed: first-call costs (allocation, connection) are not a round's
            for _ in b.stream([{"role": "user", "content": "Hello."}], max_tokens=2, temperature=0.0):
                pass
        for rep in range(args.repeats):
            for n in levels:
                for lb, b in backends.items():
                    r = one_round(b, lb, n, args.max_tokens, args.seed + rep)
                    rounds.append(r)
                    f = r.figures()
                    print(f"  repeat {rep + 1}: {lb:14s} x{n:<3d} steady {f['steady_tok_s'] or 0:7.1f} tok/s  "
                          f"ITL p50 {1000 * (f['itl_s']['p50'] or 0):6.1f} ms", flush=True)
    finally:
        if started:
            started.close()

    names = list(backends)
    figs = [(r, r.figures()) for r in rounds]
    pick = {"steady_tok_s": lambda f: f["steady_tok_s"], "itl_p50_s": lambda f: f["itl_s"]["p50"],
            "itl_p99_s": lambda f: f["itl_s"]["p99"], "ttft_p50_s": lambda f: f["ttft_s"]["p50"]}
    med = {lb: {n: {key: median([get(f) or 0.0 for r, f in figs if r.contender == lb and r.concurrency == n])
                    for key, get in pick.items()}
                for n in levels} for lb in names}
    lo = levels[0]
    ratios = {"vs_lowest": {lb: {n: med[lb][n]["steady_tok_s"] / med[lb][lo]["steady_tok_s"]
                                 for n in levels if med[lb][lo]["steady_tok_s"]} for lb in names}}
    if args.model:
        ratios["ternlm_over"] = {lb: {n: med[TERNLM][n]["steady_tok_s"] / med[lb][n]["steady_tok_s"]
                                      for n in levels if med[lb][n]["steady_tok_s"]} for lb in names if lb != TERNLM}
    result = {"command": command_line(), "model": args.model, "concurrency": levels, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "contenders": {lb: b.url for lb, b in backends.items()},
              "median": med, "ratios": ratios,
              "rounds": [{"contender": r.contender, "concurrency": r.concurrency, **f, "times": r.times}
                         for r, f in figs]}
    path = write_json(out_dir, "results.json", result)
    png = plot(result, out_dir / "streams.png")
    table = Table(title=f"steady decode of N concurrent streams (median of {args.repeats}, "
                        f"{args.max_tokens} tokens each)")
    for col in ("contender", "N", "aggregate tok/s", f"vs N={lo}", "TTFT p50", "ITL p50", "ITL p99"):
        table.add_column(col, justify="right")
    for lb in names:
        for n in levels:
            m = med[lb][n]
            v = ratios["vs_lowest"][lb].get(n)
            table.add_row(lb, str(n), f"{m['steady_tok_s']:.1f}", f"x{v:.2f}" if v else "-",
                          f"{1000 * m['ttft_p50_s']:.0f} ms", f"{1000 * m['itl_p50_s']:.1f} ms", f"{1000 * m['itl_p99_s']:.1f} ms")
    console = Console()
    console.print(table)
    for lb, per in ratios.get("ternlm_over", {}).items():
        console.print(f"ternlm ÷ {lb}: " + ", ".join(f"N={n} x{v:.2f}" for n, v in per.items()))
    console.print(f"command: {result['command']}\nwrote {path}, {png}")
    return 0


def plot(result: dict, path: Path) -> Path:
    """Against concurrency, per contender: median TTFT, ITL p50 and p99, and the steady aggregate tok/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for name, per in result["median"].items():
        ns = sorted(per, key=int)
        x = [int(n) for n in ns]
        line, = lat.plot(x, [per[n]["itl_p50_s"] * 1e3 for n in ns], marker="o", label=f"{name} ITL p50")
        lat.plot(x, [per[n]["itl_p99_s"] * 1e3 for n in ns], marker="^", ls="--", color=line.get_color(),
                 label=f"{name} ITL p99")
        lat.plot(x, [per[n]["ttft_p50_s"] * 1e3 for n in ns], marker="s", ls=":", color=line.get_color(),
                 label=f"{name} TTFT p50")
        thr.plot(x, [per[n]["steady_tok_s"] for n in ns], marker="o", color=line.get_color(), label=name)
    lat.set(xlabel="concurrent streams", ylabel="ms", yscale="log", title="latency against concurrency")
    thr.set(xlabel="concurrent streams", ylabel="aggregate decode tok/s (all streaming)",
            title=f"steady decode, {result['max_tokens']} tokens a stream")
    thr.set_ylim(bottom=0)
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["concurrency"], [str(n) for n in result["concurrency"]])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
