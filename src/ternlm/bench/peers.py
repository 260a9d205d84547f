"""The comparison peers a benchmark report can use, found rather than assumed: transformers (in this
venv, the `[test]` extra) and llama.cpp (llama-cpp-python in its own venv, `make bench-peers`); and
llama.cpp's OpenAI-compatible server as a child process for the HTTP benchmarks.

A missing peer is a named result (Peer.installed False, with the line that says how to get it), never
an exception: a report without peers still measures ternlm and says what it could not compare."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

LLAMACPP, TRANSFORMERS = "llama.cpp", "transformers"


@dataclass(frozen=True)
class Peer:
    name: str              # LLAMACPP | TRANSFORMERS
    installed: bool
    version: str | None    # "0.3.36" (llama-cpp-python), "5.24.0" (transformers); None if not installed
    how: str               # how to install it, for the line a report prints when it is missing
    python: str | None = None   # llama.cpp only: the peers venv's interpreter

    @property
    def missing_text(self) -> str:
        return f"{self.name}: not installed ({self.how})"


def find_transformers() -> Peer:
    """transformers importable from this interpreter? Does not import it (seconds of start-up)."""
    how = "pip install -e '.[test]'"
    if importlib.util.find_spec("transformers") is None:
        return Peer(TRANSFORMERS, False, None, how)
    return Peer(TRANSFORMERS, True, importlib.metadata.version("transformers"), how)


def find_llamacpp(python: str) -> Peer:
    """llama-cpp-python under `python` (the peers venv)? Runs that interpreter once (about a second)
    to read its version; a python that is missing or cannot import llama_cpp counts as not installed."""
    how = "make bench-peers"
    if not python or not Path(python).exists():
        return Peer(LLAMACPP, False, None, how)
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return Peer(LLAMACPP, False, None, how)
    if out.returncode != 0:
        return Peer(LLAMACPP, False, None, how)
    return Peer(LLAMACPP, True, out.stdout.strip(), how, python)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llamacpp_server_argv(python: str, gguf: Path, threads: int, n_ctx: int, port: int) -> list[str]:
    """llama-cpp-python's server on the same GGUF, the same threads for prompt and generation."""
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port", str(port)]


def llama_server_argv(binary: str, gguf: Path, threads: int, slots: int, n_ctx: int, port: int) -> list[str]:
    """llama.cpp's own C++ server (`llama-server`, built by hand: no package ships it here) with `slots`
    parallel sequences: the batching peer, where llama-cpp-python's server serves one request at a time."""
    return [binary, "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(n_ctx),
            "--host", "127.0.0.1", "--port", str(port)]


class LlamaCppServer:
    """`with LlamaCppServer(argv, port, log) as s:` starts llama.cpp's server (either argv above), waits until /v1/models
    answers, and stops it on the way out (SIGTERM, then SIGKILL after 15 s), pass or fail. Side
    effects: a child process for the block's duration; its output goes to `log`."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict[str, str] | None = None):
        self.argv, self.port, self.log, self.env = argv, port, log, env
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "LlamaCppServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready(300.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}; log {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass          # not listening yet
            time.sleep(0.3)
        raise TimeoutError(f"llama.cpp server not ready after {timeout_s:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
