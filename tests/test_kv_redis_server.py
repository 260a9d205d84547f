"""Two real `ternlm serve` replicas sharing one real redis-server, talked to with the official openai
client. The oracle for every answer is a server with prefix reuse off: greedy outputs must be
identical whatever the shared tier did. A conversation moves between replicas (its next turn loads the
prefix from Redis), Redis dies between turns (the turn still answers, the tier reports down and comes
back), two tenants' conversations never share a block, and a replica whose Redis is down at start serves.
"""
from __future__ import annotations

import time

import httpx2 as httpx
import pytest
from openai import OpenAI

from redis_proc import RedisProc
from server_proc import ServerProc
from test_kv_tiers_server import QUESTIONS, system_prompt

MODEL = "smollm2-135m"
COMMON = ("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "1")
KEYS = ("--api-key", "tenant-1", "tenant-2")
MAX = 12
B = 64


@pytest.fixture(scope="module")
def redis_server():
    with RedisProc() as r:
        yield r


@pytest.fixture(scope="module")
def cold():
    """The oracle: prefix reuse off, so no slot and no tier is ever reused."""
    with ServerProc(*COMMON, "--no-prefix-kv") as s:
        yield s


@pytest.fixture(scope="module")
def replicas(redis_server):
    """Replicas A and B: own slots, RAM and disk directory; one Redis. Closed pass or fail."""
    args = (*COMMON, *KEYS, "--cache-redis", redis_server.url)
    with ServerProc(*args) as a, ServerProc(*args) as b:
        yield a, b
        for s in (a, b):
            assert "Traceback" not in s.log(), s.log()[-4000:]


def ask(server: ServerProc, messages: list[dict], key: str = "tenant-1"):
    c = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX, temperature=0)
    return r.choices[0].message.content, r.usage, r.model_extra["timings"]


def turn(server: ServerProc, cold: ServerProc, messages: list[dict], question: str, key: str = "tenant-1"):
    """Ask on `server` and on the oracle; the answers must be identical. Appends the exchange."""
    messages.append({"role": "user", "content": question})
    text, usage, timings = ask(server, messages, key)
    ref, _, _ = ask(cold, messages)
    assert text == ref, f"answer differs from the cache-less run (timings {timings})"
    messages.append({"role": "assistant", "content": text})
    return usage, timings


def redis_metric(server: ServerProc, name: str) -> float:
    for line in httpx.get(server.base + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{tier="redis"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for the redis tier not in /metrics")


def wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def stored(redis_server: RedisProc) -> int:
    return len(redis_server.client().keys("ternlm:kv:*"))


def published(redis_server: RedisProc, before: int, usage) -> None:
    """Wait until the whole blocks of the turn just answered (a conversation sharing no block with the
    `before` keys there were) are in Redis: the replica writes them on its spill thread after answering;
    a router's next turn arrives seconds later, a test's at once."""
    blocks = (usage.prompt_tokens + usage.completion_tokens - 1) // B
    wait_until(lambda: stored(redis_server) >= before + blocks)


def test_turn_two_on_the_other_replica_loads_the_prefix_from_redis(replicas, cold, redis_server):
    a, b = replicas
    msgs = [{"role": "system", "content": system_prompt(0)}]
    before = stored(redis_server)
    usage, t = turn(a, cold, msgs, QUESTIONS[0])
    assert t["cache_redis_n"] == 0
    published(redis_server, before, usage)
    usage2, t2 = turn(b, cold, msgs, QUESTIONS[1])          # B never saw this conversation
    cached = usage2.prompt_tokens_details.cached_tokens
    assert t2["cache_tier"] == "redis" and t2["cache_redis_n"] == cached
    assert cached >= (usage.prompt_tokens // B) * B >= 2 * B
    assert redis_metric(b, "ternlm_kv_tier_hits_total") >= cached // B
    assert redis_metric(b, "ternlm_kv_tier_up") == 1
    # and back to A for turn 3: its own slot still holds turn 1, Redis holds turn 2's blocks from B
    usage3, t3 = turn(a, cold, msgs, QUESTIONS[2])
    assert usage3.prompt_tokens_details.cached_tokens >= usage2.prompt_tokens // B * B


def test_redis_killed_between_turns_the_turn_still_answers_and_the_tier_comes_back(replicas, cold, redis_server):
    a, b = replicas
    msgs = [{"role": "system", "content": system_prompt(1)}]
    before = stored(redis_server)
    usage, _ = turn(a, cold, msgs, QUESTIONS[3])
    published(redis_server, before, usage)
    redis_server.stop()                                      # kill -9
    usage2, t2 = turn(b, cold, msgs, QUESTIONS[4])           # answered from a prefill, identically
    assert t2["cache_redis_n"] == 0
    assert redis_metric(b, "ternlm_kv_tier_up") == 0
    assert redis_metric(b, "ternlm_kv_tier_outages_total") >= 1
    assert "continuing without the redis tier" in b.log()
    redis_server.start()                                     # empty: a restarted cache
    for s in (a, b):
        wait_until(lambda: redis_metric(s, "ternlm_kv_tier_up") == 1)
    usage3, t3 = turn(a, cold, msgs, QUESTIONS[5])           # A's slot still answers; writes resume
    published(redis_server, 0, usage3)                       # into the empty, restarted Redis


def test_two_tenants_never_share_blocks(replicas, cold, redis_server):
    a, b = replicas
    system = {"role": "system", "content": system_prompt(2)}
    one = [system]
    before = stored(redis_server)
    usage, _ = turn(a, cold, one, QUESTIONS[0], key="tenant-1")
    published(redis_server, before, usage)
    two = [system]                                           # the same conversation, another tenant
    _, t = turn(b, cold, two, QUESTIONS[0], key="tenant-2")
    assert t["cache_redis_n"] == 0 and t["cache_n"] == 0
    _, t = turn(b, cold, [system], QUESTIONS[0], key="tenant-1")   # tenant 1 on B: its own blocks
    assert t["cache_redis_n"] >= 2 * B


def test_redis_down_at_start_the_replica_serves_and_says_so(cold):
    from server_proc import free_port
    with ServerProc(*COMMON, "--cache-redis", f"redis://127.0.0.1:{free_port()}/0") as s:
        msgs = [{"role": "system", "content": system_prompt(4)}]
        turn(s, cold, msgs, QUESTIONS[1])
        _, t = turn(s, cold, msgs, QUESTIONS[2])
        assert t["cache_n"] >= 2 * B                            # its own slot still reuses
        assert redis_metric(s, "ternlm_kv_tier_up") == 0
        assert "unreachable at start" in s.log() and "Traceback" not in s.log()
