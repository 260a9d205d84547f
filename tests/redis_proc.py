"""Test helper: a real `redis-server` (Debian's package, scripts/ensure-redis) on a free loopback port.

Why a real server: the tier's promises (one round trip per walk, timeouts, OOM and eviction, a server
killed and restarted under a running replica) are properties of Redis itself, not of a fake. The
process is owned by a context manager from the line that starts it: `stop()`/`start()` kill and
restart it on the same port mid-test, and `close()` kills it, pass or fail. No persistence: data
lives in memory only, in a temporary directory that goes with it.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from server_proc import _LIVE, free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisProc:
    def __init__(self, *extra: str, maxmemory: str = "512mb", policy: str = "allkeys-lru", port: int = 0):
        """extra: more `redis-server` options (e.g. "--requirepass", "pw"); port 0: a free one."""
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="ternlm-test-redis-")
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--dir", self.dir, "--maxmemory", maxmemory, "--maxmemory-policy", policy, *extra]
        self.proc: subprocess.Popen | None = None
        self._log = open(f"{self.dir}/redis.log", "w+b")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisProc":
        """Start (or restart, same port) and wait until it answers PING."""
        self.proc = subprocess.Popen([REDIS_SERVER, *self.args], stdout=self._log, stderr=subprocess.STDOUT)
        _LIVE.append(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()[-2000:]}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server not ready after {timeout} s: {self.log()[-2000:]}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def stop(self) -> None:
        """Kill -9 (what a crash looks like to the replicas) and wait for the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def client(self):
        import redis
        return redis.Redis.from_url(self.url)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def __enter__(self) -> "RedisProc":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.stop()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
