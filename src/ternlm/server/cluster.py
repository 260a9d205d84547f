"""`ternlm cluster`: Redis, N `ternlm serve` replicas and HAProxy in front, started and stopped as one.

    client --HTTP--> HAProxy :port  --consistent hash of X-Session-ID (else the body's "user")-->
             replica i :port+1+i  --misses its slots, RAM, disk--> Redis (shared verified KV blocks)

Why HAProxy: it is a Debian package (no binary wheel to trust), it hashes a header or a JSON body
field onto a consistent-hash ring (a replica leaving moves only its own conversations), bounds each
replica's share of load (hash-balance-factor), health-checks `/health` (503 while a replica loads or
drains, so it gets no traffic then) and streams SSE unbuffered. PyPI's sglang-router/vllm-router
install here too, but their routing keys and worker discovery target SGLang/vLLM workers. A request
without a session key is spread round robin; a conversation that lands elsewhere still reuses its
prefix from Redis (kv/redis_tier.py), so routing is an optimisation, never a correctness condition.
Every child is owned by an ExitStack from the line that starts it: Ctrl-C, SIGTERM, a child dying or
an exception stops all of them (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..procs import die_with_parent


def add_cluster_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cluster", help="Redis + N serve replicas + HAProxy, one command (Ctrl-C stops all)",
                              description="Start Redis, N `ternlm serve` replicas sharing it as a KV tier, and "
                                          "HAProxy routing each conversation (X-Session-ID header, or the "
                                          "body's `user`) to one replica. Arguments after `--` go to every "
                                          "replica's `ternlm serve`.")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--host", default="127.0.0.1", help="where HAProxy listens (replicas and Redis: loopback)")
    p.add_argument("--port", type=int, default=8000, help="HAProxy's port; replica i listens on port + 1 + i")
    p.add_argument("--redis", default=None, metavar="URL",
                   help="use this Redis/Valkey instead of starting one (e.g. a shared one on another host)")
    p.add_argument("--redis-maxmemory", default="2gb", help="maxmemory of the Redis started here (allkeys-lru)")
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then more `ternlm serve` flags")
    p.set_defaults(func=cmd_cluster)
    return p


def haproxy_config(host: str, port: int, replicas: list[tuple[str, int]], stats_socket: Path) -> str:
    """HAProxy's configuration: consistent hashing on the session key, /health checks, SSE passthrough,
    and an owner-only stats socket (where `ternlm cluster` sees every replica marked up)."""
    servers = "\n".join(f"    server {name} 127.0.0.1:{p}" for name, p in replicas)
    return f"""global
    maxconn 4096
    stats socket {stats_socket} mode 600 level user
    # bodies up to 1 MiB are buffered whole, so the JSON "user" field can be read (a longer one without
    # X-Session-ID is routed round robin; Redis still serves its prefix)
    tune.bufsize 1048576

defaults
    mode http
    timeout connect 5s
    timeout client 15m
    timeout server 15m
    timeout http-request 60s
    option http-buffer-request

frontend api
    bind {host}:{port}
    http-request set-var(txn.session) req.hdr(x-session-id)
    http-request set-var(txn.session) req.body,json_query('$.user') if !{{ var(txn.session) -m found }}
    default_backend replicas

backend replicas
    balance hash var(txn.session)
    hash-type consistent
    hash-balance-factor 150
    option httpchk GET /health
    http-check expect status 200
    default-server check inter 1s fall 2 rise 1
    http-response set-header X-Ternlm-Replica %[srv_name]
{servers}
"""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(stack: contextlib.ExitStack, name: str, cmd: list[str], logdir: Path, grace: float = 15.0) -> Child:
    """Start `cmd` with output to logdir/name.log; the stack stops it on the way out, whatever happens."""
    log = logdir / f"{name}.log"
    with open(log, "wb") as out:
        # own session: a terminal's Ctrl-C reaches us only, and we stop the children in order
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    child = Child(name, proc, log)
    stack.callback(child.stop, grace)
    return child


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 all free on loopback now (a cluster numbers its parts from its port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _all_up(stats_socket: Path, n: int) -> bool:
    """Whether HAProxy marks all n replicas UP (until then the hash ring still changes as they join)."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2)
            s.connect(str(stats_socket))
            s.sendall(b"show stat\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return False
    rows = [line.split(",") for line in data.decode().splitlines() if line.startswith("replicas,replica")]
    return len(rows) == n and all(r[17] == "UP" for r in rows)        # field 17: status


def redis_ready(port: int) -> bool:
    """Whether a Redis on 127.0.0.1:`port` answers PING (raw RESP: no client needed to wait for it)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _wait(children: list[Child], ready, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for c in children:
            if c.proc.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode} (log: {c.log})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.2)


def _need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(f"`{binary}` is not installed: sudo apt-get install -y "
                                f"{'redis-server' if binary == 'redis-server' else binary} (or scripts/ensure-redis)")
    return path


@dataclass
class Running:
    """A started cluster: where its parts listen, and the Redis it started (None: an external one)."""
    router: str                        # http://127.0.0.1:port (HAProxy)
    replicas: list[str]                # http://127.0.0.1:port of each replica
    redis_url: str
    children: list[Child]
    redis: Child | None
    _start_redis: object = None

    def kill_redis(self) -> None:
        """SIGKILL the Redis this cluster started (a crash, as the replicas see it)."""
        if self.redis is not None and self.redis.proc.poll() is None:
            self.redis.proc.kill()
            self.redis.proc.wait()

    def restart_redis(self) -> None:
        """Start it again on the same port, empty, owned by the same stack; wait until it answers."""
        self.kill_redis()
        self.children.remove(self.redis)
        self.redis = self._start_redis()
        self.children.append(self.redis)


@contextlib.contextmanager
def started(*, model: str, replicas: int, port: int, serve_args: list[str], logdir: Path, host: str = "127.0.0.1",
            redis_url: str | None = None, redis_maxmemory: str = "2gb", stopping=lambda: False):
    """Start Redis (unless redis_url), the replicas (ports port + 1 ..) and HAProxy (port); yield a Running
    once HAProxy sees every replica up. On the way out, whatever happened, stop all (HAProxy first, then
    the replicas, which drain, then Redis). Raises RuntimeError/TimeoutError when a part fails to start."""
    haproxy = _need("haproxy")
    with contextlib.ExitStack() as stack:
        children: list[Child] = []
        redis_child, start_redis = None, None
        if redis_url is None:
            rport = port + 1 + replicas
            server = _need("redis-server")

            def start_redis() -> Child:
                c = _spawn(stack, "redis", [
                    server, "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(logdir), "--maxmemory", redis_maxmemory, "--maxmemory-policy", "allkeys-lru"],
                    logdir, grace=5)
                _wait([c], lambda: redis_ready(rport), "redis", 30)
                return c
            redis_child = start_redis()
            children.append(redis_child)
            redis_url = f"redis://127.0.0.1:{rport}/0"
        reps = [(f"replica{i}", port + 1 + i) for i in range(replicas)]
        for name, p in reps:
            children.append(_spawn(stack, name, [
                sys.executable, "-m", "ternlm.cli.main", "serve", "-m", model, "--port", str(p),
                "--cache-redis", redis_url, *serve_args], logdir))
        cfg = logdir / "haproxy.cfg"
        sock = logdir / "haproxy.sock"
        cfg.write_text(haproxy_config(host, port, reps, sock))
        children.append(_spawn(stack, "haproxy", [haproxy, "-db", "-f", str(cfg)], logdir, grace=5))
        print(f"ternlm cluster: starting {replicas} replicas of {model}, Redis {redis_url}, "
              f"HAProxy on {host}:{port}; logs in {logdir}", file=sys.stderr, flush=True)
        for name, p in reps:
            _wait(children, lambda: stopping() or _healthy(f"http://127.0.0.1:{p}/health"), name, 900)
        _wait(children, lambda: stopping() or _all_up(sock, len(reps)), "haproxy's view of the replicas", 60)
        yield Running(f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{p}" for _, p in reps], redis_url,
                      children, redis_child, start_redis)


def cmd_cluster(args) -> int:
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    serve_args = [a for a in args.serve_args if a != "--"]
    _need("haproxy")
    logdir = Path(tempfile.mkdtemp(prefix="ternlm-cluster-"))
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 1
    try:
        with started(model=args.model, replicas=args.replicas, port=args.port, serve_args=serve_args,
                     logdir=logdir, host=args.host, redis_url=args.redis, redis_maxmemory=args.redis_maxmemory,
                     stopping=lambda: stopping) as run:
            if not stopping:
                print(f"ternlm cluster: ready at http://{args.host}:{args.port}/v1 (send X-Session-ID or "
                      f"`user` to keep a conversation on one replica); Ctrl-C stops all", file=sys.stderr,
                      flush=True)
            while not stopping:
                dead = [c for c in run.children if c.proc.poll() is not None]
                if dead:
                    print(f"ternlm cluster: {dead[0].name} exited with {dead[0].proc.returncode} "
                          f"(log: {dead[0].log}); stopping all", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            print("ternlm cluster: stopping", file=sys.stderr, flush=True)
            rc = 0
            return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"ternlm cluster: {e}; stopped all (logs kept in {logdir})", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if rc == 0:
            shutil.rmtree(logdir, ignore_errors=True)      # a failure keeps its logs
