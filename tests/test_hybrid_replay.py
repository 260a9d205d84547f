"""benchmarks/hybrid_replay.py (issue 47's replay), mechanics only, never timings: on a tiny random qwen35 Q8_0
file (synth_qwen35_gguf.py --ftype q8_0, written in tmp_path) a 4-turn `edit` replay runs to the end, every
contender is sent the same prompt every turn, ternlm's processed tokens stay within prompt - LCP + the state
grid, reuse and --no-prefix-kv answer the same ids, and no server is left running. With llama.cpp's own
llama-server where scripts/build-llamacpp built one (skipped otherwise); ternlm's two servers always."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ternlm.bench import peers

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TINY = ["--layers", "4", "--hidden", "256", "--ffn", "512", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
        "--key-heads", "2", "--value-heads", "2", "--key-dim", "64", "--value-dim", "64", "--vocab", "1024"]
HAVE_LLAMA_SERVER = peers.find_llama_server(ROOT) is not None


def _tiny_q8(tmp_path: Path) -> Path:
    path = tmp_path / "qwen35-tiny-q8_0.gguf"
    subprocess.run([sys.executable, str(BENCHMARKS / "synth_qwen35_gguf.py"), "--ftype", "q8_0", "-o", str(path),
                    *TINY], check=True, capture_output=True)
    from gguf import GGUFReader
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    # llama.cpp's converter, --outtype q8_0: 2-D weights Q8_0 (embedding and head too), the conv kernel,
    # decay rates, dt biases and norms F32.
    assert types["token_embd.weight"] == types["output.weight"] == types["blk.0.attn_qkv.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ssm_a"] == types["blk.0.ssm_norm.weight"] == "F32"
    return path


@pytest.mark.parametrize("contenders", [
    "ternlm-reuse,ternlm-no-reuse",
    pytest.param("ternlm-reuse,ternlm-no-reuse,llama-server",
                 marks=pytest.mark.skipif(not HAVE_LLAMA_SERVER, reason="no llama-server built (scripts/build-llamacpp)")),
])
def test_hybrid_replay_mechanics(tmp_path, contenders):
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCHMARKS / "hybrid_replay.py"), "--variant", "edit", "-m", str(_tiny_q8(tmp_path)),
           "--turns", "4", "--user-words", "10", "--answer-words", "8", "--system-words", "10", "--ctx", "4096",
           "--threads", "1", "--contenders", contenders, "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    res = json.loads((out / "edit.json").read_text())
    assert res["identical_answers"] is True
    names = contenders.split(",")
    assert list(res["turns"]) == names
    for i, b in enumerate(res["by_turn"]):
        assert {res["turns"][n][i]["prompt"] for n in names} == {b["prompt"]}       # the same ids for all
        assert b["vllm_reused"] % 528 == 0 and b["vllm_reused"] <= b["lcp_prev_prompt"]
        r = res["turns"]["ternlm-reuse"][i]
        assert r["within_bound"] and r["processed"] <= b["prompt"] - min(r["lcp"], b["prompt"] - 1) + 64
        assert res["turns"]["ternlm-no-reuse"][i]["processed"] == b["prompt"]
        if "llama-server" in names:
            ls = res["turns"]["llama-server"][i]
            assert ls["reused"] + ls["processed"] == b["prompt"]                    # its timings add up
    assert res["summary"]["ternlm-reuse"]["within_bound_turns"] == 4
    assert "vLLM keeps" in (out / "edit.md").read_text()
