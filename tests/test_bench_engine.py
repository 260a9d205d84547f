"""`ternlm bench engine` and `bench reuse` on a local GGUF path (not a registry name), tiny runs with no
peers: results named after the file's stem, the load figures (baseline, peak and steady RSS, load
time) in the JSON; and the pieces they share: how -m names a model, and the load measurement itself
against a known allocation. bench engine's --sampling: every setting's decode really runs with its
fields (Engine.stream's keywords seen), interleaved, and its medians and ratios to greedy in the JSON;
the setting names themselves. No timing assertions."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from ternlm.bench.common import bench_model, kv_budget_bytes
from ternlm.bench.sampling_settings import STANDARD, Sampling, from_flags, parse, parse_list
from ternlm.cli.main import main
from ternlm.engine.sampling import Penalties

MIB = 1 << 20


def test_bench_model_names_a_path_by_its_stem_and_a_registry_model_by_its_name(smollm2_gguf, tmp_path):
    by_name = bench_model("smollm2-135m")
    assert (by_name.label, by_name.path, by_name.kind) == ("smollm2-135m", smollm2_gguf, "gguf")
    by_path = bench_model(str(smollm2_gguf))
    assert by_path.label == smollm2_gguf.stem == "SmolLM2-135M-Instruct.Q4_1"
    assert by_path.gguf == smollm2_gguf and by_path.file_bytes == smollm2_gguf.stat().st_size
    folder = tmp_path / "my-model"          # a Hugging Face folder: no GGUF for llama.cpp
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    hf = bench_model(str(folder))
    assert (hf.label, hf.kind, hf.gguf, hf.file_bytes) == ("my-model", "hf", None, 1000)


_MEASURE = """
import json, torch
from ternlm.bench.common import measure_load
MIB = 1 << 20
def load():
    tmp = torch.ones(96 * MIB // 4)         # 96 MiB touched, then freed: a loader's temporary
    kept = torch.ones(16 * MIB // 4)        # 16 MiB kept: the "model"
    del tmp
    return kept
kept, mem = measure_load(load)
print(json.dumps({"numel": kept.numel(), **mem.as_dict(), "peak_above": mem.peak_above_mib,
                  "steady_above": mem.steady_above_mib, "load_s": mem.load_s, "baseline": mem.baseline_mib,
                  "peak": mem.peak_mib}))
"""


def test_measure_load_sees_a_freed_temporary_in_the_peak_and_not_in_the_steady_set():
    """In a fresh process: RSS figures are the process's, and a test process that already holds (and
    freed) a lot of heap would reuse it without a new page (seen in the full suite: peak = baseline)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, check=True)
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    assert mem["numel"] == 16 * MIB // 4
    assert mem["peak_above"] >= 100, mem       # both at once
    assert 10 <= mem["steady_above"] <= 40, mem
    assert mem["load_s"] > 0 and mem["baseline"] > 0
    assert mem["peak_above_baseline_mib"] == mem["peak"] - mem["baseline"]


def test_bench_engine_and_reuse_accept_a_gguf_path(smollm2_gguf, tmp_path, monkeypatch):
    model = tmp_path / "copy of smollm2.gguf"     # a path no registry entry knows, with a space in it
    shutil.copyfile(smollm2_gguf, model)
    out = tmp_path / "out"
    argv = ["bench", "engine", "-m", str(model), "--peers", "none", "--dtype", "float32", "--threads", "1",
            "--prompt-tokens", "16", "--decode-tokens", "2", "--decode-context", "16", "--repeats", "1",
            "--ctx", "512", "--out", str(out)]
    # its own process: the load's RSS figures would otherwise include this test process's heap history
    subprocess.run([sys.executable, "-m", "ternlm.cli.main", *argv], check=True, capture_output=True)
    res = json.loads(next(out.glob("engine-copy of smollm2-float32-*-ctx16.json")).read_text())
    assert res["model"] == "copy of smollm2" and res["model_path"] == str(model)
    assert list(res["median_tok_s"]) == ["ternlm"]
    assert res["file_bytes"] == model.stat().st_size and res["ctx"] == 512
    load = res["load"]["ternlm"]
    assert load["load_s"] > 0 and load["baseline_mib"] > 0
    assert load["peak_mib"] >= load["steady_mib"] > load["baseline_mib"]
    # the model's weights are about the file's size: above the baseline after the load, at least half of it
    assert load["steady_above_baseline_mib"] * MIB > 0.5 * res["file_bytes"]
    assert abs(load["budget_mib"] * MIB - (res["file_bytes"] + res["kv_budget_bytes"])) < 1
    assert res["kv_budget_bytes"] == 2 * 30 * 3 * 64 * 512 * (2 if res["weights"] == "gguf" else 4)

    argv = ["bench", "reuse", "-m", str(model), "--dtype", "float32", "--threads", "1", "--history-tokens", "120",
            "--repeats", "1", "--ctx", "1024", "--llamacpp-python", str(tmp_path / "no-peers"), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["ternlm", *argv])
    assert main(argv) == 0
    res = json.loads((out / "reuse-copy of smollm2-float32.json").read_text())
    assert res["model"] == "copy of smollm2" and res["reused_tokens"] > 0
    assert "llama.cpp reuse" not in res["median_ttft_s"]


def test_kv_budget_counts_every_slot_at_the_full_context():
    class Shape:
        layers, kv_heads, row, max_capacity, dtype = 2, 3, 4, 100, torch.float16

    class Slot:
        shape = Shape()

    class Engine:
        slots = [Slot(), Slot()]

    assert kv_budget_bytes(Engine()) == 2 * 2 * 3 * 4 * 100 * 2 * 2


def test_sampling_names_read_and_write_the_same_settings():
    assert parse("greedy") == Sampling() and Sampling().name == "greedy" and Sampling().greedy
    chat = parse("t0.7-p0.95-pres0.5")
    assert chat == Sampling(temperature=0.7, top_p=0.95, presence=0.5) and chat.name == "t0.7-p0.95-pres0.5"
    assert [parse(n).name for n in STANDARD] == list(STANDARD)
    every = parse("t1.2-p0.9-k40-minp0.05-pres-0.5-freq0.25-rep1.1")
    assert every == Sampling(1.2, 0.9, 40, 0.05, -0.5, 0.25, 1.1) and parse(every.name) == every
    assert parse("t0-pres0.5").name == "t0-pres0.5" and parse("t0-pres0.5").greedy      # greedy, penalized
    assert chat.engine_kwargs(7) == {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.0, "seed": 7,
                                     "penalties": Penalties(presence=0.5)}
    assert chat.openai_fields() == {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.5}
    assert Sampling().llama_fields() == {"temperature": 0.0, "top_k": 1}
    assert chat.llama_fields()["top_k"] == 0 and chat.llama_fields()["min_p"] == 0.0   # llama.cpp's 40 / 0.05 off
    assert from_flags(None, None, None) is None
    assert from_flags(None, 0.95, None) == Sampling(temperature=1.0, top_p=0.95)          # OpenAI's temperature 1
    assert [s.name for s in parse_list("greedy,t1")] == ["greedy", "t1"]
    for bad in ("t", "x1", "t1-", "t1-t2", "p1.5", "t-1", "greedy,greedy", ""):
        with pytest.raises(ValueError):
            parse_list(bad)


def test_bench_engine_decodes_at_each_sampling_setting(tmp_path, monkeypatch):
    """In process, the engine's stream spied on: each setting's fields reach the decode, rounds interleave
    greedy, t1, chat; the JSON's headline decode is the first setting's and the ratios are greedy's."""
    from ternlm.engine.core import Engine
    calls = []
    real = Engine.stream

    def spy(self, prompt, **kw):
        if kw.get("ignore_eos"):                       # the timed decodes (the prefill measure asks for 1 token)
            calls.append(kw)
        return real(self, prompt, **kw)
    monkeypatch.setattr(Engine, "stream", spy)
    out = tmp_path / "out"
    argv = ["bench", "engine", "-m", "smollm2-135m", "--peers", "none", "--dtype", "float32", "--threads", "1",
            "--prompt-tokens", "16", "--decode-tokens", "3", "--decode-context", "16", "--repeats", "2",
            "--ctx", "512", "--sampling", ",".join(STANDARD), "--seed", "5", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads(next(out.glob("engine-smollm2-135m-float32-*-ctx16-greedy+t1+t0.7-p0.95-pres0.5.json"))
                     .read_text())
    seen = [(c["temperature"], c["top_p"], c["penalties"].presence) for c in calls]
    assert seen == [(0.0, 1.0, 0.0), (1.0, 1.0, 0.0), (0.7, 0.95, 0.5)] * 3     # warm-up + 2 rounds, interleaved
    assert all(c["speculative"] is False and c["seed"] == 5 and c["max_tokens"] == 4 for c in calls)
    s = res["sampling"]
    assert list(s["decode_tok_s"]) == list(STANDARD) and all(len(s["samples"][n]) == 2 for n in STANDARD)
    assert s["settings"]["t0.7-p0.95-pres0.5"] == {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.5}
    assert res["decode_sampling"] == "greedy" and res["peers_sampling"] == "greedy" and res["seed"] == 5
    assert res["median_tok_s"]["ternlm"]["decode"] == s["decode_tok_s"]["greedy"]
    assert res["samples"]["ternlm"]["decode"] == s["samples"]["greedy"]
    assert s["over_greedy"]["greedy"] == 1.0 and s["over_greedy_paired"]["greedy"] == 1.0
    assert s["over_greedy"]["t1"] == s["decode_tok_s"]["t1"] / s["decode_tok_s"]["greedy"]
    assert list(res["median_tok_s"]) == ["ternlm"] and res["ratios"] == {}

    calls.clear()                     # one setting from the flags: it alone is decoded, no greedy to divide by
    assert main([*argv[:-6], "--temperature", "0.7", "--top-p", "0.95", "--out", str(out)]) == 0
    res = json.loads(next(out.glob("engine-*-ctx16-t0.7-p0.95.json")).read_text())
    assert {(c["temperature"], c["top_p"]) for c in calls} == {(0.7, 0.95)} and len(calls) == 3
    assert res["decode_sampling"] == "t0.7-p0.95" and res["sampling"]["over_greedy"] is None
    assert main([*argv, "--temperature", "1"]) == 2        # --sampling and the flags: refused
