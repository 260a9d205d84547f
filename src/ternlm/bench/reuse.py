"""`ternlm bench reuse`: the reference experiment. A long conversation whose next turn reuses most of
its prompt; time to first token of that turn with reuse, without (--no-prefix-kv), and the floor:
prefilling only the tail at that offset (so the cost of the reuse path itself is visible); and the
same conversation through llama.cpp with its own prefix reuse: llama-cpp-python's worker when the peers venv
is there, and llama.cpp's own `llama-server` binary with --llama-server BIN (or `auto`: the one
scripts/build-llamacpp built, llamacpp.find_bin), sent the same turn-2 ids as ternlm, its processed
tokens read from its answer's timings (llama_server.py). Issue 46's target: ternlm's turn 2 <= 1/3 of
llama-server's.

-m is a registry name or any local .gguf path (llama.cpp loads the same file; an HF folder runs
without it); results are named after the registry name or the file's stem."""
from __future__ import annotations

import random
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from .common import bench_model, command_line, long_chat, median, synthetic_text, write_json
from .llama_server import ServerTurn, complete_ids
from .llamacpp import LLAMA_SERVER, LlamaCppWorker, llama_server, resolve_bin
from .peers import find_llamacpp

LS_REUSE, LS_NO_REUSE = "llama-server reuse", "llama-server no-reuse"
TARGET_VS_LLAMA_SERVER = 1 / 3      # issue 46: ternlm's turn 2 at most a third of llama-server's


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


def llama_server_binary(arg: str | None) -> str | None:
    """--llama-server's value: None (not asked), a path, or `auto` (the checkout's build; an error if none)."""
    return resolve_bin(LLAMA_SERVER, arg) if arg == "auto" else arg


def _llama_server_round(base: str, turn1: list[int], turn2: list[int]) -> dict[str, ServerTurn]:
    """llama-server's two rows of one round. Side effect: its slot ends holding turn 2 (uncached)."""
    complete_ids(base, turn1, 24)                    # the previous turn, as a client would have run it
    return {LS_REUSE: complete_ids(base, turn2, 1),
            LS_NO_REUSE: complete_ids(base, turn2, 1, cache_prompt=False)}


def run(args, load_engine) -> dict:
    torch.set_num_threads(args.threads)
    m = bench_model(args.model)
    engine = load_engine(args)
    turn1, turn2 = _turns(engine, args.history_tokens, args.seed)
    _, k = _ttft(engine, turn1, turn2, True)
    # llama-cpp-python's in-process peer only where that venv can import it (scripts/build-llamacpp's
    # .venv-peers holds only cmake and ninja: its existence says nothing)
    peers_venv = bool(args.llamacpp_python) and find_llamacpp(args.llamacpp_python).installed
    binary = llama_server_binary(getattr(args, "llama_server", None))
    n_ctx = max(8192, len(turn2) + 64)
    with ExitStack() as stack:                 # every peer process stops on the way out, pass or fail
        worker = server = None
        if peers_venv and m.gguf is None:
            print(f"llama.cpp: skipped ({m.path} is a Hugging Face folder, not a GGUF file)")
        elif peers_venv:
            worker = LlamaCppWorker(args.llamacpp_python, m.gguf, args.threads, n_ctx)
            stack.callback(worker.close)
        if binary and m.gguf is None:
            print(f"llama-server: skipped ({m.path} is a Hugging Face folder, not a GGUF file)")
        elif binary:
            # one slot, its defaults otherwise (prefix cache on, context checkpoints)
            server = stack.enter_context(llama_server(binary, m.gguf, args.threads, 1, n_ctx,
                                                      Path(args.out) / f"reuse-{m.label}-llama-server.log"))
        return _measure(args, m, engine, turn1, turn2, k, worker, server)


def _measure(args, m, engine, turn1, turn2, k, worker, server) -> dict:
    rows = {"reuse": [], "no-reuse": [], "tail-only": [], "llama.cpp reuse": [], "llama.cpp no-reuse": [],
            LS_REUSE: [], LS_NO_REUSE: []}
    counts: dict[str, list[ServerTurn]] = {LS_REUSE: [], LS_NO_REUSE: []}
    for r in range(args.repeats + 1):          # first round is warm-up
        a, _ = _ttft(engine, turn1, turn2, True)
        b, _ = _ttft(engine, None, turn2, False)
        c = _tail_only(engine, turn2, k)
        got = {"reuse": a, "no-reuse": b, "tail-only": c}
        if worker:
            worker.call({"op": "ttft", "ids": turn1, "reset": True})
            got["llama.cpp reuse"] = worker.call({"op": "ttft", "ids": turn2})["s"]
            got["llama.cpp no-reuse"] = worker.call({"op": "ttft", "ids": turn2, "reset": True})["s"]
        if server:
            ls = _llama_server_round(server.base, turn1, turn2)
            got |= {name: t.wall_s for name, t in ls.items()}
        if r:
            for name, v in got.items():
                rows[name].append(v)
            if server:
                for name, t in ls.items():
                    counts[name].append(t)
        print(f"  round {r}{' (warm-up)' if not r else ''}: " + "  ".join(f"{n} {v * 1e3:.0f} ms" for n, v in got.items()),
              flush=True)
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
    # Tokens each engine evaluated for turn 2 (ternlm's are the same every round: a fresh slot each time).
    res["processed_tokens"] = {"reuse": n - k, "no-reuse": n, "tail-only": n - k}
    if server:
        last = {name: ts[-1] for name, ts in counts.items()}
        res["processed_tokens"] |= {name: t.processed for name, t in last.items()}
        res["llama_server"] = {"binary": server.argv[0], "argv": server.argv, "log": str(server.log_path),
                               "rounds": {name: [{"prompt": t.prompt, "cached": t.cached, "processed": t.processed,
                                                  "wall_s": t.wall_s, "prompt_ms": t.prompt_ms} for t in ts]
                                          for name, ts in counts.items()},
                               "counts_consistent": all(t.consistent for ts in counts.values() for t in ts)}
        res["reuse_over_llama_server_reuse"] = med["reuse"] / med[LS_REUSE]
        res["llama_server_target"] = {"max_ratio": TARGET_VS_LLAMA_SERVER,
                                      "met": res["reuse_over_llama_server_reuse"] <= TARGET_VS_LLAMA_SERVER}
    print(f"\nprompt {n} tokens, reused {k} ({100 * k / n:.1f}%), median of {args.repeats}:")
    for name, v in med.items():
        done = res["processed_tokens"].get(name)
        print(f"  {name:22s} time to first token {v * 1e3:8.1f} ms"
              + (f"  processed {done:6d} of {n} prompt tokens" if done is not None else ""))
    print(f"  speedup vs no reuse x{res['speedup_vs_no_reuse']:.1f} at {100 * k / n:.1f}% reused; "
          f"reuse / tail-only = {res['reuse_over_tail_only']:.2f}"
          + (f"; reuse / llama.cpp reuse = {res['reuse_over_llamacpp_reuse']:.2f}" if worker else ""))
    if server:
        ok = res["llama_server"]["counts_consistent"]
        print(f"  reuse / llama-server reuse = {res['reuse_over_llama_server_reuse']:.2f} (target <= 1/3: "
              f"{'met' if res['llama_server_target']['met'] else 'MISSED'}); llama-server cache_n + prompt_n == "
              f"prompt every round: {'yes' if ok else 'NO'}")
    path = write_json(Path(args.out), f"reuse-{m.label}-{args.dtype}.json", res)
    print(f"wrote {path}")
    return res
