"""The benchmark report's figures and page: from each benchmark's own JSON, the numbers the summary
shows (copied, not re-rounded: summary.json holds what the benchmark wrote), and summary.md's tables.
Pure functions of their inputs; nothing here measures or runs anything."""
from __future__ import annotations

import statistics
from pathlib import Path

from .peers import LLAMACPP, TRANSFORMERS

REUSE, NO_REUSE = "ternlm-reuse", "ternlm-no-reuse"   # bench multiturn's labels
LLAMA_SERVER = "llama-server"


# ---- figures: bench JSON -> the summary's numbers ----------------------------------------------

def engine_figures(res: dict, where: Path, root: Path) -> dict:
    keep = ("model", "weights", "dtype", "threads", "prompt_tokens", "decode_tokens", "decode_context", "repeats",
            "median_tok_s", "ratios")
    out = {k: res[k] for k in keep}
    s = res.get("sampling")          # ternlm's decode per sampling setting (bench engine --sampling)
    out["decode_sampling"] = res.get("decode_sampling", "greedy")
    out["sampling"] = {k: s[k] for k in ("settings", "decode_tok_s", "over_greedy", "over_greedy_paired")} if s else None
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
    return {"model": res["model"], "dtype": res["dtype"], "settings": res["settings"],
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
    return out + [""] + _sampled(ok) + _failed(rows) + _commands(rows)


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
    if not peers[LLAMACPP]["used"]:
        out += [f"{peers[LLAMACPP]['text']}", ""]
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
    return "\n".join(out) + "\n"
