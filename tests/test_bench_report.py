"""`ternlm bench report`: the quick mode for real (smollm2-135m, every part, no peers), and its page
checked against what the benchmarks themselves wrote: summary.json's figures are their JSON's numbers,
summary.md prints those numbers (ternlm's decode greedy and sampled, with the ratios), names each
benchmark's command, links the plots they made; a peer that is not installed is a line in the table.
Also the plan of the full mode, which runs nothing; llama.cpp's own binaries as peers (a fake llama-bench
through a real `bench engine`, the real one where built); and the page's last section, RESULTS' Summary
rows reproduced or not and why. No timing assertions: the figures are whatever this machine measured."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ternlm.bench.peers import Peer, find_llamacpp
from ternlm.bench.llamacpp import LLAMA_BENCH, LLAMA_SERVER, find_bin
from ternlm.bench.report import (BIG_MODEL, DEFAULT_PARTS, FULL_MODELS, PARTS, Options, _bin_row, _peer_row,
                                 find_binary, plan)
from ternlm.bench.report_tables import FIGURES, SUMMARY_ROWS, markdown, summary_rows
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
    root = Path(__file__).resolve().parents[1]
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    if git.returncode != 0:
        assert rep["commit"] == "unknown"
    else:       # HEAD when the report began: HEAD now or, where others committed meanwhile, an ancestor of it
        assert rep["commit"] == git.stdout.strip() or subprocess.run(
            ["git", "merge-base", "--is-ancestor", rep["commit"], "HEAD"], cwd=root).returncode == 0
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
    assert set(s["peers"]) == {"transformers", "llama.cpp", LLAMA_BENCH, LLAMA_SERVER}


def test_quick_report_lists_every_summary_row_as_not_run(quick):
    _, s, md, stdout = quick
    rows = s["summary_rows"]
    assert [r["id"] for r in rows] == [r.id for r in SUMMARY_ROWS] and len(rows) == 11
    assert md.rstrip().split("\n## ")[-1].startswith("Summary rows")        # the page's last section
    assert "## Summary rows" in stdout                                       # and the report's last words
    for r, row in zip(rows, SUMMARY_ROWS):
        assert r["status"] == "not run" and r["figure"] is None
        assert r["why"][0] == (row.outside if row.part is None else "--quick (a smoke test: no peers, smollm2-135m "
                                                                       "only, tiny sizes)")
        assert f"| {r['id']} | {r['claim']} | not run: {'; '.join(r['why'])} |" in md


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
    # no llama.cpp binaries: no --llama-bench / --llama-server anywhere
    assert not any("--llama-bench" in s.argv or "--llama-server" in s.argv for s in plan(opts(True)))

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


def _opts(tmp_path, quick=False, parts=DEFAULT_PARTS, auto=True, big=(BIG_MODEL,)) -> Options:
    bench, server = "/b/llama-bench", "/b/llama-server"
    return Options(tmp_path, quick, parts, FULL_MODELS, 2, Peer("transformers", True, "5", "-"),
                   Peer("llama.cpp", True, "0.3", "-", "/peers/python"), server, bench,
                   frozenset({bench, server}) if auto else frozenset(), () if quick else big)


def _arg(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_full_plan_passes_llama_cpp_binaries_and_runs_the_1_5b_against_them_only(tmp_path):
    steps = {s.key: s for s in plan(_opts(tmp_path))}
    for m in FULL_MODELS:                    # llama-bench beside the engine peers; llama-server in the replay
        eng, mt = steps[f"engine-{m}"].argv, steps[f"multiturn-{m}"]
        assert _arg(eng, "--llama-bench") == "auto" and _arg(eng, "--peers") == "transformers,llamacpp"
        assert _arg(mt.argv, "--llama-server") == "auto" and mt.server == "llama.cpp"
        assert _arg(steps[f"reuse-{m}"].argv, "--llama-server") == "auto"
    assert steps["streams-smollm2-135m"].server == LLAMA_SERVER
    big = BIG_MODEL
    assert [k for k in steps if big in k] == [f"engine-{big}", f"reuse-{big}", f"multiturn-{big}"]
    eng, reuse, mt = steps[f"engine-{big}"].argv, steps[f"reuse-{big}"].argv, steps[f"multiturn-{big}"]
    assert _arg(eng, "--peers") == "none" and _arg(eng, "--llama-bench") == "auto" and "--llamacpp-python" not in eng
    assert _arg(reuse, "--llamacpp-python") == "" and _arg(reuse, "--llama-server") == "auto"
    assert mt.server is None and _arg(mt.argv, "--llama-server") == "auto"

    named = {s.key: s for s in plan(_opts(tmp_path, auto=False))}    # a binary given by path: its path
    assert _arg(named["engine-smollm2-135m"].argv, "--llama-bench") == "/b/llama-bench"
    assert _arg(named["multiturn-smollm2-135m"].argv, "--llama-server") == "/b/llama-server"

    quick = plan(_opts(tmp_path, quick=True))                          # --quick: no peers at all
    assert not any("--llama-bench" in s.argv or s.server for s in quick)
    assert not any(_arg(s.argv, "--llama-server") not in (None, "none") for s in quick)
    assert not any(big in s.key for s in quick)


def test_the_report_finds_its_binaries_or_says_they_are_not_built(tmp_path):
    assert find_binary(LLAMA_BENCH, "none") is None and find_binary(LLAMA_BENCH, None) is None
    assert find_binary(LLAMA_BENCH, "auto") == find_bin(LLAMA_BENCH)        # whatever make bench-peers built
    with pytest.raises(FileNotFoundError, match="--llama-bench .*no such file"):
        find_binary(LLAMA_BENCH, str(tmp_path / "nope"))
    fake = tmp_path / "llama-bench"
    fake.write_text("")
    assert find_binary(LLAMA_BENCH, str(fake)) == str(fake)
    assert _bin_row(LLAMA_BENCH, None, False, False)["text"] == "llama-bench: not built (make bench-peers)"
    assert _bin_row(LLAMA_BENCH, str(fake), False, True)["text"] == "llama-bench: not run (--quick)"
    assert _bin_row(LLAMA_SERVER, None, False, False, "none")["text"] == "llama-server: not used (--llama-server none)"
    assert _bin_row(LLAMA_BENCH, str(fake), True, False)["text"] == f"llama-bench {fake}"


FAKE_LLAMA_BENCH = """#!{python}
import json, sys
a = sys.argv
p, n, d = (int(a[a.index(f) + 1]) if f in a else 0 for f in ("-p", "-n", "-d"))
ts = 100.0 if p else 25.0
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": d, "n_threads": int(a[a.index("-t") + 1]),
                   "avg_ts": ts, "stddev_ts": 1.0, "samples_ts": [ts]}}]))
"""


def _engine_with(llama_bench: str, tmp_path: Path) -> dict:
    """A real `ternlm bench engine` on smollm2-135m, tiny sizes, with this llama-bench; its JSON."""
    out = tmp_path / "engine"
    p = subprocess.run([sys.executable, "-m", "ternlm.cli.main", "bench", "engine", "-m", "smollm2-135m", "--threads", "1",
                        "--peers", "none", "--prompt-tokens", "32", "--decode-tokens", "4", "--decode-context", "32",
                        "--repeats", "1", "--ctx", "512", "--llama-bench", llama_bench, "--sampling", "greedy,t1",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = out.glob("engine-*.json")
    return json.loads(path.read_text())


def _full_summary(quick_summary: dict, engine_json: dict, tmp_path: Path) -> dict:
    """The quick report's summary as a full run with llama.cpp's binaries would write it: the engine row from
    a `bench engine --llama-bench` run, the replay with a llama-server contender's whole-replay time."""
    s = json.loads(json.dumps(quick_summary))
    rep = s["report"]
    rep["mode"], rep["parts_asked"], rep["models_asked"] = "full", list(DEFAULT_PARTS), ["smollm2-135m"]
    rep["big_models"], rep["models_cached"] = [], ["smollm2-135m", "qwen2.5-coder-0.5b"]
    s["peers"][LLAMA_BENCH] = _bin_row(LLAMA_BENCH, "/b/llama-bench", True, False)
    s["peers"][LLAMA_SERVER] = _bin_row(LLAMA_SERVER, "/b/llama-server", True, False)
    s["parts"]["engine"][0]["figures"] = FIGURES["engine"](engine_json, tmp_path, tmp_path)
    mt = s["parts"]["multiturn"][0]["figures"]
    mt["wall_s"] = {"ternlm-reuse": 3.0, "ternlm-no-reuse": 9.0, LLAMA_SERVER: 6.0}
    mt["reuse_over_llama_server_wall"] = 0.5
    return s


def test_a_fake_llama_bench_lands_in_the_engine_table_and_the_summary_rows(quick, tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(0o755)
    eng = _engine_with(str(fake), tmp_path)
    lb = eng["llama_bench"]
    assert [r["test"] for r in lb["rows"]] == ["pp32", "tg4 @ d32"] and lb["binary"] == str(fake)
    med = eng["median_tok_s"]["ternlm"]
    assert lb["ratios"] == {"prefill": med["prefill"] / 100.0, "decode": med["decode"] / 25.0}

    s = _full_summary(quick[1], eng, tmp_path)
    rows = {r["id"]: r for r in summary_rows(s)}
    md = markdown(s | {"summary_rows": list(rows.values())})
    r = lb["ratios"]
    assert f"| llama-bench (pp32 / tg4 @ d32) | 100.0 | 25.0 | ×{r['prefill']:.2f} | ×{r['decode']:.2f} |" in md
    assert rows["engine"]["status"] == "reproduced"
    assert rows["engine"]["figure"] == f"smollm2-135m ×{r['prefill']:.2f} / ×{r['decode']:.2f} (÷ llama-bench, 32 tokens)"
    assert rows["engine"]["why"] == ["qwen2.5-coder-0.5b not in --models"]      # cached, not asked for
    assert rows["engine-1.5b"]["why"] == [f"model not cached: {BIG_MODEL} (ternlm pull {BIG_MODEL})"]
    assert rows["replay"]["status"] == "reproduced" and rows["replay"]["figure"].startswith("smollm2-135m ×0.50 (")
    assert "Whole replay: ternlm-reuse 3.0 s, ternlm-no-reuse 9.0 s, llama-server 6.0 s; ternlm reuse ÷ " \
           "llama-server **×0.50**" in md
    assert rows["reuse"]["status"] == rows["sampling"]["status"] == "reproduced"
    t1 = eng["sampling"]["over_greedy"]["t1"]
    assert rows["sampling"]["figure"] == f"smollm2-135m sampled decode t1 ×{t1:.2f} of greedy"
    assert rows["spec"]["why"] == ["part spec not in this run (opt-in: --only ...,spec)"]
    for i in ("hybrid", "moe", "int8-quality"):
        assert rows[i]["status"] == "not run" and rows[i]["why"][0].startswith(("model not cached", "no report part"))
    if s["report"]["host"]["isa_class"] != "amx":       # an AMX row on another host: the ISA is named
        assert f"ISA not present: its figure is amx's (this host: {s['report']['host']['isa_class']})" in \
            rows["sliding"]["why"]
    for r in rows.values():
        assert f"| {r['id']} | {r['claim']} |" in md

    # the binaries not built: the rows that need them say so
    s["peers"][LLAMA_BENCH] = _bin_row(LLAMA_BENCH, None, False, False)
    s["peers"][LLAMA_SERVER] = _bin_row(LLAMA_SERVER, None, False, False)
    s["parts"]["engine"][0]["figures"]["llama_bench"] = None
    s["parts"]["multiturn"][0]["figures"]["reuse_over_llama_server_wall"] = None
    rows = {r["id"]: r for r in summary_rows(s)}
    md = markdown(s | {"summary_rows": list(rows.values())})
    assert rows["engine"]["status"] == rows["replay"]["status"] == "not run"
    assert "llama-bench: not built (make bench-peers)" in rows["engine"]["why"]
    assert "llama-server: not built (make bench-peers)" in rows["replay"]["why"]
    assert "| smollm2-135m | | llama-bench: not built (make bench-peers) | – | – | – | – |" in md


@pytest.mark.skipif(find_bin(LLAMA_BENCH) is None, reason="llama-bench not built (make bench-peers: scripts/build-llamacpp)")
def test_the_real_llama_bench_through_bench_engine(tmp_path):
    lb = _engine_with("auto", tmp_path)["llama_bench"]
    assert lb["binary"] == find_bin(LLAMA_BENCH) and [r["test"] for r in lb["rows"]] == ["pp32", "tg4 @ d32"]
    assert lb["ratios"]["prefill"] > 0 and lb["ratios"]["decode"] > 0
