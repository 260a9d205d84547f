"""Test helper: run a real `ternlm serve` process on a free port and wait until /health says 200.

Why a subprocess and not an in-process app: the server's promises (one engine thread, clean
shutdown on signals, the model loading behind /health) are properties of the process, so the tests
talk to it over TCP exactly as a client would. Output goes to a log file (a pipe could fill up and
block the server); `log()` returns it for assertions and failure messages.
"""
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

import httpx2 as httpx


# Every server a test started; whatever is still running when the test process exits is killed (a
# last line of defence: fixtures and `with` blocks close their servers themselves).
_LIVE: list[subprocess.Popen] = []


@atexit.register
def _kill_leftovers() -> None:
    for proc in _LIVE:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _die_with_parent(then=None):
    """A preexec_fn: the server gets SIGTERM when the test process dies, however it dies (SIGTERM or
    SIGKILL from a CI timeout or a user's kill skip atexit and fixtures; seen: two servers left running
    after the suite was killed). Linux-only (prctl PR_SET_PDEATHSIG); elsewhere atexit stays the
    last line. `then`: the caller's own preexec_fn, run after."""
    def preexec() -> None:
        if sys.platform.startswith("linux"):
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1 = PR_SET_PDEATHSIG
        if then is not None:
            then()
    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, *args: str, preexec_fn=None, env: dict[str, str] | None = None,
                 default_cache_dir: bool = True):
        """args: `ternlm serve` flags. Without --cache-dir the disk KV tier goes to a fresh temporary
        directory, so tests never read or fill the user's cache (default_cache_dir=False leaves the
        choice to the server: give `env` an XDG_CACHE_HOME then). env: extra environment variables."""
        self.args = list(args)
        self.preexec_fn = preexec_fn         # runs in the child before exec (e.g. resource limits)
        self.env = dict(env or {})
        self.kv_dir: str | None = None
        if "--cache-dir" not in self.args and default_cache_dir:
            self.kv_dir = tempfile.mkdtemp(prefix="ternlm-test-kv-")
            self.args += ["--cache-dir", self.kv_dir]
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.health_seen: list[int] = []     # /health statuses observed while waiting (503 = loading)
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="ternlm-serve-", suffix=".log", delete=False)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.base + "/v1"

    def start(self) -> "ServerProc":
        """Launch without waiting for the model (call wait_ready)."""
        self.port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        cmd = [sys.executable, "-m", "ternlm.cli.main", "serve", "--port", str(self.port), *self.args]
        # [DIE-WITH-PARENT] PR_SET_PDEATHSIG fires when the *thread* that started the child exits: tests
        # start servers from their main thread (fixtures, test bodies), never from worker threads.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent(self.preexec_fn))
        _LIVE.append(self.proc)
        return self

    def __enter__(self) -> "ServerProc":
        """`with ServerProc(...) as s:` starts the server and waits for it; it is closed on the way out,
        pass or fail."""
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 300.0) -> "ServerProc":
        """Wait for /health 200. On failure the process is stopped before raising: a caller that
        chained `.start().wait_ready()` never got the object to close, so it must not stay running."""
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> "ServerProc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                r = httpx.get(self.base + "/health", timeout=2.0)
                self.health_seen.append(r.status_code)
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signal the server and wait for it to exit; kill it if it does not. Returns its exit status."""
        if self.proc is None:
            return None
        self.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def close(self) -> None:
        self.stop()
        self._log.close()
        os.unlink(self._log.name)
        if self.kv_dir is not None:
            shutil.rmtree(self.kv_dir, ignore_errors=True)


def serving(*args: str):
    """Generator for a module fixture: `yield from serving(flags...)` runs one real server for the
    module, closes it pass or fail, and checks at the end that it logged no traceback."""
    with ServerProc(*args) as s:
        yield s
        assert "Traceback" not in s.log(), s.log()[-4000:]


def openai_client(s: ServerProc):
    """The official client against `s`: no retries (a failure shows), a generous timeout for 2 cores."""
    from openai import OpenAI
    return OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=300)
