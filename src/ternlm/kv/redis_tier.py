"""The Redis/Valkey tier: the same verified block files as the disk tier, one key per block, shared by
every replica pointed at the same server.

    ternlm:kv:<ns>:<block key hex> = b"TERNLMKV" | header | payload     (blockfile.py, byte for byte)
    <ns> = sha256(namespace)[:16] hex: model, config, kernel fingerprint and tenant salt; a hash, so
           a key never spells a tenant's salt, and one namespace can be dropped with SCAN/UNLINK

Why it can be trusted: a value is used only after blockfile.decode verified it against what this
request needs (key recomputes from its own parent/ids/namespace, model, dtype, shape, ids, payload
sha256), exactly as a disk file. A value that fails (corrupt, truncated, foreign, stale format) is a
miss: logged, counted as damaged, deleted. Namespaces never meet: the namespace is in the key, in the
block's chained hash and in the header that is checked.

Why it never fails a request: every call has short timeouts and no client-side retries; any error
(refused, timed out, `OOM command not allowed`, READONLY, ...) turns the tier off with one warning,
and lookups answer "miss" without touching the network until the probe thread reconnects (PING with
exponential backoff, 0.5 s doubling to 30 s). Redis evicting a key between the walk and the read is a
plain miss at that block: the caller recomputes from there.

Round trips: a prefix walk is one pipelined EXISTS over every candidate key (`present`), a load one
pipelined GET (`fetch`); a publish asks which blocks are missing in one pipelined EXISTS (`missing`),
and the SETs (with optional EX) happen on a Spiller thread, off the worker.
Tails (a conversation's last partial block) stay in the local tiers: a replica that takes a
conversation over recomputes at most 63 tokens.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from .blockfile import BadBlock, BlockKV, BlockMeta, decode, encode

log = logging.getLogger("ternlm.cache")

SCHEMES = ("redis", "rediss", "unix")
PREFIX = "ternlm:kv:"
PASSWORD_ENV = "TERNLM_REDIS_PASSWORD"    # used when the URL carries no password
_BACKOFF = (0.5, 30.0)           # first and largest wait between reconnect attempts (seconds)


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def check_url(url: str) -> None:
    """Raise ValueError unless `url` is a redis://, rediss:// or unix:// URL (checked at startup)."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(f"--cache-redis must be a redis://, rediss:// or unix:// URL, got {redact(url)!r}")


def key_of(namespace: bytes, name: bytes) -> str:
    """The Redis key of block `name` (its 32-byte key) in `namespace`."""
    return f"{PREFIX}{hashlib.sha256(namespace).hexdigest()[:32]}:{name.hex()}"


@dataclass
class RedisStats:
    hits: int = 0
    misses: int = 0
    damaged: int = 0             # values found bad or foreign: deleted and recomputed
    writes: int = 0
    write_errors: int = 0
    outages: int = 0             # times the tier turned itself off after an error
    bytes_read: int = 0
    bytes_written: int = 0
    load_s: float = 0.0          # seconds in GET + verify of hits
    write_s: float = 0.0


class RedisTier:
    """Thread-safe: the worker reads (present/fetch), the spill thread writes (put), the probe thread
    reconnects. redis-py's connection pool is thread-safe; `_lock` guards the state flags only."""

    def __init__(self, url: str, ttl_s: int = 0, timeout_s: float = 0.5):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        check_url(url)
        self.url = redact(url)
        self.ttl_s = ttl_s
        self.stats = RedisStats()
        self.up = False
        self.down_reason: str | None = "not connected yet"
        self._errors = (redis.RedisError, OSError)
        # One retry, on a broken connection only (a pooled socket to a Redis that restarted); a timeout
        # is not retried: one failed call turns the tier off and the probe thread reconnects.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        # A password in the URL shows in `ps`; $TERNLM_REDIS_PASSWORD keeps it out of the command line.
        env_pw = os.environ.get(PASSWORD_ENV) if urlsplit(url).password is None else None
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=retry, health_check_interval=0,
                                            **({"password": env_pw} if env_pw else {}))
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._warned: tuple[str, str | None] | None = None
        self._warned_at = 0.0
        self._probe = threading.Thread(target=self._reconnect, name="ternlm-kv-redis-probe", daemon=True)
        if self._ping():
            self._set_up()
        else:
            log.warning("redis KV cache: %s unreachable at start (%s); running without it, retrying in the "
                        "background", self.url, self.down_reason)
        self._probe.start()

    # ---- health --------------------------------------------------------------------------------
    def _ping(self) -> bool:
        try:
            self._client.ping()
            return True
        except self._errors as e:
            self.down_reason = _why(e)
            return False

    def _set_up(self) -> None:
        with self._lock:
            self.up, self.down_reason = True, None
        log.info("redis KV cache: connected to %s", self.url)

    def _fail(self, e: BaseException, during: str) -> None:
        """An error on any thread: the tier goes off (one warning per outage; the same error again within
        a minute, e.g. OOM after each reconnect, is logged at debug) and the probe reconnects."""
        with self._lock:
            was_up, self.up = self.up, False
            self.down_reason = _why(e)
        if was_up:
            self.stats.outages += 1
            now = time.monotonic()
            again = self._warned == (during, self.down_reason) and now - self._warned_at < 60
            (log.debug if again else log.warning)(
                "redis KV cache: %s failed (%s); continuing without the redis tier, reconnecting in the "
                "background", during, self.down_reason)
            self._warned, self._warned_at = (during, self.down_reason), now
            self._wake.set()

    def _reconnect(self) -> None:
        wait = _BACKOFF[0]
        while not self._closing:
            if self.up:
                up_at = time.monotonic()
                self._wake.wait()
                self._wake.clear()
                # flapping (up, then the same failure at once: OOM, a proxy in front) keeps backing off
                wait = _BACKOFF[0] if time.monotonic() - up_at > _BACKOFF[1] else min(wait * 2, _BACKOFF[1])
                continue
            time.sleep(wait)
            if self._closing:
                return
            if self._ping():
                self._set_up()
            else:
                wait = min(wait * 2, _BACKOFF[1])

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        try:
            self._client.close()
        except self._errors:
            pass

    # ---- reads (worker thread) -----------------------------------------------------------------
    def present(self, namespace: bytes, names: list[bytes]) -> int:
        """How many of `names` (consecutive blocks of one prompt), from the first, exist: one pipelined
        EXISTS. Reads no value; 0 while the tier is off."""
        if not self.up or not names:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(key_of(namespace, name))
            found = pipe.execute()
        except self._errors as e:
            self._fail(e, "a prefix lookup")
            return 0
        n = 0
        while n < len(found) and found[n]:
            n += 1
        if n < len(names):
            self.stats.misses += 1            # the walk ends at a block no replica wrote (or Redis dropped)
        return n

    def fetch(self, expects: list[BlockMeta]) -> list[BlockKV]:
        """Read and verify these blocks in one pipelined GET; returns the leading verified ones and stops
        at the first that is gone (evicted since `present`) or bad (logged, deleted, counted damaged).
        Never raises; [] while the tier is off or on any error."""
        if not self.up or not expects:
            return []
        t0 = time.perf_counter()
        keys = [key_of(e.namespace, e.name) for e in expects]
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            values = pipe.execute()
        except self._errors as e:
            self._fail(e, "a block read")
            return []
        out = []
        for key, expect, value in zip(keys, expects, values):
            if value is None:
                self.stats.misses += 1        # evicted or expired under our feet
                break
            try:
                with warnings.catch_warnings():  # bytes are read-only; the block is only copied from
                    warnings.simplefilter("ignore", UserWarning)
                    block = decode(value, expect)   # raises BadBlock only, whatever the bytes
            except BadBlock as e:
                self._drop(key, e.reason)
                break
            out.append(block)
            self.stats.bytes_read += len(value)
        self.stats.hits += len(out)
        self.stats.load_s += time.perf_counter() - t0
        return out

    def _drop(self, key: str, reason: str) -> None:
        log.warning("redis KV cache: dropped %s: %s", key, reason)
        self.stats.damaged += 1
        self.stats.misses += 1
        try:
            self._client.delete(key)
        except self._errors as e:
            self._fail(e, "deleting a bad value")

    # ---- writes -------------------------------------------------------------------------------
    def missing(self, namespace: bytes, names: list[bytes]) -> list[bool]:
        """Which of `names` Redis lacks, in one pipelined round trip (worker thread, before copying a
        block to publish it): EXISTS, or with a TTL EXPIRE, which also keeps a conversation in use
        alive. Asked every time, never remembered: Redis evicts, restarts and expires on its own.
        All False (nothing to write) while the tier is off or on an error."""
        if not self.up or not names:
            return [False] * len(names)
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                if self.ttl_s:
                    pipe.expire(key_of(namespace, name), self.ttl_s)
                else:
                    pipe.exists(key_of(namespace, name))
            return [not x for x in pipe.execute()]
        except self._errors as e:
            self._fail(e, "a publish lookup")
            return [False] * len(names)

    def put(self, block: BlockKV) -> bool:
        """SET one block (EX ttl when set). Returns whether it was written; never raises."""
        if not self.up:
            return False
        header, payload = encode(block.meta, block.k, block.v, block.state)
        value = b"".join([header, *payload])
        t0 = time.perf_counter()
        try:
            self._client.set(key_of(block.meta.namespace, block.meta.name), value, ex=self.ttl_s or None)
        except self._errors as e:
            self.stats.write_errors += 1
            self._fail(e, "a block write")
            return False
        self.stats.writes += 1
        self.stats.bytes_written += len(value)
        self.stats.write_s += time.perf_counter() - t0
        return True


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
