"""`ternlm bench reuse --llama-server`: llama.cpp's own server as the turn-2 peer. Mechanics only, never timings:
the report carries both engines' rows, llama-server's processed counts are its timings' and add up
(cache_n + prompt_n == the ids sent), the no-reuse row evaluates everything, and the server is gone after.

A stand-in llama-server (a script that keeps one slot's ids and answers /completion with timings the way
llama-server does) runs everywhere; the real binary runs too where scripts/build-llamacpp built one
(llamacpp.find_llama_server: this checkout's .peers/ or its main worktree's), and skips otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ternlm.bench import llamacpp

ROOT = Path(__file__).resolve().parents[1]

# Serves /v1/models and /completion like llama-server with one slot: keeps the ids it last held, reuses
# their common prefix with the next prompt (all but the last id at most) when cache_prompt is on, and
# reports it in `timings`; writes its pid to $STAND_IN_PID so the test can see it stopped.
STAND_IN = r'''
import http.server, json, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
open(os.environ["STAND_IN_PID"], "w").write(str(os.getpid()))
held = []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/v1/models", "/health") else 404)
        self.end_headers()
        self.wfile.write(b"{}")
    def do_POST(self):
        global held
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = body["prompt"]
        k = 0
        if body.get("cache_prompt", True):
            while k < min(len(held), len(ids) - 1) and held[k] == ids[k]:
                k += 1
        out = [7] * body["n_predict"]
        held = ids + out
        data = json.dumps({"content": "x", "tokens": out, "timings": {"cache_n": k, "prompt_n": len(ids) - k,
                                                                      "prompt_ms": 1.0}}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _bench(tmp_path: Path, binary: str, env: dict | None = None) -> dict:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ternlm.cli.main", "bench", "reuse", "-m", "smollm2-135m", "--dtype", "float32",
           "--threads", "1", "--history-tokens", "150", "--repeats", "1", "--ctx", "1024",
           "--llamacpp-python", "", "--llama-server", binary, "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE", **(env or {})))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "reuse / llama-server reuse =" in p.stdout and "llama-server no-reuse" in p.stdout, p.stdout
    return json.loads((out / "reuse-smollm2-135m-float32.json").read_text())


def _check(res: dict) -> None:
    n, k = res["prompt_tokens"], res["reused_tokens"]
    assert {"reuse", "no-reuse", "llama-server reuse", "llama-server no-reuse"} <= set(res["median_ttft_s"])
    done = res["processed_tokens"]
    assert done["reuse"] == n - k and done["no-reuse"] == n
    ls = res["llama_server"]
    assert ls["counts_consistent"] is True and ls["argv"][0] == res["llama_server"]["binary"]
    for t in ls["rounds"]["llama-server reuse"] + ls["rounds"]["llama-server no-reuse"]:
        assert t["prompt"] == n and t["cached"] + t["processed"] == n     # the same turn-2 ids as ternlm
    assert done["llama-server no-reuse"] == n                               # cache_prompt off: everything
    assert 0 < done["llama-server reuse"] < n                                # its prefix cache was used
    assert isinstance(res["llama_server_target"]["met"], bool)


def test_bench_reuse_beside_a_stand_in_llama_server(tmp_path):
    binary = tmp_path / "llama-server"
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'stand_in.py'} \"$@\"\n")
    binary.chmod(0o755)
    pid_file = tmp_path / "pid"
    res = _bench(tmp_path, str(binary), {"STAND_IN_PID": str(pid_file)})
    _check(res)
    # The stand-in keeps the previous turn and its 24-token answer: turn 2 reuses the previous prompt at least.
    assert res["processed_tokens"]["llama-server reuse"] <= res["prompt_tokens"] - res["reused_tokens"] + 24
    assert res["llama_server"]["argv"][1:3] == ["-m", str(peers_gguf())]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)                # the bench stopped its server


def peers_gguf() -> Path:
    from ternlm.models.registry import model_path
    return model_path("smollm2-135m", progress=False)


REAL = llamacpp.find_llama_server(ROOT)


@pytest.mark.skipif(REAL is None, reason="no llama-server built (scripts/build-llamacpp)")
def test_bench_reuse_beside_the_real_llama_server(tmp_path):
    res = _bench(tmp_path, "auto")
    _check(res)
    assert res["llama_server"]["binary"] == REAL
    assert Path(res["llama_server"]["log"]).stat().st_size > 0              # its own log, kept beside the JSON


def test_find_llama_server_in_the_checkout_or_its_main_worktree(tmp_path):
    main, wt = tmp_path / "main", tmp_path / "wt"
    (main / ".git" / "worktrees" / "wt").mkdir(parents=True)
    wt.mkdir()
    (wt / ".git").write_text(f"gitdir: {main / '.git' / 'worktrees' / 'wt'}\n")
    assert llamacpp.find_llama_server(wt) is None and llamacpp.find_llama_server(main) is None
    built = main / ".peers" / "llama.cpp-0.3.36-abc" / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert llamacpp.find_llama_server(main) == str(built) == llamacpp.find_llama_server(wt)
    own = wt / ".peers" / "llama.cpp-0.3.36-def" / "bin" / "llama-server"
    own.parent.mkdir(parents=True)
    own.write_text("")
    assert llamacpp.find_llama_server(wt) == str(own)           # the worktree's own build first
