"""`ternlm bench engine`: prefill and decode throughput of ternlm, transformers and llama.cpp on the
same GGUF, same dtype class, same threads, interleaved A B C A B C, medians and ratios from one run;
and what loading cost each: time, peak and steady resident set above the process's baseline.

ternlm's decode is measured at each --sampling setting (sampling_settings.py: greedy, t1 = OpenAI's default
temperature, t0.7-p0.95-pres0.5 = a chat client's ...), interleaved with the rest (one decode per setting in
every round), medians and each setting's ratio to greedy. The first setting is the one behind
median_tok_s.ternlm.decode and the peer ratios. The peers decode greedy (argmax) whatever --sampling says:
llama-bench's tg and the worker's decode sample nothing either.

-m is a registry name or any local .gguf path (or HF folder: no llama.cpp then); results are named
after the registry name or the file's stem."""
from __future__ import annotations

import random
import shlex
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .common import (BenchModel, LoadMemory, bench_model, command_line, kv_budget_bytes, measure_load, median,
                     proc_status, synthetic_text, write_json)
from .llamacpp import LLAMA_BENCH, LlamaCppWorker, format_bench_row, llama_bench, resolve_bin
from .sampling_settings import GREEDY, Sampling

_MIB = 1 << 20


def _prompt_ids(engine, n: int) -> list[int]:
    text = synthetic_text(random.Random(0), n * 2)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"synthetic text too short: {len(ids)} of {n} tokens")
    return ids[:n]


def _ternlm(engine, ids: list[int], decode_n: int, before: list[int], traffic: list[dict],
            sampling: Sampling = Sampling(), seed: int = 0) -> tuple[float, float]:
    """(prefill tok/s of ids, decode tok/s after the prompt `before` at `sampling`) through the engine API,
    reuse off. Side effect (a mixture of experts): appends to `traffic` the expert store's counters
    (moe.ExpertStats) of the prefill of ids and of the decode steps alone (after `before`'s prefill), with
    decode_tokens and the prefill's seconds (its share spent waiting for expert reads: the read/compute overlap)."""
    engine.prefix_reuse = False
    store = engine.model.experts
    start = store.stats.snapshot() if store is not None else None
    c = engine.generate(ids, max_tokens=1)
    prefill = c.timings.prefill_tokens / c.timings.prefill_s
    used = {"prefill": store.stats.minus(start), "prefill_s": c.timings.prefill_s} if store is not None else None
    decode, decoded = _decode(engine, before, decode_n, sampling, seed)
    if used is not None:
        traffic.append(used | decoded)
    return prefill, decode


def _decode(engine, before: list[int], decode_n: int, sampling: Sampling, seed: int) -> tuple[float, dict | None]:
    """Decode tok/s of `decode_n` tokens after the prompt `before` at `sampling` (seeded: every round draws
    the same tokens), reuse off; and a mixture of experts' store counters of the decode steps alone."""
    engine.prefix_reuse = False
    store = engine.model.experts
    mark = None
    # one token a step, speculation off: the figure beside llama-bench's tg (which drafts nothing) is the step's
    for ev in engine.stream(before, max_tokens=decode_n + 1, ignore_eos=True, speculative=False,
                            **sampling.engine_kwargs(seed)):
        if mark is None and store is not None:    # the first token is out: `before`'s prefill is done
            mark = store.stats.snapshot()
        c = ev
    used = {"decode": store.stats.minus(mark), "decode_tokens": c.timings.decode_tokens} if store is not None else None
    return c.timings.decode_tokens / c.timings.decode_s, used


def _by_sampling(settings: list[Sampling], decode: dict[str, list[float]]) -> dict:
    """ternlm's decode per setting: medians, and each one over greedy's (when greedy ran) as a ratio of the
    medians and as the median of the rounds' own ratios (paired: a round's drift hits both)."""
    med = {s.name: median(decode[s.name]) for s in settings}
    base = decode.get(GREEDY)
    return {"settings": {s.name: s.openai_fields() for s in settings}, "decode_tok_s": med, "samples": decode,
            "over_greedy": {n: m / med[GREEDY] for n, m in med.items()} if base else None,
            "over_greedy_paired": {n: median([a / b for a, b in zip(xs, base)]) for n, xs in decode.items()}
            if base else None}


def _print_sampling(s: dict, decode_n: int, ctx: int) -> None:
    print(f"\nternlm decode by sampling ({decode_n} tokens after {ctx}, one token a step, seeded; the peers above "
          f"decode greedy: llama-bench and transformers' argmax loop sample nothing)")
    print(f"{'setting':24s} {'decode tok/s':>13s} {'/ greedy':>9s} {'paired':>8s}   request fields")
    for n, m in s["decode_tok_s"].items():
        r, rp = (s["over_greedy"] or {}).get(n), (s["over_greedy_paired"] or {}).get(n)
        print(f"{n:24s} {m:13.1f} {'-' if r is None else f'x{r:.3f}':>9s} {'-' if rp is None else f'x{rp:.3f}':>8s}"
              f"   {' '.join(f'{k}={v:g}' for k, v in s['settings'][n].items())}")


def _expert_traffic(traffic: list[dict], prompt_tokens: int) -> dict | None:
    """The timed repeats' mean expert-store traffic: per prefill of the prompt and per decoded token."""
    if not traffic:
        return None
    n = len(traffic)
    prefill = {k: sum(t["prefill"][k] for t in traffic) / n for k in traffic[0]["prefill"]}
    tokens = sum(t["decode_tokens"] for t in traffic)
    decode = {k: sum(t["decode"][k] for t in traffic) / max(tokens, 1) for k in traffic[0]["decode"]}
    return {"per_prefill": prefill, "prefill_tokens": prompt_tokens, "per_decode_token": decode,
            "prefill_s": sum(t["prefill_s"] for t in traffic) / n}


def _print_experts(e: dict, engine) -> None:
    st = engine.expert_stats()
    held = (f"streamed, cache {st['budget'] / _MIB:.0f} MiB" if st["streamed"] else "resident") + \
        f", {st['resident_bytes'] / _MIB:.0f} MiB of experts held"
    p, d = e["per_prefill"], e["per_decode_token"]
    print(f"\nternlm experts ({held}): per prefill of {e['prefill_tokens']} tokens: hits {p['hits']:.0f}, "
          f"misses {p['misses']:.0f}, read {p['bytes_read'] / _MIB:.1f} MiB; per decoded token: hits {d['hits']:.1f}, "
          f"misses {d['misses']:.1f}, read {d['bytes_read'] / _MIB:.2f} MiB")
    if st["streamed"]:     # the steps' wait for reads and conversions, against the prefill's time
        print(f"ternlm misses on the step's path: prefill waited {p['read_wait_us'] / 1e3:.0f} ms for reads and "
              f"converted {p['convert_us'] / 1e3:.0f} ms of {e['prefill_s'] * 1e3:.0f} ms; a decoded token "
              f"{d['read_wait_us'] / 1e3:.1f} / {d['convert_us'] / 1e3:.1f} ms")


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
    return proc_status().get("VmRSS", float("nan")) / 1024


def _load_transformers(m: BenchModel, dtype: torch.dtype):
    """The same file through transformers: a GGUF dequantized by its own loader, or the HF folder."""
    from transformers import AutoModelForCausalLM
    if m.gguf is not None:
        return AutoModelForCausalLM.from_pretrained(str(m.path.parent), gguf_file=m.path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(m.path), dtype=dtype).eval()


def _load_row(mem: LoadMemory, budget_bytes: int) -> dict:
    """A contender's load figures, with peak and steady above baseline over `budget_bytes`."""
    return mem.as_dict() | {"budget_mib": budget_bytes / _MIB,
                            "peak_over_budget": mem.peak_above_mib * _MIB / budget_bytes,
                            "steady_over_budget": mem.steady_above_mib * _MIB / budget_bytes}


def _llamacpp_load(worker: LlamaCppWorker, load_s: float) -> dict:
    """llama.cpp's resident set as its worker process reports it: the whole process (Python and
    llama_cpp's import included: no baseline), the model's file memory-mapped as llama.cpp does."""
    st = worker.status()
    return {"load_s": load_s, "process_rss_mib": st.get("VmRSS", 0) / 1024,
            "process_peak_mib": st.get("VmHWM", 0) / 1024, "file_mib": st.get("RssFile", 0) / 1024,
            "note": "process start + load; whole process incl. Python; VmHWM is the process's lifetime peak"}


def _print_load(load: dict, m: BenchModel, kv_bytes: int, ctx: int) -> None:
    t = load["ternlm"]
    print(f"\nload: RSS above the process's baseline before the load ({t['baseline_mib']:.0f} MiB: Python, torch, "
          f"ternlm imported; transformers: above its own, ternlm's model loaded); peak: {t['peak_method']}; "
          f"budget: file {m.file_bytes / _MIB:.0f} MiB + KV {kv_bytes / _MIB:.0f} MiB (1 slot x {ctx} tokens) for "
          f"ternlm, the file for transformers")
    print(f"{'':13s} {'load s':>7s} {'peak MiB':>9s} {'steady MiB':>11s} {'budget MiB':>11s} {'peak/budget':>12s} "
          f"{'steady/budget':>14s} {'steady/file':>12s}")
    for n in ("ternlm", "transformers"):
        if n in load:
            r = load[n]
            print(f"{n:13s} {r['load_s']:7.2f} {r['peak_above_baseline_mib']:9.0f} {r['steady_above_baseline_mib']:11.0f}"
                  f" {r['budget_mib']:11.0f} {r['peak_over_budget']:12.2f} {r['steady_over_budget']:14.2f} "
                  f"{r['steady_above_baseline_mib'] * _MIB / m.file_bytes:12.2f}")
    if "llama.cpp" in load:
        r = load["llama.cpp"]
        print(f"{'llama.cpp':13s} {r['load_s']:7.2f}   whole process: RSS {r['process_rss_mib']:.0f} MiB "
              f"({r['file_mib']:.0f} of it mapped files), lifetime peak {r['process_peak_mib']:.0f} MiB")


# llama.cpp's flags for the KV format ternlm runs (--kv-dtype): its quantized V cache needs flash attention
LLAMA_KV_FLAGS = {"q8_0": ("-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0")}


def _llama_bench(args, model: BenchModel, prompt_tokens: int, ctx: int, ternlm: dict, kv_dtype: str) -> dict:
    """llama.cpp's llama-bench on the same file, threads and repetitions, after ternlm's runs (one engine at a
    time on the cores): prefill of the prompt (pp, no context), decode after the decode context (tg @ d).
    Its figure is its own: the mean of its repetitions (its table's); ratios are ternlm's median over it."""
    binary = args.llama_bench
    if model.gguf is None:
        print(f"llama-bench: skipped ({model.path} is a Hugging Face folder, not a GGUF file)")
        return {"skipped": "not a GGUF file"}
    extra = [*LLAMA_KV_FLAGS.get(kv_dtype, ()), *shlex.split(getattr(args, "llama_bench_args", "") or "")]
    pp = llama_bench(binary, model.gguf, args.threads, args.repeats, prompt_tokens, 0, extra=extra)
    tg = llama_bench(binary, model.gguf, args.threads, args.repeats, 0, args.decode_tokens, ctx, extra=extra)
    rows = pp + tg
    print(f"\nllama-bench ({binary}; mean ± stddev of {args.repeats}, as its table):")
    for r in rows:
        print(f"  {format_bench_row(r)}")
    ratios = {"prefill": ternlm["prefill"] / pp[0].avg_tok_s, "decode": ternlm["decode"] / tg[0].avg_tok_s}
    print(f"ternlm/llama-bench       prefill x{ratios['prefill']:.2f}  decode x{ratios['decode']:.2f}")
    return {"binary": binary, "extra_args": extra, "rows": [asdict(r) for r in rows], "ratios": ratios}


def run(args, load_engine) -> dict:
    import ternlm.engine.core  # noqa: F401  imported before the baseline: the baseline holds no model, only code
    torch.set_num_threads(args.threads)
    if getattr(args, "llama_bench", None):          # a missing binary fails now, not after ternlm's runs
        args.llama_bench = resolve_bin(LLAMA_BENCH, args.llama_bench)
    model = bench_model(args.model)
    engine, mem = measure_load(lambda: load_engine(args))
    kv_bytes = kv_budget_bytes(engine)
    load = {"ternlm": _load_row(mem, model.file_bytes + kv_bytes)}
    ctx = args.decode_context
    full = _prompt_ids(engine, max(args.prompt_tokens, ctx))
    ids, before = full[:args.prompt_tokens], full[:ctx]   # the prefill prompt; the decode's context
    traffic: list[dict] = []     # a mixture of experts' store counters per ternlm call (_ternlm)
    settings, seed = args.sampling, args.seed
    contenders = {"ternlm": lambda: _ternlm(engine, ids, args.decode_tokens, before, traffic, settings[0], seed)}
    # the other settings' decodes, right after ternlm's in every round: A A' A'' B C, A A' A'' B C
    sampled = {s.name: (lambda s=s: _decode(engine, before, args.decode_tokens, s, seed)[0]) for s in settings[1:]}
    if "transformers" in args.peers:
        hf, hf_mem = measure_load(lambda: _load_transformers(model, engine.dtype))
        load["transformers"] = _load_row(hf_mem, model.file_bytes)   # its KV grows per request: no budget
        contenders["transformers"] = lambda: _transformers(hf, ids, args.decode_tokens, before)
    worker = None
    if "llamacpp" in args.peers and model.gguf is None:
        print(f"llama.cpp: skipped ({model.path} is a Hugging Face folder, not a GGUF file)")
    elif "llamacpp" in args.peers:
        t0 = time.perf_counter()
        worker = LlamaCppWorker(args.llamacpp_python, model.gguf, args.threads, max(4096, ctx + args.decode_tokens + 8))
        load["llama.cpp"] = _llamacpp_load(worker, time.perf_counter() - t0)

        def llamacpp():
            p = worker.call({"op": "prefill", "ids": ids})["s"]
            d = worker.call({"op": "decode", "ids": before, "n": args.decode_tokens})["s"]
            return len(ids) / p, args.decode_tokens / d
        contenders["llama.cpp"] = llamacpp
    for f in [*contenders.values(), *sampled.values()]:   # warm-up, not counted
        f()
    traffic.clear()
    samples = {name: {"prefill": [], "decode": []} for name in contenders}
    by_setting: dict[str, list[float]] = {s.name: [] for s in settings}
    for r in range(args.repeats):
        for name, f in contenders.items():   # A B C A B C: drift on a shared machine hits all alike
            p, d = f()
            samples[name]["prefill"].append(p)
            samples[name]["decode"].append(d)
            print(f"  repeat {r + 1}: {name:13s} prefill {p:8.1f} tok/s  decode {d:6.1f} tok/s"
                  + (f" ({settings[0].name})" if name == "ternlm" and len(settings) > 1 else ""), flush=True)
            if name != "ternlm":
                continue
            by_setting[settings[0].name].append(d)
            for n, g in sampled.items():
                d = g()
                by_setting[n].append(d)
                print(f"  repeat {r + 1}: {'ternlm':13s} {'':23s} decode {d:6.1f} tok/s ({n})", flush=True)
    if worker:
        worker.close()
    med = {n: {k: median(v) for k, v in s.items()} for n, s in samples.items()}
    ratios = {f"ternlm/{n}": {k: med["ternlm"][k] / med[n][k] for k in ("prefill", "decode")}
              for n in med if n != "ternlm"}
    weights = engine.weights_choice.mode
    result = {"command": command_line(), "model": model.label, "model_path": str(model.path), "file_bytes": model.file_bytes,
              "dtype": args.dtype, "weights": weights,
              "threads": args.threads, "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
              "decode_context": ctx, "repeats": args.repeats, "rss_mib": _rss_mib(),
              "ctx": engine.ctx, "kv_budget_bytes": kv_bytes, "load": load,
              "median_tok_s": med, "ratios": ratios, "samples": samples,
              # median_tok_s.ternlm.decode is at sampling's first setting; the peers decode greedy
              "decode_sampling": settings[0].name, "seed": seed, "peers_sampling": GREEDY,
              "sampling": _by_sampling(settings, by_setting),
              "experts": _expert_traffic(traffic, len(ids))}
    print(f"\n{'':13s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   (median of {args.repeats}, "
          f"{len(ids)}-token prompt, {args.decode_tokens} decoded after {ctx}, {args.threads} threads, "
          f"weights {weights}; decode: ternlm {settings[0].name}, peers greedy)")
    for n, m in med.items():
        print(f"{n:13s} {m['prefill']:14.1f} {m['decode']:13.1f}")
    for n, r in ratios.items():
        print(f"{n:24s} prefill x{r['prefill']:.2f}  decode x{r['decode']:.2f}")
    if len(settings) > 1 or not settings[0].greedy:
        _print_sampling(result["sampling"], args.decode_tokens, ctx)
    if result["experts"] is not None:
        _print_experts(result["experts"], engine)
    _print_load(load, model, kv_bytes, engine.ctx)
    if getattr(args, "llama_bench", None):
        result["llama_bench"] = _llama_bench(args, model, len(ids), ctx, med["ternlm"], engine.kv_dtype)
    named = "" if [s.name for s in settings] == [GREEDY] else "-" + "+".join(s.name for s in settings)
    path = write_json(Path(args.out), f"engine-{model.label}-{args.dtype}-{weights}-ctx{ctx}{named}.json", result)
    print(f"wrote {path}")
    return result
