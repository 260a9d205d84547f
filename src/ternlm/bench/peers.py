"""The comparison peers, found rather than assumed, and the one place that knows how to start llama.cpp:
transformers (in this venv, the `[test]` extra); llama-cpp-python in its own venv (`make bench-peers`),
either as a worker process driven over JSON lines (llamacpp_worker.py, beside this file) or as its
OpenAI-compatible server; and llama.cpp's own `llama-server` binary (scripts/build-llamacpp builds it).
The CLI benchmarks and the scripts under benchmarks/ all take their command lines and processes from here.

A missing peer is a named result (Peer.installed False, with the line that says how to get it), never
an exception: a report without peers still measures ternlm and says what it could not compare."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..procs import die_with_parent
from .common import proc_status

LLAMACPP, TRANSFORMERS = "llama.cpp", "transformers"
PEERS_PYTHON = ".venv-peers/bin/python"     # the peers venv's interpreter, relative to the checkout (Makefile)
WORKER = Path(__file__).with_name("llamacpp_worker.py")   # imports llama_cpp only: runs by path in that venv
SERVER_MODULE = ("-m", "llama_cpp.server")


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


def peers_python(root: Path) -> Path:
    """The peers venv's interpreter in the checkout at `root`, whether it exists or not. Pure."""
    return root / PEERS_PYTHON


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


def llamacpp_server_argv(python: str, gguf: Path, threads: int, n_ctx: int, port: int, extra: Sequence[str] = (),
                         run: Sequence[str] = SERVER_MODULE) -> list[str]:
    """llama-cpp-python's server on the same GGUF, the same threads for prompt and generation, `extra` flags
    last. `run`: how the interpreter starts it (`-m llama_cpp.server`, or `-c CODE` that patches it first). Pure."""
    return [python, *run, "--model", str(gguf), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port", str(port), *extra]


def find_llama_server(root: Path) -> str | None:
    """The llama-server that scripts/build-llamacpp built for the checkout at `root` (`.peers/llama.cpp-*/bin/`,
    the newest build if several), or for its main checkout when `root` is a git worktree (`.git` is then a
    file naming the main repository's worktrees/ entry; worktrees share the main checkout's build, which
    takes 10-20 min). None if there is none: this never builds. Reads the filesystem only."""
    roots = [root]
    dotgit = root / ".git"
    if dotgit.is_file() and (t := dotgit.read_text().strip()).startswith("gitdir:"):
        gitdir = Path(t.split(":", 1)[1].strip())          # <main>/.git/worktrees/<name>
        if gitdir.parent.name == "worktrees":
            roots.append(gitdir.parent.parent.parent)
    for r in roots:
        found = sorted(r.glob(".peers/llama.cpp-*/bin/llama-server"), key=lambda f: f.stat().st_mtime)
        if found:
            return str(found[-1])
    return None


def llama_server_argv(binary: str, gguf: Path, threads: int, slots: int, n_ctx: int, port: int) -> list[str]:
    """llama.cpp's own C++ server (`llama-server`, built by scripts/build-llamacpp) with `slots` parallel
    sequences: the batching peer, where llama-cpp-python's server serves one request at a time. Pure."""
    return [binary, "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(n_ctx),
            "--host", "127.0.0.1", "--port", str(port)]


class LlamaCppServer:
    """`with LlamaCppServer(argv, port, log_path) as s:` starts llama.cpp's server (either argv above), waits until
    /v1/models answers, and stops it on the way out (SIGTERM, then SIGKILL after 15 s), pass or fail. Side
    effects: a child process for the block's duration that dies with this one (PR_SET_PDEATHSIG); its
    output goes to `log_path`. `env`: the child's whole environment (None: this one's)."""

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None):
        self.argv, self.port, self.log_path, self.env = argv, port, log_path, env
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    def __enter__(self) -> "LlamaCppServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=die_with_parent)
        try:
            self._wait_ready(300.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        """Everything the server has printed so far."""
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   + self.log()[-2000:])
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass          # not listening yet
            time.sleep(0.3)
        raise TimeoutError(f"llama.cpp server not ready after {timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LlamaCppWorker:
    """llama-cpp-python in its own venv and process (it must not share our interpreter), driven over
    JSON lines (llamacpp_worker.py lists the commands). Side effect: a child process until close(), which
    dies with this one."""

    def __init__(self, python: str, model_path: Path, threads: int, n_ctx: int):
        self.proc = subprocess.Popen([python, str(WORKER), str(model_path), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=die_with_parent)
        self.call({"op": "ping"})

    def status(self) -> dict[str, int]:
        """The worker process's /proc status (KiB): its RSS holds llama.cpp's model and Python."""
        return proc_status(self.proc.pid)

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
