"""The benchmark report's figures and page: from each benchmark's own JSON, the numbers the summary
shows (copied, not re-rounded: summary.json holds what the benchmark wrote), and summary.md's tables.
Pure functions of their inputs; nothing here measures or runs anything."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .peers import LLAMACPP, TRANSFORMERS

REUSE, NO_REUSE = "ternlm-reuse", "ternlm-no-reuse"   # bench multiturn's labels
LLAMA_SERVER, LLAMA_BENCH = "llama-server", "llama-bench"    # llama.cpp's own binaries (bench/llamacpp.py)


# ---- figures: bench JSON -> the summary's numbers ----------------------------------------------

def engine_figures(res: dict, where: Path, root: Path) -> dict:
    keep = ("model", "weights", "dtype", "threads", "prompt_tokens", "decode_tokens", "decode_context", "repeats",
            "median_tok_s", "ratios")
    out = {k: res[k] for k in keep}
    s = res.get("sampling")          # ternlm's decode per sampling setting (bench engine --sampling)
    out["decode_sampling"] = res.get("decode_sampling", "greedy")
    out["sampling"] = {k: s[k] for k in ("settings", "decode_tok_s", "over_greedy", "over_greedy_paired")} if s else None
    lb = res.get("llama_bench")      # bench engine --llama-bench: its rows (pp, tg @ d) and ternlm's median over them
    out["llama_bench"] = ({"binary": lb["binary"], "ratios": lb["ratios"],
                           "rows": [{k: r[k] for k in ("test", "avg_tok_s", "stddev_tok_s", "median_tok_s")}
                                    for r in lb["rows"]]} if lb and "ratios" in lb else lb)
    return out


def reuse_figures(res: dict, where: Path, root: Path) -> dict:
    keep = ("model", "dtype", "threads", "prompt_tokens", "reused_tokens", "reuse_fraction", "repeats",
            "median_ttft_s", "speedup_vs_no_reuse", "reuse_over_tail_only")
    out = {k: res[k] for k in keep}
    out["reuse_over_llamacpp_reuse"] = res.get("reuse_over_llamacpp_reuse")
    out["reuse_over_llama_server_reuse"] = res.get("reuse_over_llama_server_reuse")   # --llama-server only
    out["processed_tokens"] = res.get("processed_tokens")
    return out


def turns_after_first(by_turn: dict) -> float | None:
    """Median over turns 2.. of the per-turn median TTFT (bench multiturn's own "turns 2+" figure)."""
    xs = [row["ttft_s_median"] for t, row in by_turn.items() if int(t) > 1 and row["ttft_s_median"] is not None]
    return statistics.median(xs) if xs else None


def multiturn_figures(res: dict, where: Path, root: Path) -> dict:
    later = {n: turns_after_first(rows) for n, rows in res["ttft_by_turn"].items()}
    r, off, peer = later.get(REUSE), later.get(NO_REUSE), later.get(LLAMACPP)
    plot = where / "ttft.png"
    wall = {n: s.get("wall_s") for n, s in res["summary"].items()}     # each contender's whole replay, seconds
    over = {p: wall[REUSE] / wall[p] if wall.get(REUSE) and wall.get(p) else None for p in (LLAMA_SERVER, LLAMACPP)}
    return {"model": res["model"], "dtype": res["dtype"], "settings": res["settings"],
            "wall_s": wall, "reuse_over_llama_server_wall": over[LLAMA_SERVER],
            "reuse_over_llamacpp_wall": over[LLAMACPP],
            "ttft_by_turn": res["ttft_by_turn"],
            "reuse_fraction": {n: s["reuse_fraction"] for n, s in res["summary"].items()},
            "ttft_turns2plus_s": later,
            "speedup_turns2plus_vs_no_reuse": off / r if r and off else None,
            "reuse_over_llamacpp_turns2plus": r / peer if r and peer else None,
            "required_identical": res["all_required_identical"],
            "comparisons": [{k: c[k] for k in ("a", "b", "required", "turns_compared", "turns_equal", "identical")}
                            for c in res["comparisons"]],
            "plot": str(plot.relative_to(root)) if plot.exists() else None}


def tiers_figures(res: dict, where: Path, root: Path) -> dict:
    keep = ("ttft_s_median", "cached_tokens", "prefill_tokens", "reuse_fraction", "speedup_vs_none",
            "identical_logits", "tier")
    bw = ("disk_tier_cold_Bps", "seq_cold_Bps", "disk_tier_cold_over_seq_cold", "disk_tier_warm_Bps")
    return {"model": res["model"], "dtype": res["dtype"], "previous_turn_tokens": res["previous_turn_tokens"],
            "next_turn_tokens": res["next_turn_tokens"], "repeats": res["repeats"],
            "cases": {c: {k: v.get(k) for k in keep} for c, v in res["cases"].items()},
            "bandwidth": {k: res["bandwidth"].get(k) for k in bw},
            "identical": res["identical"], "tiers_ok": res["tiers_ok"]}


def streams_figures(res: dict, where: Path, root: Path) -> dict:
    plot = where / "streams.png"
    return {"model": res["model"], "concurrency": res["concurrency"], "max_tokens": res["max_tokens"],
            "repeats": res["repeats"], "median": res["median"], "ratios": res["ratios"],
            "plot": str(plot.relative_to(root)) if plot.exists() else None}


def grammar_figures(res: dict, where: Path, root: Path) -> dict:
    keep = ("model", "threads", "decode_tokens", "constrained_tokens", "free_tok_s", "json_schema_tok_s", "slowdown",
            "slowdown_paired", "mask_us_per_token")
    return {k: res[k] for k in keep} | {"repeats": len(res["runs"]["free"])}


def spec_figures(res: dict, where: Path, root: Path) -> dict:
    parts = {name: {"contenders": {c: row["median"] for c, row in p["contenders"].items()}, "ratios": p["ratios"],
                    "identity": [i for i in p["identity"] if i["required"]]} for name, p in res["parts"].items()}
    return {"model": res["model"], "settings": res["settings"], "parts": parts,
            "all_required_identical": res["all_required_identical"]}


FIGURES = {"engine": engine_figures, "reuse": reuse_figures, "multiturn": multiturn_figures,
           "tiers": tiers_figures, "streams": streams_figures, "grammar": grammar_figures, "spec": spec_figures}


# ---- the page ----------------------------------------------------------------------------------

def _n(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ms(s) -> str:
    return "–" if s is None else f"{s * 1e3:,.0f} ms" if s >= 0.1 else f"{s * 1e3:,.1f} ms"


def _x(r) -> str:
    return "–" if r is None else f"×{r:.2f}"


def _pct(f) -> str:
    return "–" if f is None else f"{100 * f:.1f}%"


def _commands(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["server_command"]:
            lines.append(r["server_command"] + " &   # llama.cpp's server, the --url contender")
        lines.append(r["command"])
    return ["```", *lines, "```", ""]


def _failed(rows: list[dict]) -> list[str]:
    return [f"**{r['model']}: failed** (exit {r['exit']}{'; ' + r['error'] if r['error'] else ''}; log "
            f"`{r['log']}`)\n" for r in rows if r["status"] != "ok"]


def _engine(rows: list[dict], peers: dict) -> list[str]:
    ok = [r["figures"] for r in rows if r["figures"]]
    f0 = ok[0] if ok else {}
    out = ["## Engine: ternlm vs transformers and llama.cpp", "",
           f"Prefill of a {f0.get('prompt_tokens', '?')}-token prompt and decode of {f0.get('decode_tokens', '?')} "
           f"tokens after {f0.get('decode_context', '?')} tokens of context, tok/s, median of {f0.get('repeats', '?')} "
           f"interleaved rounds (A B C A B C) after a warm-up, one process, the same GGUF file.", "",
           "| model | weights, compute dtype | contender | prefill tok/s | decode tok/s | ternlm ÷ it, prefill | ternlm ÷ it, decode |",
           "|---|---|---|---:|---:|---:|---:|"]
    for f in ok:
        med = f["median_tok_s"]
        label = {"ternlm": "ternlm", "transformers": f"transformers {peers[TRANSFORMERS]['version'] or ''}".strip(),
                 "llama.cpp": f"llama.cpp (llama-cpp-python {peers[LLAMACPP]['version'] or ''})"}
        what = {"ternlm": f"{f['weights']}, {f['dtype']}", "transformers": f"the GGUF dequantized, {f['dtype']}",
                "llama.cpp": "the GGUF's blocks, its own kernels"}
        for name, m in med.items():
            r = f["ratios"].get(f"ternlm/{name}", {})
            out.append(f"| {f['model']} | {what.get(name, '')} | {label.get(name, name)} | {_n(m['prefill'])} | "
                       f"{_n(m['decode'])} | {_x(r.get('prefill'))} | {_x(r.get('decode'))} |")
        for p in (TRANSFORMERS, LLAMACPP):
            if p not in med:
                out.append(f"| {f['model']} | | {peers[p]['text']} | – | – | – | – |")
        out.append(_llama_bench_row(f, peers))
    notes = ["", "ternlm multiplies as `--activations auto` does: int8 activations from 200M parameters up, fp32 below "
             "(issue 59). llama-bench: its own figure (the mean of its repetitions), prefill `pp` of the same prompt "
             "length, decode `tg` after the same context (`@ d`), the same threads and repetitions, after ternlm's "
             "runs."] if any(f.get("llama_bench") for f in ok) else []
    return out + notes + [""] + _sampled(ok) + _failed(rows) + _commands(rows)


def _llama_bench_row(f: dict, peers: dict) -> str:
    lb = f.get("llama_bench")
    if not lb or "ratios" not in lb:
        why = (f"llama-bench: skipped ({lb['skipped']})" if lb and lb.get("skipped") else
               peers.get(LLAMA_BENCH, {}).get("text", "llama-bench: not run"))
        return f"| {f['model']} | | {why} | – | – | – | – |"
    pp, tg = lb["rows"][0], lb["rows"][-1]
    r = lb["ratios"]
    return (f"| {f['model']} | the GGUF's blocks, its own kernels | llama-bench ({pp['test']} / {tg['test']}) | "
            f"{_n(pp['avg_tok_s'])} | {_n(tg['avg_tok_s'])} | {_x(r.get('prefill'))} | {_x(r.get('decode'))} |")


def _sampled(ok: list[dict]) -> list[str]:
    """ternlm's decode at each sampling setting, in the same rounds as the table above, and over greedy's."""
    with_s = [f for f in ok if f.get("sampling") and len(f["sampling"]["decode_tok_s"]) > 1]
    if not with_s:
        return []
    names = list(with_s[0]["sampling"]["decode_tok_s"])
    fields = with_s[0]["sampling"]["settings"]
    out = ["ternlm's decode as clients sample, in the same rounds (one decode per setting each round, seeded; "
           "tok/s, and ÷ greedy as the ratio of medians and, in brackets, the median of each round's ratio). "
           "The peers above decode greedy (llama-bench samples nothing either). Settings: "
           + "; ".join(f"`{n}`: " + ", ".join(f"{k} {v:g}" for k, v in fields[n].items()) for n in names) + ".", "",
           "| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for f in with_s:
        s = f["sampling"]
        cells = []
        for n in names:
            m, r, rp = (s["decode_tok_s"].get(n), (s["over_greedy"] or {}).get(n),
                        (s["over_greedy_paired"] or {}).get(n))
            cells.append(_n(m) + ("" if r is None or n == "greedy" else f" ({_x(r)} [{_x(rp)}])"))
        out.append(f"| {f['model']} | " + " | ".join(cells) + " |")
    return out + [""]


def _reuse(rows: list[dict], peers: dict) -> list[str]:
    out = ["## Prefix reuse: time to first token of turn 2", "",
           "A long synthetic chat; turn 2 = turn 1 + the model's answer + a new user message. *tail-only*: a slot "
           "already holding the reused prefix, timing only the tail's prefill (the floor). Medians of the rounds "
           "after a warm-up round.", "",
           "| model | prompt | reused (fraction) | TTFT reuse | TTFT no reuse | speedup | tail-only | "
           "llama.cpp reuse | llama.cpp no reuse | ternlm reuse ÷ llama.cpp reuse |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["figures"]
        if not f:
            continue
        m = f["median_ttft_s"]
        peer = ((_ms(m.get("llama.cpp reuse")), _ms(m.get("llama.cpp no-reuse"))) if "llama.cpp reuse" in m
                else (peers[LLAMACPP]["text"], "–"))
        out.append(f"| {f['model']} | {f['prompt_tokens']:,} | {f['reused_tokens']:,} ({_pct(f['reuse_fraction'])}) | "
                   f"{_ms(m['reuse'])} | {_ms(m['no-reuse'])} | {_x(f['speedup_vs_no_reuse'])} at "
                   f"{_pct(f['reuse_fraction'])} | {_ms(m['tail-only'])} | {peer[0]} | {peer[1]} | "
                   f"{_x(f['reuse_over_llamacpp_reuse'])} |")
    for r in rows:                 # llama.cpp's own llama-server, when the report was given one
        f = r["figures"]
        if f and f.get("reuse_over_llama_server_reuse") is not None:
            m, done = f["median_ttft_s"], f["processed_tokens"]
            out += ["", f"{f['model']}, llama-server on the same turn-2 ids: reuse {_ms(m['llama-server reuse'])} "
                        f"({done['llama-server reuse']:,} tokens processed; ternlm {done['reuse']:,}), no reuse "
                        f"{_ms(m['llama-server no-reuse'])}; ternlm reuse ÷ llama-server reuse "
                        f"{_x(f['reuse_over_llama_server_reuse'])} (issue 46's target: at most 1/3)"]
    return out + [""] + _failed(rows) + _commands(rows)


def _multiturn(rows: list[dict], peers: dict) -> list[str]:
    out = ["## Multi-turn replay through the HTTP API", "",
           "Synthetic conversations replayed turn by turn (the whole transcript each turn) against "
           "`ternlm serve` with prefix reuse on and off and, when installed, llama.cpp's server on the same GGUF; "
           "sampled as each table says, every request seeded per conversation and turn (the same seed for every "
           "contender). Median time to first token per turn (reused fraction of the prompt over the run in the "
           "header).", ""]
    for p in (LLAMACPP, LLAMA_SERVER):
        if p in peers and not peers[p]["used"]:
            out += [f"{peers[p]['text']}", ""]
    for r in rows:
        f = r["figures"]
        if not f:
            continue
        s = f["settings"]
        names = list(f["ttft_by_turn"])
        sampled = s.get("sampling_text", "greedy")      # older results: greedy
        out += [f"**{f['model']}** ({f['dtype']}; {s['conversations']} conversation(s) × {s['turns']} turns, "
                f"max {s['max_tokens']} tokens, {sampled}):", "",
                "| turn | " + " | ".join(f"{n} ({_pct(f['reuse_fraction'].get(n))} reused)" for n in names) + " |",
                "|---:|" + "---:|" * len(names)]
        turns = sorted({int(t) for rows_ in f["ttft_by_turn"].values() for t in rows_})
        for t in turns:
            cells = []
            for n in names:
                row = f["ttft_by_turn"][n].get(str(t))
                cells.append("–" if row is None else f"{_ms(row['ttft_s_median'])} ({_pct(row['reuse_fraction'])})")
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        same = [c for c in f["comparisons"] if c["required"]]
        verdict = "; ".join(f"{c['a']} vs {c['b']}: {c['turns_equal']}/{c['turns_compared']} turns identical"
                            for c in same) or "no required pair"
        out += ["", f"Turns 2+: reuse {_x(f['speedup_turns2plus_vs_no_reuse'])} faster to first token than no reuse"
                + (f", ternlm reuse ÷ llama.cpp = {_x(f['reuse_over_llamacpp_turns2plus'])}"
                   if f["reuse_over_llamacpp_turns2plus"] else "")
                + f". Output {'identical' if f['required_identical'] else '**DIFFERS**'} ({verdict}).", ""]
        wall = f.get("wall_s") or {}
        if f.get("reuse_over_llama_server_wall") or f.get("reuse_over_llamacpp_wall"):
            out += ["Whole replay: " + ", ".join(f"{n} {_n(w)} s" for n, w in wall.items() if w) + "; ternlm reuse ÷ "
                    + "; ÷ ".join(f"{name} **{_x(f[k])}**" for name, k in (
                        (LLAMA_SERVER, "reuse_over_llama_server_wall"), (LLAMACPP, "reuse_over_llamacpp_wall"))
                        if f.get(k)) + ".", ""]
        if f["plot"]:
            out += [f"![TTFT by turn, {f['model']}]({f['plot']})", ""]
    return out + _failed(rows) + _commands(rows)


def _tiers(rows: list[dict], peers: dict) -> list[str]:
    out = ["## KV tiers: where the next turn's prefix comes from", ""]
    for r in rows:
        f = r["figures"]
        if not f:
            continue
        out += [f"**{f['model']}** ({f['dtype']}): previous turn {f['previous_turn_tokens']:,} tokens, next turn "
                f"{f['next_turn_tokens']:,}; medians of {f['repeats']}. Logits bit-identical to a cold prefill in "
                f"every case: {'yes' if f['identical'] else '**no**'}; restored from the tier named: "
                f"{'yes' if f['tiers_ok'] else '**no**'}.", "",
                "| prefix in | TTFT | reused | prefilled | speedup vs none |", "|---|---:|---:|---:|---:|"]
        for case, c in f["cases"].items():
            out.append(f"| {case} | {_ms(c['ttft_s_median'])} | {c['cached_tokens']:,} ({_pct(c['reuse_fraction'])}) | "
                       f"{c['prefill_tokens']:,} | {_x(c['speedup_vs_none'])} |")
        b = f["bandwidth"]
        mbs = lambda v: "–" if v is None else f"{v / 1e6:,.0f} MB/s"   # noqa: E731
        out += ["", f"Disk tier load (page cache dropped): {mbs(b['disk_tier_cold_Bps'])}, sequential read of the "
                f"same disk {mbs(b['seq_cold_Bps'])} ({_x(b['disk_tier_cold_over_seq_cold'])}).", ""]
    return out + _failed(rows) + _commands(rows)


def _streams(rows: list[dict], peers: dict) -> list[str]:
    out = ["## Concurrent streams: batched decode", "",
           "N greedy streams released together through the HTTP API; aggregate decode tok/s while all N stream. "
           "The peer is llama.cpp's `llama-server` with as many parallel slots (`--llama-server BIN`): "
           "llama-cpp-python's server serves one request at a time, so it is no batching peer.", ""]
    if not peers[LLAMA_SERVER]["used"]:
        out += [peers[LLAMA_SERVER]["text"], ""]
    for r in rows:
        f = r["figures"]
        if not f:
            continue
        lo = str(f["concurrency"][0])
        out += [f"**{f['model']}** ({f['max_tokens']} tokens a stream, median of {f['repeats']}):", "",
                f"| contender | N | aggregate tok/s | vs N={lo} | TTFT p50 | ITL p50 | ITL p99 | ternlm ÷ it |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        over = f["ratios"].get("ternlm_over", {})
        for name, per in f["median"].items():
            for n, m in per.items():
                out.append(f"| {name} | {n} | {_n(m['steady_tok_s'])} | {_x(f['ratios']['vs_lowest'][name].get(n))} | "
                           f"{_ms(m['ttft_p50_s'])} | {_ms(m['itl_p50_s'])} | {_ms(m['itl_p99_s'])} | "
                           f"{_x(over.get(name, {}).get(n))} |")
        out.append("")
        if f["plot"]:
            out += [f"![streams, {f['model']}]({f['plot']})", ""]
    return out + _failed(rows) + _commands(rows)


def _grammar(rows: list[dict], peers: dict) -> list[str]:
    out = ["## Structured output: what a JSON-schema grammar costs", "",
           "One chat prompt, greedy, the same number of tokens decoded free (`ignore_eos`) and under a `json_schema` "
           "grammar, interleaved A B A B, medians; the mask alone timed over the constrained answer's tokens.", "",
           "| model | tokens | free tok/s | json_schema tok/s | slowdown (medians) | slowdown (paired A/B) | mask µs/token |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = r["figures"]
        if f:
            out.append(f"| {f['model']} | {f['constrained_tokens']} of {f['decode_tokens']} | {_n(f['free_tok_s'])} | "
                       f"{_n(f['json_schema_tok_s'])} | {_pct(f['slowdown'])} | {_pct(f['slowdown_paired'])} | "
                       f"{_n(f['mask_us_per_token'], 0)} |")
    return out + [""] + _failed(rows) + _commands(rows)


def _spec(rows: list[dict], peers: dict) -> list[str]:
    out = ["## Speculative decoding (prompt lookup)", "",
           "`ternlm serve --speculative off|auto` (and llama-server with each n-gram --spec-type when given) on a "
           "code-editing replay whose answers are the whole file, and on MT-Bench chats. Decode tok/s from the "
           "servers' timings; acceptance = accepted / drafted.", "",
           "| model | part | contender | decode tok/s | total s | acceptance | ternlm on ÷ off |",
           "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        f = r["figures"]
        if not f:
            continue
        for name, p in f["parts"].items():
            ratio = p["ratios"].get("on_over_off_server_tok_s")
            for c, m in p["contenders"].items():
                out.append(f"| {f['model']} | {name} | {c} | {_n(m['server_tok_s'])} | {_n(m['wall_s'])} | "
                           f"{_pct(m['acceptance'])} | {_x(ratio) if c == 'ternlm spec on' else ''} |")
        if not f["all_required_identical"]:
            out.append(f"\n**{f['model']}: ternlm's text with speculation differs from without.**")
    return out + [""] + _failed(rows) + _commands(rows)


_SECTIONS = {"engine": _engine, "reuse": _reuse, "multiturn": _multiturn, "tiers": _tiers, "streams": _streams,
             "grammar": _grammar, "spec": _spec}


# ---- RESULTS' Summary: which rows this run reproduced --------------------------------------------

def _per_model(fig: Callable[[dict], str | None]) -> Callable[[list[dict]], str | None]:
    """A row's figure: `model fig` for each model whose figures give one, joined by `; `."""
    def f(rows: list[dict]) -> str | None:
        got = [(r["model"], fig(r["figures"])) for r in rows if r["figures"]]
        return "; ".join(f"{m} {x}" for m, x in got if x) or None
    return f


def _fig_llama_bench(f: dict) -> str | None:
    r = (f.get("llama_bench") or {}).get("ratios")
    return f"{_x(r['prefill'])} / {_x(r['decode'])} (÷ llama-bench, {f['prompt_tokens']:,} tokens)" if r else None


def _fig_reuse(f: dict) -> str | None:
    bits = [f"{_x(f['speedup_vs_no_reuse'])} sooner than without reuse at {_pct(f['reuse_fraction'])} reused"]
    if f.get("reuse_over_llamacpp_reuse") is not None:
        bits.append(f"÷ llama.cpp's reuse {_x(f['reuse_over_llamacpp_reuse'])}")
    if f.get("reuse_over_llama_server_reuse") is not None:
        bits.append(f"÷ llama-server {_x(f['reuse_over_llama_server_reuse'])}")
    return ", ".join(bits)


def _fig_replay(f: dict) -> str | None:
    r = f.get("reuse_over_llama_server_wall")
    if r is None:
        return None
    return (f"{_x(r)} ({_pct(f['reuse_fraction'].get(REUSE))} reused; "
            f"{f['settings'].get('sampling_text', 'greedy')})")


def _fig_spec(f: dict) -> str | None:
    bits = []
    for name, p in f["parts"].items():
        r = p["ratios"]
        if r.get("on_over_off_server_tok_s") is not None:
            bits.append(f"{name} {_x(r['on_over_off_server_tok_s'])} plain decoding"
                        + (f", {_x(r['on_over_llama_server_best'])} llama-server's best"
                           if r.get("on_over_llama_server_best") is not None else ""))
    return "; ".join(bits) + ("" if f["all_required_identical"] else " (**text differs on/off**)") if bits else None


def _fig_sampling(f: dict) -> str | None:
    s = f.get("sampling")
    over = {n: r for n, r in ((s or {}).get("over_greedy") or {}).items() if n != "greedy" and r is not None}
    return "sampled decode " + ", ".join(f"{n} {_x(r)}" for n, r in over.items()) + " of greedy" if over else None


@dataclass(frozen=True)
class SummaryRow:
    """One row of benchmarks/RESULTS.md's Summary table and what reproduces it here."""
    id: str
    claim: str                     # what it measures, as the Summary's first column says it
    part: str | None               # the report part (`ternlm bench PART`) that produces it; None: none does
    models: tuple[str, ...] = ()   # the Summary's models; (): every model the part ran
    peer: str | None = None        # the contender the figure divides by: LLAMA_BENCH, LLAMA_SERVER; None: ternlm alone
    figure: Callable[[list[dict]], str | None] | None = None   # the part's rows -> this run's figure
    needs_isa: str | None = None   # the ISA class its figure needs (cpu.CLASSES), None: any host
    outside: str = ""              # part None: why the report does not run it and what does


# The Summary's 11 rows, in its order: the one place that says which part and contender reproduce each.
SUMMARY_ROWS = (
    SummaryRow("engine", "prefill / decode ÷ llama.cpp, 1,024 tokens: smollm2-135m; qwen2.5-coder-0.5b", "engine",
               ("smollm2-135m", "qwen2.5-coder-0.5b"), LLAMA_BENCH, _per_model(_fig_llama_bench)),
    SummaryRow("engine-1.5b", "qwen2.5-coder-1.5b ÷ llama-bench, prefill and decode after 1,024 (after 4,000: not in the report)", "engine",
               ("qwen2.5-coder-1.5b",), LLAMA_BENCH, _per_model(_fig_llama_bench)),
    SummaryRow("reuse", "turn 2 of a long chat: ÷ no reuse, ÷ llama.cpp's own reuse", "reuse", (), None,
               _per_model(_fig_reuse)),
    SummaryRow("replay", "multi-turn replay ÷ llama-server (whole replay time)", "multiturn", (), LLAMA_SERVER,
               _per_model(_fig_replay)),
    SummaryRow("spec", "speculative decoding (prompt lookup): ÷ plain decoding, ÷ llama-server's n-gram", "spec", (),
               LLAMA_SERVER, _per_model(_fig_spec)),
    SummaryRow("hybrid", "hybrid qwen35, 30-turn replays ÷ llama-server TTFT", None,
               outside="model not cached: the 24-layer qwen35 Q8_0 file is not in the registry; RESULTS' "
                       "Hybrid models section gives its commands"),
    SummaryRow("moe", "30B-A3B MoE (18.6 GB) under an 8 GiB cap ÷ llama-server", None,
               outside="model not cached: the 30B-A3B file (18.6 GB) is not in the registry; RESULTS' Mixtures of "
                       "experts section gives its commands"),
    SummaryRow("sliding", "gemma3-270m, sliding windows: decode at 16,000 tokens, 30-turn replays", None,
               needs_isa="amx", outside="no report part (decode after 16,000 tokens and 30-turn replays: RESULTS' "
                                        "Sliding windows section)"),
    SummaryRow("int8-quality", "int8 activations, next-token agreement with the dense model", None,
               outside="no report part: `ternlm bench quality -m MODEL --tokens 2000 --llama-perplexity auto`"),
    SummaryRow("sampling", "sampling as clients send it: sampled decode ÷ greedy", "engine", (), None,
               _per_model(_fig_sampling)),
    SummaryRow("kv-q8", "--kv-dtype q8_0: bytes a token, perplexity and decode after 16,384 tokens", None,
               outside="no report part (a 16,384-token decode context takes ~25 min a side on 2 cores): RESULTS' "
                       "8-bit KV section gives its commands"),
)


def summary_rows(summary: dict, pending: list[str] = ()) -> list[dict]:
    """Each SUMMARY_ROWS row against this run: {"id", "claim", "status": "reproduced" | "not run", "figure",
    "why"} (why: what kept it, or the models it kept, from running). Pure."""
    rep, peers, parts = summary["report"], summary["peers"], summary["parts"]
    cls = rep["host"]["isa_class"]
    asked = rep.get("parts_asked", list(parts))
    in_run = [*rep.get("models_asked", []), *rep.get("big_models", [])]
    cached = set(rep.get("models_cached", []))
    out = []
    for row in SUMMARY_ROWS:
        why: list[str] = []
        figure = None
        if row.part is None:
            why.append(row.outside)
        elif rep["mode"] == "quick":
            why.append("--quick (a smoke test: no peers, smollm2-135m only, tiny sizes)")
        elif row.part not in asked:
            why.append(f"part {row.part} not in this run"
                       + (" (opt-in: --only ...,spec)" if row.part == "spec" else " (--only)"))
        if row.needs_isa and cls != row.needs_isa:
            why.append(f"ISA not present: its figure is {row.needs_isa}'s (this host: {cls})")
        if not why:
            mine = [r for r in parts.get(row.part, []) if not row.models or r["model"] in row.models]
            for m in row.models:
                if m in (r["model"] for r in mine):
                    continue
                if f"{row.part}-{m}" in pending:
                    why.append(f"{m}: not run yet (report interrupted)")
                elif m not in cached:
                    why.append(f"model not cached: {m} (ternlm pull {m})")
                else:
                    why.append(f"{m} not in --models")
            if row.peer and not peers.get(row.peer, {}).get("used"):
                why.append(peers.get(row.peer, {}).get("text", f"{row.peer}: not run"))
            why += [f"{r['model']}: failed (log {r['log']})" for r in mine if r["status"] != "ok"]
            figure = row.figure([r for r in mine if r["status"] == "ok"]) if mine else None
            if not mine and not row.models:
                why.append(f"{row.part}: not run yet (report interrupted)" if any(k.startswith(row.part + "-")
                                                                                  for k in pending) else "no model ran")
        out.append({"id": row.id, "claim": row.claim, "part": row.part, "peer": row.peer,
                    "status": "reproduced" if figure else "not run", "figure": figure, "why": why})
    return out


def summary_rows_text(rows: list[dict]) -> str:
    """The Summary rows as summary.md's last section prints them (and the report's end on stdout)."""
    out = ["## Summary rows", "",
           "benchmarks/RESULTS.md's Summary, row by row: this run's figure where it reproduced the row (ternlm ÷ "
           "the peer, this host), else why not.", "", "| row | claim | here |", "|---|---|---|"]
    for r in rows:
        here = (f"**{r['figure']}**" + (f" (not run: {'; '.join(r['why'])})" if r["why"] else "")
                if r["status"] == "reproduced" else "not run: " + "; ".join(r["why"]))
        out.append(f"| {r['id']} | {r['claim']} | {here} |")
    return "\n".join(out) + "\n"


def _load_line(rep: dict) -> list[str]:
    load, cores = rep.get("loadavg") or {}, rep["host"]["cores"]
    if load.get("start") is None:
        return []
    busy = max(load["start"], load.get("now") or 0) > cores
    return [f"- load average (1 min) at start / end: {load['start']:.1f} / {_n(load.get('now'))} on {cores} cores"
            + (": **other work shared the CPU**, absolute figures are low; ratios within a table hold better"
               if busy else "")]


def markdown(summary: dict) -> str:
    """summary.md from summary.json: the context lines, one section per part run, the run's timing."""
    rep, peers, h = summary["report"], summary["peers"], summary["report"]["host"]
    commit = rep["commit"] + (" (with uncommitted changes)" if rep["uncommitted_changes"] else "") + \
        (f"; HEAD moved to {rep['commit_now']} while it ran" if rep.get("commit_now") else "")
    pending = rep.get("pending", [])
    took = (f"{rep['seconds'] / 60:.1f} min here" if not pending else
            f"{rep['seconds'] / 60:.1f} min here for the runs below; {len(pending)} not run")
    out = [f"# ternlm benchmark summary ({rep['mode']})", "",
           f"- date: {rep['date']}", f"- commit: {commit}",
           f"- host: {h['cpu']}, {h['cores']} cores, {h['mem_gib']} GiB; ISA class {h['isa_class']} (ternlm computes "
           f"as {h['compute_class_text']}); torch {h['torch']}",
           f"- threads: {rep['threads']} for every contender; {rep['env'] or 'OpenMP wait policy: default'}",
           *_load_line(rep),
           "- peers: " + "; ".join(p["text"] for p in peers.values()),
           f"- regenerate: `{rep['command']}` ({took})", "",
           "Each table's command reruns it alone. Figures are medians of interleaved runs on this host: compare "
           "ratios within a table; absolute figures move between hosts and with other load on the machine.", ""]
    for part, rows in summary["parts"].items():
        out += _SECTIONS[part](rows, peers)
    out += ["## This run", "", "| part | model | seconds | status |", "|---|---|---:|---|"]
    for part, rows in summary["parts"].items():
        for r in rows:
            out.append(f"| {part} | {r['model']} | {r['seconds']:.0f} | {r['status']} |")
    for key in pending:
        out.append(f"| {key} | | | not run |")
    out.append("")
    return "\n".join(out) + "\n" + summary_rows_text(summary.get("summary_rows") or summary_rows(summary, pending))
