"""`ternlm bench report`: the quick mode for real (smollm2-135m, every part, no peers), and its page
checked against what the benchmarks themselves wrote: summary.json's figures are their JSON's numbers,
summary.md prints those numbers (ternlm's decode greedy and sampled, with the ratios), names each
benchmark's command, links the plots they made; a peer that is not installed is a line in the table.
Also the plan of the full mode, which runs nothing. No timing assertions: the figures are whatever this
machine measured."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ternlm.bench.peers import Peer, find_llamacpp
from ternlm.bench.report import DEFAULT_PARTS, FULL_MODELS, PARTS, Options, _peer_row, plan
from ternlm.bench.report_tables import markdown
from ternlm.bench.sampling_settings import STANDARD as SAMPLING
from ternlm.cpu import CLASSES, probe

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick(smollm2_gguf, tmp_path_factory) -> tuple[Path, dict, str, str]:
    out = tmp_path_factory.mktemp("report") / "r"
    p = subprocess.run([sys.executable, "-m", "ternlm.cli.main", "bench", "report", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, json.loads((out / "summary.json").read_text()), (out / "summary.md").read_text(), p.stdout


def _bench(out: Path, row: dict) -> dict:
    """The JSON the benchmark process wrote, which the summary row names."""
    return json.loads((out / row["json"]).read_text())


def test_quick_report_context_and_commands(quick):
    out, s, md, _ = quick
    rep = s["report"]
    assert rep["mode"] == "quick" and rep["threads"] == os.cpu_count()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert rep["commit"] == (git.stdout.strip() if git.returncode == 0 else "unknown")
    assert rep["host"]["cpu"] == probe().model and rep["host"]["cpu"] in md
    assert rep["host"]["isa_class"] in CLASSES and rep["host"]["compute_class"] == probe().isa_class
    assert f"commit: {rep['commit']}" in md and rep["date"] in md
    assert rep["loadavg"]["start"] >= 0 and f"at start / end: {rep['loadavg']['start']:.1f}" in md
    assert list(s["parts"]) == list(DEFAULT_PARTS)
    for part, rows in s["parts"].items():
        assert [r["model"] for r in rows] == ["smollm2-135m"]
        r = rows[0]
        assert r["status"] == "ok" and r["exit"] == 0, r
        assert r["command"].startswith(f"OMP_WAIT_POLICY=PASSIVE ternlm bench {part} -m smollm2-135m ")
        assert f"--out {out / 'raw' / f'{part}-smollm2-135m'}" in r["command"]
        assert r["command"] in md and r["server_command"] is None      # no peers in quick mode
        assert (out / r["log"]).exists()
    for p in s["peers"].values():
        assert p["used"] is False and p["text"] in md


def test_quick_report_figures_are_the_benchmarks_own(quick):
    out, s, md, _ = quick
    (e,), (r,), (m,), (t,), (st,), (g,) = (s["parts"][p] for p in DEFAULT_PARTS)

    bench = _bench(out, e)
    assert e["figures"]["median_tok_s"] == bench["median_tok_s"] and list(bench["median_tok_s"]) == ["ternlm"]
    assert e["figures"]["decode_context"] == bench["decode_context"] and e["figures"]["weights"] == bench["weights"]
    t_med = bench["median_tok_s"]["ternlm"]
    assert f"| smollm2-135m | {bench['weights']}, {bench['dtype']} | ternlm | {t_med['prefill']:,.1f} | " \
           f"{t_med['decode']:,.1f} |" in md
    sampled = bench["sampling"]          # greedy and as clients sample, in the same rounds
    assert list(sampled["decode_tok_s"]) == list(SAMPLING) and bench["decode_sampling"] == "greedy"
    assert e["figures"]["sampling"]["decode_tok_s"] == sampled["decode_tok_s"]
    assert e["figures"]["sampling"]["over_greedy"] == sampled["over_greedy"]
    t1 = sampled["decode_tok_s"]["t1"]
    assert "| model | greedy | t1 | t0.7-p0.95-pres0.5 |" in md and \
        f"| smollm2-135m | {t_med['decode']:,.1f} | {t1:,.1f} (×{t1 / t_med['decode']:.2f} [" in md
    assert f"--sampling {','.join(SAMPLING)}" in e["command"]

    bench = _bench(out, r)
    for k in ("median_ttft_s", "reused_tokens", "prompt_tokens", "reuse_fraction", "speedup_vs_no_reuse"):
        assert r["figures"][k] == bench[k], k
    assert f"×{bench['speedup_vs_no_reuse']:.2f} at {100 * bench['reuse_fraction']:.1f}%" in md

    bench = _bench(out, m)
    assert m["figures"]["ttft_by_turn"] == bench["ttft_by_turn"] and bench["all_required_identical"] is True
    assert bench["settings"]["sampling"] == {} and "max 8 tokens, the server's default sampling" in md
    later = {n: statistics.median(v["ttft_s_median"] for k, v in rows.items() if int(k) > 1)
             for n, rows in bench["ttft_by_turn"].items()}
    speedup = later["ternlm-no-reuse"] / later["ternlm-reuse"]
    assert m["figures"]["speedup_turns2plus_vs_no_reuse"] == pytest.approx(speedup, rel=1e-12)
    assert f"reuse ×{speedup:.2f} faster" in md
    assert (out / m["figures"]["plot"]).read_bytes()[:8] == PNG and f"]({m['figures']['plot']})" in md

    bench = _bench(out, t)
    assert {c: v["ttft_s_median"] for c, v in t["figures"]["cases"].items()} == \
           {c: v["ttft_s_median"] for c, v in bench["cases"].items()}
    assert t["figures"]["identical"] is bench["identical"] is True

    bench = _bench(out, st)
    assert st["figures"]["median"] == bench["median"] and st["figures"]["ratios"] == bench["ratios"]
    assert (out / st["figures"]["plot"]).read_bytes()[:8] == PNG and f"]({st['figures']['plot']})" in md

    bench = _bench(out, g)
    for k in ("free_tok_s", "json_schema_tok_s", "slowdown", "slowdown_paired", "mask_us_per_token"):
        assert g["figures"][k] == bench[k], k
    assert f"| {bench['free_tok_s']:,.1f} | {bench['json_schema_tok_s']:,.1f} |" in md


def test_a_peer_not_installed_is_a_line_in_its_table(quick, tmp_path):
    _, s, _, _ = quick
    missing = find_llamacpp(str(tmp_path / "no-venv" / "python"))
    assert not missing.installed and missing.missing_text == "llama.cpp: not installed (make bench-peers)"
    full = json.loads(json.dumps(s))
    full["report"]["mode"] = "full"
    full["peers"]["llama.cpp"] = _peer_row(missing, used=False, quick=False)
    md = markdown(full)
    assert "| smollm2-135m | | llama.cpp: not installed (make bench-peers) | – |" in md      # engine
    assert "| llama.cpp: not installed (make bench-peers) | – | – |" in md                    # reuse


def test_full_plan_uses_the_peers_that_are_there(tmp_path):
    def opts(llamacpp: bool, quick: bool = False, parts: tuple[str, ...] = DEFAULT_PARTS) -> Options:
        return Options(tmp_path, quick, parts, FULL_MODELS, 2, Peer("transformers", True, "5", "-"),
                       Peer("llama.cpp", llamacpp, "0.3", "-", "/peers/python" if llamacpp else None))

    steps = {s.key: s for s in plan(opts(True))}
    assert list(steps) == [f"{p}-{m}" for p in ("engine", "reuse", "multiturn") for m in FULL_MODELS] + \
        ["tiers-smollm2-135m", "streams-smollm2-135m", "grammar-smollm2-135m"]
    eng = steps["engine-qwen2.5-coder-0.5b"].argv
    assert eng[eng.index("--peers") + 1] == "transformers,llamacpp" and "/peers/python" in eng
    assert eng[eng.index("--decode-context") + 1] == "1024"
    assert eng[eng.index("--sampling") + 1] == "greedy,t1,t0.7-p0.95-pres0.5"
    assert steps["multiturn-smollm2-135m"].server == "llama.cpp" and steps["streams-smollm2-135m"].server is None
    assert all(s.out == tmp_path / "raw" / s.key for s in steps.values())

    steps = {s.key: s for s in plan(opts(False))}
    eng, reuse = steps["engine-smollm2-135m"].argv, steps["reuse-smollm2-135m"].argv
    assert eng[eng.index("--peers") + 1] == "transformers" and reuse[reuse.index("--llamacpp-python") + 1] == ""
    assert steps["multiturn-smollm2-135m"].server is None

    steps = plan(opts(True, quick=True))
    assert all(s.server is None for s in steps) and "none" in steps[0].argv

    steps = {s.key: s for s in plan(opts(True, parts=PARTS))}       # spec: opt-in, every model, its own servers
    assert "spec" not in DEFAULT_PARTS and [k for k in steps if k.startswith("spec-")] == [f"spec-{m}" for m in FULL_MODELS]
    spec = steps["spec-qwen2.5-coder-0.5b"]
    assert spec.server is None and spec.argv[spec.argv.index("--llama-server") + 1] == "none"
