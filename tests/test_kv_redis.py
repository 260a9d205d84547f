"""The Redis tier against a real redis-server, with fake KV (arange values, tests/test_kv_store.py):
two stores stand for two replicas sharing one Redis. Verification (corrupt, foreign, evicted values
are misses, counted and deleted), tenancy, one round trip per walk and per load, and faults (down at
start, killed mid-run, out of memory) that never raise and heal by themselves.
"""
from __future__ import annotations

import logging
import signal
import time

import pytest
import torch

from redis_proc import RedisProc
from server_proc import free_port
from test_kv_store import IDENT, NS, fake_slot, rand_ids
from ternlm.kv.blockfile import encode
from ternlm.kv.blocks import BLOCK_TOKENS, block_refs
from ternlm.kv.redis_tier import RedisTier, check_url, key_of, redact
from ternlm.kv.store import StoreIdentity, TieredStore

B = BLOCK_TOKENS


@pytest.fixture
def redis_server():
    with RedisProc() as r:
        yield r


def store_on(url: str, ram: int = 1 << 20) -> TieredStore:
    return TieredStore(IDENT, ram, redis=RedisTier(url, timeout_s=0.5))


@pytest.fixture
def pair(redis_server):
    """Two replicas' stores on one Redis; closed (writer and probe threads ended) pass or fail."""
    a, b = store_on(redis_server.url), store_on(redis_server.url)
    try:
        yield a, b
    finally:
        a.close(5)
        b.close(5)


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def count_round_trips(tier: RedisTier) -> list[int]:
    """Wrap the client's pipeline so each execute() (one round trip) is counted."""
    calls = [0]
    real = tier._client.pipeline

    def pipeline(*a, **kw):
        p = real(*a, **kw)
        execute = p.execute

        def counted(*ea, **ekw):
            calls[0] += 1
            return execute(*ea, **ekw)
        p.execute = counted
        return p
    tier._client.pipeline = pipeline
    return calls


def test_a_published_conversation_loads_on_another_replica_verified_in_one_round_trip_each(pair, redis_server):
    a, b = pair
    ids = rand_ids(5 * B + 9, 1)
    slot = fake_slot(ids)
    assert a.publish(slot) == 5                       # whole blocks only; the 9-token tail stays local
    assert a.flush(10)
    assert a.publish(slot) == 0                       # already written: not copied again
    keys = {k.decode() for k in redis_server.client().keys("ternlm:kv:*")}
    assert keys == {key_of(NS, r.key) for r in block_refs(ids, NS)}

    trips = count_round_trips(b.redis)
    prompt = ids + rand_ids(30, 2)
    refs = b.match(prompt, NS, len(prompt) - 1)
    assert len(refs) == 5 and trips[0] == 1           # the walk: one pipelined EXISTS
    got = b.fetch(refs, NS)
    assert trips[0] == 2                              # the load: one pipelined GET
    assert got.tiers == ["redis"] * 5
    for i, blk in enumerate(got.blocks):              # position p holds p: exactly these positions
        assert torch.equal(blk.k, slot.k[:, :, i * B:(i + 1) * B]) and torch.equal(blk.v, slot.v[:, :, i * B:(i + 1) * B])
    snap = b.snapshot()["redis"]
    assert snap["hits"] == 5 and snap["damaged"] == 0 and snap["up"] == 1
    assert b.publish(fake_slot(ids)) == 0             # loaded from Redis: not written back


def test_corrupt_and_foreign_values_are_misses_counted_logged_and_deleted(pair, redis_server, caplog):
    a, b = pair
    ids = rand_ids(4 * B, 3)
    a.publish(fake_slot(ids))
    assert a.flush(10)
    r = redis_server.client()
    refs = block_refs(ids, NS)
    k1, k2 = key_of(NS, refs[1].key), key_of(NS, refs[2].key)
    v = bytearray(r.get(k1))
    v[-5] ^= 0xFF                                     # one payload bit: the checksum catches it
    r.set(k1, bytes(v))
    with caplog.at_level(logging.WARNING, "ternlm.cache"):
        got = b.fetch(b.match(ids + [1], NS, len(ids)), NS)
    assert len(got.blocks) == 1                       # block 0 only: the walk stops at the bad one
    assert r.exists(k1) == 0 and b.redis.stats.damaged == 1
    assert "checksum" in caplog.text

    # a foreign model's value stored under our key (a replica of another build): never used
    foreign = StoreIdentity("b" * 64, IDENT.dtype, IDENT.layers, IDENT.kv_heads, IDENT.row)
    meta = TieredStore(foreign, 0).meta(refs[2], NS)
    k = torch.zeros(IDENT.shape)
    header, payload = encode(meta, k, k)
    r.set(k2, b"".join([header, *payload]))
    got = b.fetch([refs[2]], NS)
    assert got.blocks == [] and r.exists(k2) == 0 and b.redis.stats.damaged == 2
    assert "foreign model" in caplog.text


def test_two_tenants_never_share_blocks(pair, redis_server):
    a, b = pair
    ids = rand_ids(3 * B, 4)
    a.publish(fake_slot(ids, ns=b"tenant-1"))
    assert a.flush(10)
    assert b.match(ids + [1], b"tenant-2", len(ids)) == []
    assert len(b.match(ids + [1], b"tenant-1", len(ids))) == 3
    # even a value copied under the other tenant's key is refused: its header names tenant-1
    r = redis_server.client()
    ref1, ref2 = block_refs(ids, b"tenant-1")[0], block_refs(ids, b"tenant-2")[0]
    r.set(key_of(b"tenant-2", ref2.key), r.get(key_of(b"tenant-1", ref1.key)))
    assert b.fetch([ref2], b"tenant-2").blocks == [] and b.redis.stats.damaged == 1


def test_evicted_between_the_walk_and_the_read_is_a_miss_there(pair, redis_server):
    a, b = pair
    ids = rand_ids(4 * B, 5)
    a.publish(fake_slot(ids))
    assert a.flush(10)
    refs = b.match(ids + [1], NS, len(ids))
    assert len(refs) == 4
    redis_server.client().delete(key_of(NS, refs[2].key))   # what allkeys-lru does under our feet
    got = b.fetch(refs, NS)
    assert len(got.blocks) == 2 and b.redis.up and b.redis.stats.damaged == 0


def test_down_at_start_serves_misses_then_reconnects_by_itself(caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, "ternlm.cache"):
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    store = TieredStore(IDENT, 1 << 20, redis=tier)
    try:
        assert not tier.up and "unreachable at start" in caplog.text
        ids = rand_ids(2 * B, 6)
        t0 = time.perf_counter()
        assert store.match(ids + [1], NS, len(ids)) == [] and store.fetch(block_refs(ids, NS), NS).blocks == []
        assert store.publish(fake_slot(ids)) == 0
        assert time.perf_counter() - t0 < 0.15            # off: no network at all (headroom for a busy host)
        assert store.snapshot()["redis"]["up"] == 0
        with RedisProc(port=port):
            assert wait_for(lambda: tier.up)
            assert store.publish(fake_slot(ids)) == 2 and store.flush(10)
            assert len(store.match(ids + [1], NS, len(ids))) == 2
    finally:
        store.close(5)


def test_killed_mid_run_turns_off_with_one_warning_and_comes_back(caplog):
    port = free_port()
    ids = rand_ids(3 * B, 7)
    with RedisProc(port=port):
        store = store_on(f"redis://127.0.0.1:{port}/0")
    try:
        # the server above was killed on leaving the block: every call now misses, none raises
        with caplog.at_level(logging.WARNING, "ternlm.cache"):
            for _ in range(3):
                assert store.match(ids + [1], NS, len(ids)) == []
                store.publish(fake_slot(ids))
        assert not store.redis.up and store.redis.stats.outages == 1
        assert caplog.text.count("continuing without the redis tier") == 1
        with RedisProc(port=port):
            assert wait_for(lambda: store.redis.up)
            assert store.publish(fake_slot(ids)) == 3 and store.flush(10)   # written again: a new server
            assert len(store.match(ids + [1], NS, len(ids))) == 3
    finally:
        store.close(5)


def test_out_of_memory_turns_the_tier_off_without_failing_anything(caplog):
    with RedisProc(maxmemory="1mb", policy="noeviction") as r:
        store = store_on(r.url)
        try:
            with caplog.at_level(logging.WARNING, "ternlm.cache"):
                for seed in range(200):                    # 8 KiB blocks: past 1 MB, SET answers OOM
                    store.publish(fake_slot(rand_ids(4 * B, 100 + seed)))
                    if not store.redis.up:
                        break
                store.flush(10)
            assert not store.redis.up and store.redis.stats.write_errors >= 1
            assert "OutOfMemoryError" in caplog.text        # Redis's `OOM command not allowed`
            assert store.match(rand_ids(2 * B, 9), NS, 2 * B) == []      # reads answer misses meanwhile
        finally:
            store.close(5)


def test_urls_are_checked_and_passwords_never_logged():
    for ok in ("redis://127.0.0.1:6379/0", "rediss://:pw@h:1/2", "unix:///run/redis.sock"):
        check_url(ok)
    with pytest.raises(ValueError, match="redis://"):
        check_url("http://127.0.0.1:6379")
    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert "s3cret" not in redact("redis://user:s3cret@h:6379/0")


def test_password_from_the_url_or_the_environment_connects(monkeypatch):
    with RedisProc("--requirepass", "s3cret") as r:
        for url, env in ((f"redis://:s3cret@127.0.0.1:{r.port}/1", None), (r.url, "s3cret"), (r.url, None)):
            if env:
                monkeypatch.setenv("TERNLM_REDIS_PASSWORD", env)
            else:
                monkeypatch.delenv("TERNLM_REDIS_PASSWORD", raising=False)
            tier = RedisTier(url, timeout_s=0.3)
            try:
                assert tier.up == (url != r.url or env is not None) and "s3cret" not in tier.url
            finally:
                tier.close()


def test_a_hung_redis_costs_one_timeout_then_the_tier_is_off_until_it_answers(caplog):
    """SIGSTOP freezes the server (a slow or hung Redis): the first call waits one timeout, later calls
    none; SIGCONT and the probe brings the tier back."""
    with RedisProc() as r:
        store = TieredStore(IDENT, 1 << 20, redis=RedisTier(r.url, timeout_s=0.3))
        try:
            ids = rand_ids(2 * B, 10)
            r.proc.send_signal(signal.SIGSTOP)
            try:
                with caplog.at_level(logging.WARNING, "ternlm.cache"):
                    t0 = time.perf_counter()
                    assert store.match(ids + [1], NS, len(ids)) == []
                    first = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    assert store.match(ids + [1], NS, len(ids)) == [] and store.publish(fake_slot(ids)) == 0
                    later = time.perf_counter() - t0
                assert 0.25 < first < 2.0 and later < 0.15, (first, later)   # another wait would be >= 0.3
                assert not store.redis.up and "TimeoutError" in caplog.text
            finally:
                r.proc.send_signal(signal.SIGCONT)
            assert wait_for(lambda: store.redis.up, 40)
            assert store.publish(fake_slot(ids)) == 2 and store.flush(10)
        finally:
            store.close(5)


def test_a_ttl_expires_blocks_and_a_conversation_in_use_is_kept_alive(redis_server):
    tier = RedisTier(redis_server.url, ttl_s=100)
    store = TieredStore(IDENT, 1 << 20, redis=tier)
    try:
        ids = rand_ids(2 * B, 11)
        assert store.publish(fake_slot(ids)) == 2 and store.flush(10)
        r = redis_server.client()
        key = key_of(NS, block_refs(ids, NS)[0].key)
        assert 90 < r.ttl(key) <= 100
        r.expire(key, 5)
        assert store.publish(fake_slot(ids)) == 0          # EXPIRE found both: nothing copied...
        assert r.ttl(key) > 90                             # ...and the one in use lives on
    finally:
        store.close(5)
