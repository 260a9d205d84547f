"""`ternlm bench engine` and `bench reuse` on a local GGUF path (not a registry name), tiny runs with no
peers: results named after the file's stem, the load figures (baseline, peak and steady RSS, load
time) in the JSON; and the pieces they share: how -m names a model, and the load measurement itself
against a known allocation. No timing assertions."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import torch

from ternlm.bench.common import bench_model, kv_budget_bytes
from ternlm.cli import main

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
    subprocess.run([sys.executable, "-m", "ternlm.cli", *argv], check=True, capture_output=True)
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
        layers, kv_heads, head_dim, max_capacity, dtype = 2, 3, 4, 100, torch.float16

    class Slot:
        shape = Shape()

    class Engine:
        slots = [Slot(), Slot()]

    assert kv_budget_bytes(Engine()) == 2 * 2 * 3 * 4 * 100 * 2 * 2
