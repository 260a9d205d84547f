"""ternlm.bench.llamacpp is the one llama.cpp launcher: the CLI benchmarks and the scripts under benchmarks/
find the same peers interpreter for a checkout laid out in tmp_path, build their server command lines
with it, and start and stop servers and the worker through it. No llama.cpp needed: the peers venv's
python is a stand-in script that serves /v1/models or answers the worker's JSON lines."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from ternlm.bench import llamacpp, peers
from ternlm.bench.procs import free_port
from ternlm.bench.cli import add_bench_parser
from ternlm.engine.args import engine_args, load_engine

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Serves GET /v1/models on the port after --port, prints one line, exits on SIGTERM.
SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/v1/models", "/health") else 404)
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *a):
        pass
print("stand-in llama.cpp server on", port, flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
# Answers every JSON line with the arguments it was started with.
WORKER = """
import json, sys
for line in sys.stdin:
    print(json.dumps({"argv": sys.argv[1:]}), flush=True)
"""


def _script(name: str):
    """A benchmarks/ script imported as a module once (its own sys.path set-up runs)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)      # its dataclasses look themselves up
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _peers_venv(root: Path, code: str) -> Path:
    """root/.venv-peers/bin/python: a stand-in that runs `code` under this interpreter with its arguments."""
    py = root / ".venv-peers" / "bin" / "python"
    py.parent.mkdir(parents=True)
    (root / "stand_in.py").write_text(code)
    py.write_text(f"#!/bin/sh\nexec {sys.executable} {root / 'stand_in.py'} \"$@\"\n")
    py.chmod(0o755)
    return py


def test_the_cli_and_the_scripts_build_the_same_server_command(tmp_path, monkeypatch):
    py = _peers_venv(tmp_path, SERVER)
    gguf = tmp_path / "m.gguf"
    ap = argparse.ArgumentParser()
    add_bench_parser(ap.add_subparsers(dest="cmd"), engine_args, load_engine)
    monkeypatch.chdir(tmp_path)                         # the CLI's default is relative to the checkout
    for argv in (["bench", "report"], ["bench", "engine"], ["bench", "reuse"]):
        assert Path(ap.parse_args(argv).llamacpp_python).resolve() == py == peers.peers_python(tmp_path)

    base = [str(py), "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", "2", "--n_threads_batch", "2",
            "--n_ctx", "8192", "--host", "127.0.0.1", "--port", "8100"]
    assert llamacpp.llamacpp_server_argv(str(py), gguf, 2, 8192, 8100) == base          # bench report's multiturn

    replay = _script("replay_common")
    monkeypatch.setattr(replay, "ROOT", tmp_path)
    assert replay.LlamaCpp(gguf, 8100, 8192).argv == base + ["--logits_all", "False"]
    ls = replay.LlamaServer(gguf, 8100, 8192, 2, "/bin/llama-server")          # hybrid_replay's peer
    ls.log_path.unlink()
    assert ls.argv == llamacpp.llama_server_argv("/bin/llama-server", gguf, 2, 1, 8192, 8100)

    moe = _script("moe_capped")
    monkeypatch.setattr(moe, "ROOT", tmp_path)
    args = argparse.Namespace(threads=2, ctx=8192, llama_args=["--n_batch", "128"])
    assert moe.command("llama.cpp-repack", gguf, 8100, args) == base + ["--use_mlock", "False", "--n_batch", "128"]
    patched = moe.command("llama.cpp", gguf, 8100, args)
    assert patched[:3] == [str(py), "-c", moe.NO_REPACK] and patched[3:] == (base + ["--use_mlock", "False",
                                                                                     "--n_batch", "128"])[3:]


def test_server_starts_answers_and_stops(tmp_path, monkeypatch):
    py = _peers_venv(tmp_path, SERVER)
    port = free_port()
    argv = llamacpp.llamacpp_server_argv(str(py), tmp_path / "m.gguf", 1, 512, port)
    with llamacpp.LlamaCppServer(argv, port, tmp_path / "logs" / "s.log") as s:
        with urllib.request.urlopen(f"{s.url}/models", timeout=5) as r:
            assert r.status == 200
        assert f"stand-in llama.cpp server on {port}" in s.log()
    assert s.proc.poll() is not None

    replay = _script("replay_common")
    monkeypatch.setattr(replay, "ROOT", tmp_path)
    with replay.LlamaCpp(tmp_path / "m.gguf", free_port(), 512) as s:
        log = s.log_path
        assert log.exists() and s.base == f"http://127.0.0.1:{s.port}"
    assert s.proc.poll() is not None and not log.exists()       # the replay's temporary log goes with it


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path):
    argv = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no such model"):
        with llamacpp.LlamaCppServer(argv, free_port(), tmp_path / "s.log"):
            pass


def test_worker_runs_the_packaged_worker_script(tmp_path):
    py = _peers_venv(tmp_path, WORKER)
    w = llamacpp.LlamaCppWorker(str(py), tmp_path / "m.gguf", 2, 4096)
    try:
        assert w.call({"op": "ping"}) == {"argv": [str(llamacpp.WORKER), str(tmp_path / "m.gguf"), "2", "4096"]}
        assert llamacpp.WORKER.is_file() and "def main" in llamacpp.WORKER.read_text()
        assert w.status()["VmRSS"] > 0
    finally:
        w.close()
    assert w.proc.returncode == 0 and os.path.dirname(llamacpp.WORKER) == os.path.dirname(llamacpp.__file__)


# llama-bench's `-o json` for one decode test (fields trimmed to those read), and llama-perplexity's summaries.
BENCH_JSON = json.dumps([{"n_prompt": 0, "n_gen": 4, "n_depth": 16, "n_threads": 1, "avg_ts": 64.6,
                          "stddev_ts": 0.5, "samples_ts": [64.9, 64.2, 70.0]}])
PPL_TEXT = """[1]12.3,[2]13.4,
Final estimate: PPL = 13.4567 +/- 0.51234
"""
KLD_TEXT = """====== Perplexity statistics ======
Mean PPL(Q)                   :  13.501234 ±   0.512345
Mean PPL(base)                :  13.401234 ±   0.502345
====== KL divergence statistics ======
Mean    KLD:   0.012345 ±   0.000123
Maximum KLD:   1.234567
Median  KLD:   0.004321
====== Token probability statistics ======
RMS Δp    :  3.210 ± 0.050 %
Same top p: 97.123 ± 0.123 %
"""


def test_llama_bench_and_perplexity_output_is_parsed():
    (row,) = llamacpp.parse_llama_bench(BENCH_JSON)
    assert (row.test, row.n_gen, row.n_depth, row.avg_tok_s, row.median_tok_s) == ("tg4 @ d16", 4, 16, 64.6, 64.9)
    assert llamacpp.llama_bench_argv("/b/llama-bench", Path("m.gguf"), 2, 3, 0, 64, 512) == [
        "/b/llama-bench", "-m", "m.gguf", "-t", "2", "-r", "3", "-p", "0", "-n", "64", "-d", "512", "-o", "json"]
    assert llamacpp.parse_perplexity(PPL_TEXT) == {"perplexity": 13.4567, "perplexity_err": 0.51234}
    kld = llamacpp.parse_perplexity(KLD_TEXT)["kld"]
    assert kld["Same top p"] == 97.123 and kld["Mean KLD"] == 0.012345 and kld["Mean PPL(Q)"] == 13.501234


def test_a_binary_is_found_auto_or_named_and_a_missing_one_is_named(tmp_path):
    assert llamacpp.resolve_bin(llamacpp.LLAMA_BENCH, None, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="llama-bench: not found"):
        llamacpp.resolve_bin(llamacpp.LLAMA_BENCH, "auto", tmp_path)
    built = tmp_path / ".peers" / "llama.cpp-0.3.36-abc" / "bin" / "llama-bench"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert llamacpp.resolve_bin(llamacpp.LLAMA_BENCH, "auto", tmp_path) == str(built)


REAL_BENCH = llamacpp.find_bin(llamacpp.LLAMA_BENCH)


@pytest.mark.skipif(REAL_BENCH is None, reason="no llama-bench built (scripts/build-llamacpp)")
def test_the_real_llama_bench_runs_and_its_rows_are_read():
    from ternlm.models.registry import model_path
    rows = llamacpp.llama_bench(REAL_BENCH, model_path("smollm2-135m", progress=False), 1, 1, 8, 0)
    assert [r.test for r in rows] == ["pp8"] and rows[0].avg_tok_s > 0
