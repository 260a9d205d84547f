"""The soak's figures: per-minute series, RSS growth, the target verdicts, the printed tables and the plot.

Pure functions of what the run recorded (answers, RSS samples, check results): nothing here talks to
a server, so the arithmetic can be read, and tested, on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .multiturn import _pct   # one percent formatter for both benches
from .soak_client import Answer
from .soak_mix import Mix

RSS_TARGET = 0.05          # growth after warm-up, per server process


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def reuse_fraction(answers: list[Answer]) -> float | None:
    """sum(cached_tokens) / sum(prompt_tokens): the share of prompt positions not recomputed."""
    prompt = sum(a.prompt_tokens for a in answers)
    return sum(a.cached_tokens for a in answers) / prompt if prompt else None


def latency(answers: list[Answer]) -> dict:
    ttft = [a.ttft_s for a in answers]
    itl = [g for a in answers for g in a.itl_s]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50),
            "itl_p99_s": pct(itl, 99)}


def per_bin(answers: list[Answer], bin_s: float, duration_s: float) -> list[dict]:
    """One row per `bin_s` window of send time (the last window may be partial): requests answered,
    reuse fraction, TTFT and inter-token latency p50/p99, and which server process answered. The last
    row also takes requests resent after the end (a turn retried across the restart or a 429)."""
    rows = []
    n = max(1, int(np.ceil(duration_s / bin_s)))
    for i in range(n):
        lo, hi = i * bin_s, (i + 1) * bin_s if i < n - 1 else float("inf")
        xs = [a for a in answers if lo <= a.start_s < hi]
        rows.append({"bin": i, "from_s": lo, "to_s": min((i + 1) * bin_s, duration_s), "answered": len(xs),
                     "prompt_tokens": sum(a.prompt_tokens for a in xs),
                     "cached_tokens": sum(a.cached_tokens for a in xs), "reuse_fraction": reuse_fraction(xs),
                     "generations": sorted({a.generation for a in xs}), **latency(xs)})
    return rows


def attach_rss(rows: list[dict], samples: list[dict]) -> list[dict]:
    """Give each per-bin row `rss_mib`: the last RSS sample taken in its window (None if none was).
    Side effect: mutates and returns `rows`."""
    for r in rows:
        hi = float("inf") if r is rows[-1] else r["to_s"]      # the last row: until the server stopped
        xs = [s["rss_mib"] for s in samples if r["from_s"] <= s["t_s"] < hi]
        r["rss_mib"] = xs[-1] if xs else None
    return rows


@dataclass(frozen=True)
class RssGrowth:
    """One server process's resident memory after its warm-up: first sample, last, peak."""
    generation: int
    samples_after_warmup: int
    first_mib: float | None
    last_mib: float | None
    peak_mib: float | None

    @property
    def growth(self) -> float | None:
        """last / first - 1; None with fewer than two samples after warm-up (not measured)."""
        if self.samples_after_warmup < 2 or not self.first_mib:
            return None
        return self.last_mib / self.first_mib - 1

    @property
    def peak_growth(self) -> float | None:
        if self.samples_after_warmup < 2 or not self.first_mib:
            return None
        return self.peak_mib / self.first_mib - 1


def rss_growth(samples: list[dict], starts: dict[int, float], warmup_s: float) -> list[RssGrowth]:
    """Per server process (`generation`), from samples {t_s, generation, rss_mib} taken at least
    `warmup_s` after that process was started (`starts[generation]`, seconds since the soak began)."""
    out = []
    for gen in sorted(starts):
        xs = [s["rss_mib"] for s in samples if s["generation"] == gen and s["t_s"] - starts[gen] >= warmup_s]
        out.append(RssGrowth(gen, len(xs), xs[0] if xs else None, xs[-1] if xs else None, max(xs) if xs else None))
    return out


def by_kind(answers: list[Answer], cold_rows: list[dict], mix: Mix) -> dict[str, dict]:
    """Per kind of request (the mix's order, then any other): answered, json answers that did not
    validate (json kinds), and the cold check's rows compared and identical."""
    names = [k.name for k in mix.kinds]
    names += sorted({a.kind for a in answers} - set(names))
    json_kinds = {k.name for k in mix.kinds if k.json}
    out = {}
    for n in names:
        xs = [a for a in answers if a.kind == n]
        rows = [r for r in cold_rows if r.get("kind") == n]
        out[n] = {"answered": len(xs), "completion_tokens": sum(a.completion_tokens for a in xs),
                  "json_invalid": sum(a.invalid is not None for a in xs) if n in json_kinds else None,
                  "cold_compared": len(rows), "cold_identical": sum(r["identical"] for r in rows)}
    return out


def _per_kind(kinds: dict[str, dict]) -> str:
    """`chat 2/2, greedy 1/2, ...` for the kinds the cold check compared."""
    return ", ".join(f"{n} {k['cold_identical']}/{k['cold_compared']}" for n, k in kinds.items() if k["cold_compared"])


def verdicts(result: dict) -> list[dict]:
    """The targets, each {target, value, met}; met=None: not checked (the row says why)."""
    out = []
    o = result["requests"]
    out.append({"target": "failed requests = 0", "value": str(o["failed"]), "met": o["failed"] == 0})
    for g in result["rss"]["growth"]:
        v = g["growth"]
        out.append({"target": f"RSS growth after warm-up <= {RSS_TARGET:.0%} (server process {g['generation']})",
                    "value": "not measured (under 2 samples after warm-up)" if v is None else
                    f"{v:+.1%} ({g['first_mib']:.0f} -> {g['last_mib']:.0f} MiB, peak {g['peak_growth']:+.1%})",
                    "met": None if v is None else v <= RSS_TARGET})
    for name, v in result["cache_verify"].items():
        if v is None:
            continue
        out.append({"target": f"cache files verify ({name})", "value": f"{v['good']}/{v['files']} good",
                    "met": v["rc"] == 0 and v["damaged"] == 0})
    c = result["cold_check"]
    if c["skipped"]:
        out.append({"target": "answers after restart = cold server's", "value": c["skipped"], "met": None})
    else:
        same = sum(r["identical"] for r in c["rows"])
        kinds = (result.get("mix") or {}).get("by_kind") or {}
        detail = f" ({_per_kind(kinds)})" if kinds else ""
        out.append({"target": "answers after restart = cold server's",
                    "value": f"{same}/{len(c['rows'])} identical{detail}",
                    "met": bool(c["rows"]) and same == len(c["rows"])})
    js = [k for k in ((result.get("mix") or {}).get("by_kind") or {}).values() if k["json_invalid"] is not None]
    if js:
        n, bad = sum(k["answered"] for k in js), sum(k["json_invalid"] for k in js)
        out.append({"target": "json_schema answers parse and validate", "value": f"{n - bad}/{n} valid",
                    "met": None if n == 0 else bad == 0})
    d = result.get("disk_full")
    if d:
        out.append({"target": "disk full: disk tier writes off, nothing else changes",
                    "value": f"writes_disabled={d['writes_disabled']}", "met": d["writes_disabled"] == 1.0})
    return out


def missed(result: dict) -> list[str]:
    """Targets missed (met is False), plus the cold check when it could not run: the soak is a check."""
    out = [v["target"] for v in result["verdicts"] if v["met"] is False]
    if result["cold_check"]["skipped"]:
        out.append("answers after restart = cold server's (not checked)")
    return out


# ---- output -------------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def report(result: dict, console, paths: list[Path]) -> None:
    """Per-minute table, totals, the targets with their verdicts."""
    from rich.table import Table
    s = result["settings"]
    t = Table(title=f"soak · {s['conversations']} conversations · {s['slots']} slots · "
                    f"{s['duration_s']:.0f} s, kill -9 at {s['kill_at_s']:.0f} s · mix {s.get('mix', 'greedy')}")
    for col in ("from s", "answered", "reused", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "RSS MiB",
                "server"):
        t.add_column(col, justify="right")
    for r in result["per_bin"]:
        t.add_row(f"{r['from_s']:.0f}", str(r["answered"]), _pct(r["reuse_fraction"]), _ms(r["ttft_p50_s"]),
                  _ms(r["ttft_p99_s"]), _ms(r["itl_p50_s"]), _ms(r["itl_p99_s"]),
                  "-" if r.get("rss_mib") is None else f"{r['rss_mib']:.0f}",
                  ",".join(str(g) for g in r["generations"]))
    all_ = result["overall"]
    t.add_row("all", str(result["requests"]["answered"]), _pct(all_["reuse_fraction"]), _ms(all_["ttft_p50_s"]),
              _ms(all_["ttft_p99_s"]), _ms(all_["itl_p50_s"]), _ms(all_["itl_p99_s"]), "", "", style="bold")
    console.print(t)
    if result.get("mix"):
        console.print(mix_table(result["mix"]))

    o, f = result["requests"], result["fault"]
    console.print(f"requests: {o['answered']} answered, {o['failed']} failed, {o['back_pressure']} back-pressure "
                  f"(429 honoured), {o['retried_during_restart']} retried during restart; "
                  f"{result['overall']['completion_tokens']} tokens generated; reused prefix from "
                  + ", ".join(f"{k} {v}" for k, v in result["overall"]["by_tier"].items()) + " (answers)")
    if f["killed_at_s"] is not None:
        m = f.get("tier_metrics_at_end") or {}
        hits = m.get('ternlm_kv_tier_hits_total{tier="disk"}', 0)
        damaged = m.get('ternlm_kv_tier_damaged_total{tier="disk"}', 0)
        console.print(f"kill -9 at {f['killed_at_s']:.1f} s; server answering again after {f['downtime_s']:.1f} s; "
                      f"restarted server: {hits:.0f} disk tier hits, {damaged:.0f} damaged files found")
    for x in o["failures"][:5]:
        console.print(f"[red]failed[/] t={x['t_s']} s {x['conversation']} turn {x['turn']}: {x['why']}")
    for r in result["cold_check"]["rows"]:
        if not r["identical"]:
            console.print(f"[bold red]DIFFERS[/] {r['conversation']} turn {r['turn']} ({r.get('kind', 'greedy')}, "
                          f"seed {r.get('seed')}): soak {r['soak']!r} vs cold {r['cold']!r}")

    vt = Table(title="targets")
    vt.add_column("target", justify="left")
    vt.add_column("value", justify="left")
    vt.add_column("", justify="left")
    for v in result["verdicts"]:
        mark = "[green]met[/]" if v["met"] else "[bold red]MISSED[/]" if v["met"] is False else "[yellow]n/a[/]"
        vt.add_row(v["target"], v["value"], mark)
    console.print(vt)
    console.print(f"command: {result['command']}")
    for p in paths:
        console.print(f"wrote {p}")


def mix_table(mix: dict):
    """The request mix: per kind, what the requests carry, how many were answered, json answers valid,
    answers after the restart equal to the cold server's."""
    from rich.table import Table
    t = Table(title=f"request mix: {mix['name']}")
    for col, just in (("kind", "left"), ("requests carry", "left"), ("share", "right"), ("answered", "right"),
                      ("json valid", "right"), ("= cold", "right")):
        t.add_column(col, justify=just)
    for k in mix["kinds"]:
        b = mix["by_kind"].get(k["kind"]) or {"answered": 0, "json_invalid": None, "cold_compared": 0,
                                              "cold_identical": 0}
        valid = "" if b["json_invalid"] is None else f"{b['answered'] - b['json_invalid']}/{b['answered']}"
        cold = f"{b['cold_identical']}/{b['cold_compared']}" if b["cold_compared"] else "-"
        t.add_row(k["kind"], k["describe"], f"{k['share']:.0%}", str(b["answered"]), valid, cold)
    return t


def plot(result: dict, path: Path) -> Path:
    """Three panels against time: TTFT p50/p99, inter-token latency p50/p99 (per bin), server RSS, with
    the kill marked. Side effect: writes the PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["per_bin"]
    mid = [(r["from_s"] + r["to_s"]) / 2 / 60 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), dpi=110, sharex=True)
    for ax, key, label in ((axes[0], "ttft", "time to first token (s)"), (axes[1], "itl", "inter-token latency (ms)")):
        scale = 1.0 if key == "ttft" else 1e3
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [None if r[f"{key}_{q}_s"] is None else r[f"{key}_{q}_s"] * scale for r in rows]
            ax.plot(mid, [np.nan if y is None else y for y in ys], style, label=q)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper left")
    rss = result["rss"]["samples"]
    for gen in sorted({s["generation"] for s in rss}):
        xs = [s for s in rss if s["generation"] == gen]
        axes[2].plot([s["t_s"] / 60 for s in xs], [s["rss_mib"] for s in xs], ".-", label=f"server process {gen}")
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].set_ylim(bottom=0)
    axes[2].legend(loc="lower right")
    axes[2].set_xlabel("minutes since start")
    kill = result["fault"]["killed_at_s"]
    for ax in axes:
        ax.grid(alpha=0.3)
        if kill is not None:
            ax.axvline(kill / 60, color="red", alpha=0.5, linestyle=":")
    s = result["settings"]
    axes[0].set_title(f"soak: {s['conversations']} conversations, {s['slots']} slots, kill -9 at "
                      f"{s['kill_at_s'] / 60:.1f} min (red)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
