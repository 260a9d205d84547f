"""Servers the benchmarks (and the tests) start as child processes: the one free_port, the one HTTP
readiness wait, and the one stop (SIGTERM, then SIGKILL) for all of them. `HttpChild` is a process whose
readiness is a GET answering 200; `TernlmServe` is `ternlm serve` on a free port (the launcher the
benchmarks and tests/server_proc.py share); llamacpp.LlamaCppServer is llama.cpp's server on the same base.

Side effects: child processes (each dies with the thread that started it: PR_SET_PDEATHSIG, procs.py at the
package root), their log files, and for TernlmServe a temporary disk-KV directory removed by close()."""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence

from ..procs import die_with_parent

# Every child started here; whatever is still running when this process exits normally is killed (a last line
# of defence: `with` blocks and fixtures stop their servers themselves, and PR_SET_PDEATHSIG covers kills).
LIVE: list[subprocess.Popen] = []


@atexit.register
def _kill_leftovers() -> None:
    for proc in LIVE:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the OS's pick; another process may still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float, what: str, log: Callable[[], str] = str,
              seen: list[int] | None = None, interval_s: float = 0.2) -> None:
    """Block until GET `url` answers 200. Raises RuntimeError (with the end of `log()`) if `proc` exits first,
    TimeoutError after `timeout_s`. `seen` collects the statuses observed (503: still loading)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if seen is not None:
                    seen.append(r.status)
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:     # answering, not ready (503 while the model loads)
            if seen is not None:
                seen.append(e.code)
        except OSError:
            pass                                # not listening yet
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s ({url}):\n{log()[-4000:]}")


def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 30.0,
         group: bool = False) -> int | None:
    """Signal `proc` (its whole process group with `group`: a child started with setsid) and reap it;
    SIGKILL after `timeout_s`. Returns its exit status (None if it had to be killed or never started)."""
    if proc is None:
        return None
    if proc.poll() is None:
        _signal(proc, sig, group)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL, group)
            proc.wait()
            return None
    return proc.returncode


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _preexec(then: Callable[[], None] | None):
    def run() -> None:
        die_with_parent()
        if then is not None:
            then()
    return run


class HttpChild:
    """`argv` as a child process serving HTTP on 127.0.0.1:`port`, its stdout and stderr in `log_path`, ready
    when GET `ready_path` answers 200. `with HttpChild(...) as c:` starts it, waits (stopping it if the wait
    fails), and stops it on the way out, pass or fail. `env`: the child's whole environment (None: this
    one's). `preexec_fn` runs in the child after PR_SET_PDEATHSIG; `group`: stop() signals the process
    group (for a preexec_fn that calls setsid). [DIE-WITH-PARENT] the death signal fires when the *thread*
    that started the child exits: start servers from the thread that outlives them."""

    what = "server"

    def __init__(self, argv: Sequence[str], port: int, log_path: Path, ready_path: str = "/health",
                 env: dict[str, str] | None = None, preexec_fn: Callable[[], None] | None = None,
                 cwd: Path | None = None, group: bool = False, stop_timeout_s: float = 30.0):
        self.argv, self.port, self.log_path, self.ready_path = list(argv), port, Path(log_path), ready_path
        self.env, self.preexec_fn, self.cwd, self.group = env, preexec_fn, cwd, group
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[int] = []     # readiness statuses observed while waiting (503 = loading)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    def start(self) -> "HttpChild":
        """Launch without waiting (call wait_ready)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as f:     # the child holds its own descriptor; a pipe could fill and block
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=self.cwd, preexec_fn=_preexec(self.preexec_fn))
        LIVE.append(self.proc)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> "HttpChild":
        """Wait for `ready_path` 200. On failure the process is stopped before raising: a caller that chained
        `.start().wait_ready()` never got the object to stop, so it must not stay running."""
        try:
            wait_http(self.base + self.ready_path, self.proc, timeout_s, f"{self.what} ({self.log_path})",
                      self.log, self.health_seen)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _signal(self.proc, sig, self.group)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int | None:
        """Signal the server and reap it; SIGKILL if it has not exited in time. Returns its exit status."""
        return stop(self.proc, sig, self.stop_timeout_s if timeout_s is None else timeout_s, self.group)

    def log(self) -> str:
        """Everything the server has printed so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def ternlm_serve_argv(port: int, args: Sequence[str]) -> list[str]:
    """`ternlm serve` under this interpreter on `port` with `args` (its flags). Pure."""
    return [sys.executable, "-m", "ternlm.cli.main", "serve", "--port", str(port), *args]


class TernlmServe(HttpChild):
    """`ternlm serve` with `args` (its flags) on a free port, ready at /health 200 (after the model loaded).
    Without --cache-dir the disk KV tier goes to a fresh temporary directory (so blocks of an earlier run
    never flatter a first turn, and tests never touch the user's cache), removed by close()
    (default_cache_dir=False leaves the choice to the server). `env`: extra variables over this process's
    environment. `log_path`: None = a temporary file that close() removes. `port`: None = a free one."""

    what = "ternlm serve"

    def __init__(self, *args: str, env: dict[str, str] | None = None, preexec_fn=None,
                 default_cache_dir: bool = True, log_path: Path | None = None, port: int | None = None):
        self.args = list(args)
        self.kv_dir: str | None = None
        if "--cache-dir" not in self.args and default_cache_dir:
            self.kv_dir = tempfile.mkdtemp(prefix="ternlm-kv-")
            self.args += ["--cache-dir", self.kv_dir]
        self._temp_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="ternlm-serve-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.extra_env = dict(env or {})
        super().__init__([], port or 0, log_path, "/health",
                         env=dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env), preexec_fn=preexec_fn)
        self._fixed_port = port is not None

    @property
    def v1(self) -> str:
        return self.url

    def start(self) -> "TernlmServe":
        if not self._fixed_port:
            self.port = free_port()
        self.argv = ternlm_serve_argv(self.port, self.args)
        super().start()
        return self

    def close(self) -> None:
        """Stop the server and remove what this launcher made (a temporary log, the temporary KV directory)."""
        self.stop()
        if self._temp_log:
            self.log_path.unlink(missing_ok=True)
        if self.kv_dir is not None:
            shutil.rmtree(self.kv_dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
