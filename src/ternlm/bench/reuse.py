"""`ternlm bench reuse`: the reference experiment. A long conversation whose next turn reuses most of
its prompt; time to first token of that turn with reuse, without (--no-prefix-kv), and the floor:
prefilling only the tail at that offset (so the cost of the reuse path itself is visible); and the
same conversation through llama.cpp with its own prefix reuse, when the peers venv is there.

-m is a registry name or any local .gguf path (llama.cpp loads the same file; an HF folder runs
without it); results are named after the registry name or the file's stem."""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from .common import bench_model, command_line, long_chat, median, synthetic_text, write_json
from .peers import LlamaCppWorker


def _turns(engine, history_tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """(turn-1 prompt, turn-2 prompt): turn 2 = turn 1 + the model's answer + a new user message."""
    rng = random.Random(seed)
    msgs = long_chat(engine, history_tokens, rng)
    turn1 = list(engine.apply_chat_template(msgs))
    engine.prefix_reuse = False
    answer = engine.generate(turn1, max_tokens=24).text
    msgs += [{"role": "assistant", "content": answer},
             {"role": "user", "content": synthetic_text(rng, 20)}]
    return turn1, list(engine.apply_chat_template(msgs))


def _ttft(engine, warmup: list[int] | None, prompt: list[int], reuse: bool) -> tuple[float, int]:
    engine.prefix_reuse = reuse
    engine.slots[0].reset()
    if warmup is not None:
        engine.generate(warmup, max_tokens=24)   # the previous turn, as the server would have run it
    c = engine.generate(prompt, max_tokens=1)
    return c.timings.ttft_s, c.cached_tokens


def _tail_only(engine, prompt: list[int], k: int) -> float:
    """Floor: a slot already holding prompt[:k] (set up untimed), then prefill prompt[k:] + sample."""
    slot = engine.slots[0]
    slot.reset(engine.namespace())
    engine.runner.prefill(slot, prompt[:k])
    t = time.perf_counter()
    logits = engine.runner.prefill(slot, prompt[k:])
    int(torch.argmax(logits))
    return time.perf_counter() - t


def run(args, load_engine) -> dict:
    torch.set_num_threads(args.threads)
    m = bench_model(args.model)
    engine = load_engine(args)
    turn1, turn2 = _turns(engine, args.history_tokens, args.seed)
    _, k = _ttft(engine, turn1, turn2, True)
    worker = None
    peers_venv = bool(args.llamacpp_python) and Path(args.llamacpp_python).exists()
    if peers_venv and m.gguf is None:
        print(f"llama.cpp: skipped ({m.path} is a Hugging Face folder, not a GGUF file)")
    elif peers_venv:
        worker = LlamaCppWorker(args.llamacpp_python, m.gguf, args.threads, max(8192, len(turn2) + 64))
    rows = {"reuse": [], "no-reuse": [], "tail-only": [], "llama.cpp reuse": [], "llama.cpp no-reuse": []}
    for r in range(args.repeats + 1):          # first round is warm-up
        a, _ = _ttft(engine, turn1, turn2, True)
        b, _ = _ttft(engine, None, turn2, False)
        c = _tail_only(engine, turn2, k)
        got = {"reuse": a, "no-reuse": b, "tail-only": c}
        if worker:
            worker.call({"op": "ttft", "ids": turn1, "reset": True})
            got["llama.cpp reuse"] = worker.call({"op": "ttft", "ids": turn2})["s"]
            got["llama.cpp no-reuse"] = worker.call({"op": "ttft", "ids": turn2, "reset": True})["s"]
        if r:
            for name, v in got.items():
                rows[name].append(v)
        print(f"  round {r}{' (warm-up)' if not r else ''}: " + "  ".join(f"{n} {v * 1e3:.0f} ms" for n, v in got.items()),
              flush=True)
    if worker:
        worker.close()
    med = {n: median(v) for n, v in rows.items() if v}
    n = len(turn2)
    res = {"command": command_line(), "model": m.label, "model_path": str(m.path), "dtype": args.dtype,
           "threads": args.threads,
           "prompt_tokens": n, "reused_tokens": k, "reuse_fraction": k / n, "repeats": args.repeats,
           "median_ttft_s": med, "samples": rows,
           "speedup_vs_no_reuse": med["no-reuse"] / med["reuse"],
           "reuse_over_tail_only": med["reuse"] / med["tail-only"]}
    if "llama.cpp reuse" in med:
        res["reuse_over_llamacpp_reuse"] = med["reuse"] / med["llama.cpp reuse"]
    print(f"\nprompt {n} tokens, reused {k} ({100 * k / n:.1f}%), median of {args.repeats}:")
    for name, v in med.items():
        print(f"  {name:20s} time to first token {v * 1e3:8.1f} ms")
    print(f"  speedup vs no reuse x{res['speedup_vs_no_reuse']:.1f} at {100 * k / n:.1f}% reused; "
          f"reuse / tail-only = {res['reuse_over_tail_only']:.2f}"
          + (f"; reuse / llama.cpp reuse = {res['reuse_over_llamacpp_reuse']:.2f}" if worker else ""))
    path = write_json(Path(args.out), f"reuse-{m.label}-{args.dtype}.json", res)
    print(f"wrote {path}")
    return res
