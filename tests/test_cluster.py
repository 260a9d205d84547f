"""`ternlm cluster` for real: Redis, two `ternlm serve` replicas and HAProxy, one process tree owned by
this test from the line that starts it. HAProxy keeps a conversation's turns on one replica (the
X-Session-ID header, or the body's `user`), spreads conversations over both, and Ctrl-C stops all.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx
import pytest
from openai import OpenAI

from server_proc import _LIVE
from ternlm.server.cluster import free_ports
from test_kv_tiers_server import QUESTIONS, system_prompt

MODEL = "smollm2-135m"
REPLICAS = 2


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class Cluster:
    """`ternlm cluster` as a context manager: started on entry, SIGINT (then SIGKILL) on the way out."""

    def __init__(self):
        self.port = free_ports(REPLICAS + 2)
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="ternlm-cluster-", suffix=".log")
        self.proc: subprocess.Popen | None = None

    @property
    def ports(self) -> list[int]:
        return list(range(self.port, self.port + REPLICAS + 2))     # haproxy, replicas, redis

    def __enter__(self) -> "Cluster":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ternlm.cli.main", "cluster", "--replicas", str(REPLICAS), "--port", str(self.port),
             "-m", MODEL, "--", "--dtype", "float32", "--threads", "1", "--slots", "1", "--cache-disk", "0"],
            stdout=self.log, stderr=subprocess.STDOUT)
        _LIVE.append(self.proc)
        try:
            deadline = time.monotonic() + 300
            while b"ready at" not in self.text().encode():
                assert self.proc.poll() is None, self.text()
                assert time.monotonic() < deadline, self.text()
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def text(self) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()          # its children get SIGTERM from PR_SET_PDEATHSIG
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()


@pytest.fixture(scope="module")
def cluster():
    with Cluster() as c:
        yield c


def chat(c: Cluster, messages: list[dict], session: str | None = None, user: str | None = None):
    """(answer, usage, replica name) through HAProxy."""
    client = OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="unused", max_retries=0, timeout=300,
                    default_headers={"X-Session-ID": session} if session else None)
    extra = {"user": user} if user else {}
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0, **extra)
    r = raw.parse()
    return r.choices[0].message.content, r.usage, raw.headers["x-ternlm-replica"]


def test_a_conversation_stays_on_one_replica_and_conversations_spread(cluster):
    msgs = [{"role": "system", "content": system_prompt(3)}]
    seen = []
    for i, q in enumerate(QUESTIONS[:3]):
        msgs.append({"role": "user", "content": q})
        text, usage, replica = chat(cluster, msgs, session="conversation-1")
        msgs.append({"role": "assistant", "content": text})
        seen.append(replica)
        if i:
            assert usage.prompt_tokens_details.cached_tokens >= 2 * 64       # its slot, on that replica
    assert len(set(seen)) == 1, seen
    # the body's `user` routes as consistently as the header
    users = {chat(cluster, [{"role": "user", "content": "hi"}], user="alice")[2] for _ in range(3)}
    assert len(users) == 1
    # many conversations use both replicas (consistent hash: which goes where is fixed by the keys)
    spread = {chat(cluster, [{"role": "user", "content": "hello"}], session=f"s{i}")[2] for i in range(8)}
    assert spread == {f"replica{i}" for i in range(REPLICAS)}
    metrics = httpx.get(f"http://127.0.0.1:{cluster.port + 1}/metrics").text
    assert 'ternlm_kv_tier_up{tier="redis"} 1.0' in metrics


def test_ctrl_c_stops_every_part(cluster):
    assert all(listening(p) for p in cluster.ports)
    assert cluster.stop() == 0, cluster.text()
    deadline = time.monotonic() + 10
    while any(listening(p) for p in cluster.ports) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(listening(p) for p in cluster.ports), cluster.text()
