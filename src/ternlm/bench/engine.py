"""`ternlm bench engine`: prefill and decode throughput of ternlm, transformers and llama.cpp on the
same GGUF, same dtype class, same threads, interleaved A B C A B C, medians and ratios from one run."""
from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from .common import LlamaCppWorker, command_line, median, synthetic_text, write_json


def _prompt_ids(engine, n: int) -> list[int]:
    text = synthetic_text(random.Random(0), n * 2)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"synthetic text too short: {len(ids)} of {n} tokens")
    return ids[:n]


def _ternlm(engine, ids: list[int], decode_n: int, before: list[int]) -> tuple[float, float]:
    """(prefill tok/s of ids, decode tok/s after the prompt `before`) through the engine API, reuse off."""
    engine.prefix_reuse = False
    c = engine.generate(ids, max_tokens=1)
    prefill = c.timings.prefill_tokens / c.timings.prefill_s
    c = engine.generate(before, max_tokens=decode_n + 1, ignore_eos=True)
    return prefill, c.timings.decode_tokens / c.timings.decode_s


def _transformers(model, ids: list[int], decode_n: int, before: list[int]) -> tuple[float, float]:
    with torch.inference_mode():
        t = time.perf_counter()
        model(torch.tensor([ids]), logits_to_keep=1, use_cache=True)
        prefill = len(ids) / (time.perf_counter() - t)
        r = model(torch.tensor([before]), logits_to_keep=1, use_cache=True)
        past, tok = r.past_key_values, r.logits[0, -1].argmax().view(1, 1)
        t = time.perf_counter()
        for _ in range(decode_n):
            r = model(tok, past_key_values=past, use_cache=True)
            past, tok = r.past_key_values, r.logits[0, -1].argmax().view(1, 1)
        return prefill, decode_n / (time.perf_counter() - t)


def _rss_mib() -> float:
    """This process's resident set (it holds ternlm's engine and, if compared, transformers' model)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(args, load_engine) -> dict:
    from ..models.registry import resolve
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    ctx = args.decode_context
    full = _prompt_ids(engine, max(args.prompt_tokens, ctx))
    ids, before = full[:args.prompt_tokens], full[:ctx]   # the prefill prompt; the decode's context
    contenders = {"ternlm": lambda: _ternlm(engine, ids, args.decode_tokens, before)}
    gguf = resolve(args.model).path
    if "transformers" in args.peers:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=engine.dtype).eval()
        contenders["transformers"] = lambda: _transformers(hf, ids, args.decode_tokens, before)
    worker = None
    if "llamacpp" in args.peers:
        worker = LlamaCppWorker(args.llamacpp_python, gguf, args.threads, max(4096, ctx + args.decode_tokens + 8))

        def llamacpp():
            p = worker.call({"op": "prefill", "ids": ids})["s"]
            d = worker.call({"op": "decode", "ids": before, "n": args.decode_tokens})["s"]
            return len(ids) / p, args.decode_tokens / d
        contenders["llama.cpp"] = llamacpp
    for f in contenders.values():   # warm-up, not counted
        f()
    samples = {name: {"prefill": [], "decode": []} for name in contenders}
    for r in range(args.repeats):
        for name, f in contenders.items():   # A B C A B C: drift on a shared machine hits all alike
            p, d = f()
            samples[name]["prefill"].append(p)
            samples[name]["decode"].append(d)
            print(f"  repeat {r + 1}: {name:13s} prefill {p:8.1f} tok/s  decode {d:6.1f} tok/s", flush=True)
    if worker:
        worker.close()
    med = {n: {k: median(v) for k, v in s.items()} for n, s in samples.items()}
    ratios = {f"ternlm/{n}": {k: med["ternlm"][k] / med[n][k] for k in ("prefill", "decode")}
              for n in med if n != "ternlm"}
    weights = engine.weights_choice.mode
    result = {"command": command_line(), "model": args.model, "dtype": args.dtype, "weights": weights,
              "threads": args.threads, "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
              "decode_context": ctx, "repeats": args.repeats, "rss_mib": _rss_mib(),
              "median_tok_s": med, "ratios": ratios, "samples": samples}
    print(f"\n{'':13s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   (median of {args.repeats}, "
          f"{len(ids)}-token prompt, {args.decode_tokens} decoded after {ctx}, {args.threads} threads, "
          f"weights {weights})")
    for n, m in med.items():
        print(f"{n:13s} {m['prefill']:14.1f} {m['decode']:13.1f}")
    for n, r in ratios.items():
        print(f"{n:24s} prefill x{r['prefill']:.2f}  decode x{r['decode']:.2f}")
    path = write_json(Path(args.out), f"engine-{Path(str(args.model)).name}-{args.dtype}-{weights}-ctx{ctx}.json",
                      result)
    print(f"wrote {path}")
    return result
