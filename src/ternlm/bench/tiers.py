"""`ternlm bench tiers`: where the next turn's KV prefix comes from, and what that costs.

A ~4,000-token conversation (the previous turn) has been answered; the next turn = it + the answer +
a short new user message. Time to first token of that next turn, greedy, when its prefix is

    slot       still in the live slot (the previous turn just ran there)
    ram        in the RAM tier (the slot was taken by an unrelated prompt, which saved it down a tier)
    disk-cold  in the disk tier only (RAM budget 0), its block files dropped from the page cache
    disk-warm  in the disk tier only, its block files still in the page cache
    redis      in the Redis tier only (slot taken, RAM budget 0, no disk): whole blocks, no tail entry
               (tails stay local, redis_tier.py), so it prefills up to 63 tokens more than the others;
               run where a Redis is at hand (--redis URL, or auto: a throwaway local redis-server),
               else skipped, and said so in the report and the results
    none       nowhere: prefix reuse off, the whole prompt is prefilled

interleaved (slot ram disk-cold disk-warm redis none, slot ram ...), medians over --repeats after a warm-up
round. Every case must produce the same first token and logits bit-identical to the same round's cold
prefill ("none", itself compared with the first round's), and must have restored from the tier it is
named after; exit 1 otherwise. The tiers hold the previous turn's whole blocks and its last partial
block (a tail entry), so the ram and disk cases should prefill exactly what the slot case does.
Besides: the disk tier's load bandwidth (bytes of
block files read / seconds reading and verifying them) against the same disk's sequential read
bandwidth (one large file, large reads, page cache dropped: the physical limit), the same block files
read raw (no verification), and sha256 throughput (what verification costs). And per tier, the
bytes a token it holds, measured from what it holds once the conversation is stored there (the slot's
allocated K+V / its capacity; the RAM tier's entries; the disk tier's block files, headers included;
Redis's stored values, and its own MEMORY USAGE of them): --kv-dtype's saving, tier by tier.

One Engine per run (weights load once). The slot and RAM cases get a fresh TieredStore each, swapped
in as `engine.store`, so no tier holds blocks left over from another case; the disk cases share one
disk-only store per round, in a fresh folder (disk-cold writes the blocks, disk-warm finds them), and
wait for its spill thread to finish writing before the timed turn; the previous turn is put back
into the slot from a private "seed" RAM store (its KV is bit-identical to a fresh prefill and costs a
fraction of one). The redis case has one RAM-budget-0 store with a Redis tier for the whole run; before
each round's case the keys of this engine's namespace are deleted (a cache: only ours, and only what a
replica would recompute), then the previous turn's slot is published as a finished request publishes
it. Page cache: posix_fadvise(DONTNEED) per file, checked with mincore; falls back to
/proc/sys/vm/drop_caches only if pages stay resident.
"""
from __future__ import annotations

import ctypes
import contextlib
import hashlib
import mmap
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import command_line, long_chat, median, synthetic_text, write_json
from .procs import free_port
from ..server.cluster import redis_ready

CASES = ("slot", "ram", "disk-cold", "disk-warm", "redis", "none")
EXPECT_TIER = {"slot": "slot", "ram": "ram", "disk-cold": "disk", "disk-warm": "disk", "redis": "redis",
               "none": "none"}
TIERS = ("slot", "ram", "disk", "redis")
# the case whose setup leaves the conversation stored in each tier: where its bytes a token are measured
HELD_IN = {"slot": "slot", "ram": "ram", "disk-cold": "disk", "redis": "redis"}
REDIS_SERVER = "/usr/bin/redis-server"
REDIS_TIMEOUT_S = 5.0              # the tier's per-call timeout: 0.5 s (serve's) may trip on a loaded box
BIG = 1 << 40                      # "large enough" budget for a tier (bytes)
READ_CHUNK = 16 << 20              # sequential reads: 16 MiB at a time
PREV_ANSWER_TOKENS = 24            # the previous turn's answer, as `bench reuse` generates it


# ---- the page cache ------------------------------------------------------------------------------

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where that cannot be asked."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def drop_page_cache(paths: list[Path]) -> dict:
    """Evict the files from the page cache: fsync + posix_fadvise(DONTNEED) each; only if pages stay
    resident, write 1 to /proc/sys/vm/drop_caches (needs root; skipped silently otherwise)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "fadvise"
    left = resident_fraction(paths)
    if left:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "fadvise+drop_caches"
            left = resident_fraction(paths)
        except OSError:
            pass
    return {"method": method, "resident_after": left}


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*/*.tkv"))


# ---- raw disk bandwidth --------------------------------------------------------------------------

def write_seq_file(path: Path, size: int) -> None:
    """`size` bytes of random data (incompressible), fsynced."""
    chunk = os.urandom(min(READ_CHUNK, size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_files(paths: list[Path], buf: bytearray) -> tuple[int, float]:
    """Read the files front to back with large reads into `buf` (no verification): (bytes, seconds)."""
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                total += got
    return total, time.perf_counter() - t0


def sha256_rate(nbytes: int) -> float:
    """Bytes per second of hashlib.sha256 over an in-memory buffer of `nbytes` (what verifying costs)."""
    data = os.urandom(min(nbytes, 64 << 20)) * max(1, nbytes // (64 << 20))
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - t0)


# ---- Redis ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def local_redis(binary: str = REDIS_SERVER, timeout: float = 10.0):
    """A throwaway redis-server on a free 127.0.0.1 port, no persistence, its folder a temp dir; yields
    its URL. Killed, waited for and its folder removed on any exit of the `with` (the bench must not
    leave a server behind). Raises RuntimeError when it does not answer PING within `timeout`."""
    port, work = free_port(), tempfile.mkdtemp(prefix="bench-tiers-redis-")
    log = open(Path(work) / "redis.log", "w+b")
    proc = None
    try:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", work], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not redis_ready(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{binary} did not start (exit {proc.poll()}): "
                                   f"{log.read().decode(errors='replace')[-500:]}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def redis_for(spec: str):
    """--redis's Redis: yields {"url", "source", "skipped"}; url None (and `skipped` the reason) where the
    redis case cannot run. spec: off | auto (REDIS_SERVER started by local_redis, skipped when missing or
    when it fails to start) | a redis:// URL (used as is; not reachable is an error, not a skip)."""
    if spec == "off":
        yield {"url": None, "source": "off", "skipped": "--redis off"}
    elif spec == "auto":
        if not os.access(REDIS_SERVER, os.X_OK):
            yield {"url": None, "source": "auto", "skipped": f"no {REDIS_SERVER} (--redis auto)"}
            return
        with contextlib.ExitStack() as stack:
            try:
                url, why = stack.enter_context(local_redis(REDIS_SERVER)), None
            except (OSError, RuntimeError) as e:
                url, why = None, f"{REDIS_SERVER} did not start: {e}"
            yield {"url": url, "source": f"auto: {REDIS_SERVER}", "skipped": why}
    else:
        yield {"url": spec, "source": "--redis", "skipped": None}


def open_redis_store(ident, url: str):
    """The redis case's store: RAM budget 0 (what the slot saves goes nowhere), no disk, the Redis tier.
    Raises RuntimeError when Redis does not answer."""
    from ..kv.redis_tier import RedisTier, redact
    from ..kv.store import TieredStore
    tier = RedisTier(url, 0, REDIS_TIMEOUT_S)
    if not tier.up:
        tier.close()
        raise RuntimeError(f"redis at {redact(url)} is not reachable: {tier.down_reason}")
    return TieredStore(ident, 0, redis=tier)


def _namespace_keys(client, namespace: bytes) -> list[bytes]:
    """The Redis keys of this engine's namespace (kv/redis_tier.py key_of), by SCAN."""
    from ..kv.redis_tier import key_of
    return list(client.scan_iter(match=key_of(namespace, b"") + "*", count=1000))


def clear_namespace(store, namespace: bytes) -> int:
    """Delete this namespace's keys (a round starts with Redis holding none of the conversation).
    Returns how many went."""
    client = store.redis._client     # the tier's own connection: its URL's password or $TERNLM_REDIS_PASSWORD
    keys = _namespace_keys(client, namespace)
    if keys:
        client.unlink(*keys)
    return len(keys)


def publish_slot(engine, store) -> int:
    """The slot's whole blocks on their way to Redis, as a finished request publishes them
    (engine/core.py after seq.done), then written (flush). Returns how many were queued."""
    queued = store.publish(engine.slots[0])
    if not store.flush(timeout=600):
        raise RuntimeError("the redis tier's writes did not finish in 10 minutes")
    return queued


# ---- bytes a token each tier holds ----------------------------------------------------------------

def slot_held(engine) -> dict:
    """The slot's allocated K and V over its capacity: what a token of context costs in a slot."""
    slot = engine.slots[0]
    # k, v: (attention layers, kv_heads, capacity, row)
    return {"bytes": slot.k.nbytes + slot.v.nbytes, "tokens": slot.capacity,
            "what": "allocated K+V bytes / capacity tokens"}


def ram_held(store) -> dict:
    """The RAM tier's entries (blocks and tails): their K/V bytes over the positions they hold."""
    entries = store.ram.oldest_first()
    held = sum(b.nbytes for b in entries)
    if held != store.snapshot()["ram"]["bytes"]:
        raise RuntimeError("the RAM tier's byte count disagrees with its entries")
    # each entry's k: (layers, kv_heads, tokens, row)
    return {"bytes": held, "tokens": sum(b.k.shape[2] for b in entries), "entries": len(entries),
            "what": "RAM tier entries' bytes / tokens"}


def disk_held(store) -> dict:
    """The disk tier's block files (headers included) over the positions their headers list."""
    from ..kv.blockfile import meta_of, read_file_header
    files = block_files(store.disk.root)
    return {"bytes": sum(p.stat().st_size for p in files),
            "tokens": sum(len(meta_of(read_file_header(p)).ids) for p in files), "entries": len(files),
            "what": "block files' bytes / tokens"}


def redis_held(store, namespace: bytes) -> dict:
    """This namespace's values in Redis (the block files' bytes, byte for byte) over the positions their
    headers list, and Redis's own MEMORY USAGE of those keys (its per-key overhead included)."""
    from ..kv.blockfile import meta_of, read_header
    client = store.redis._client
    keys = _namespace_keys(client, namespace)
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
        pipe.memory_usage(k, samples=0)
    got = pipe.execute()
    values, usage = got[0::2], got[1::2]
    return {"bytes": sum(len(v) for v in values), "tokens": sum(len(meta_of(read_header(v)[0]).ids) for v in values),
            "entries": len(keys), "memory_usage_bytes": sum(u or 0 for u in usage),
            "what": "stored values' bytes / tokens"}


def per_token(held: dict) -> dict:
    """`held` with bytes_per_token (and Redis's MEMORY USAGE a token) added."""
    n = held["tokens"]
    out = dict(held, bytes_per_token=held["bytes"] / n if n else None)
    if "memory_usage_bytes" in held:
        out["memory_usage_per_token"] = held["memory_usage_bytes"] / n if n else None
    return out


# ---- the conversation ----------------------------------------------------------------------------

@dataclass
class Conversation:
    prev: list[int]            # the previous turn's prompt
    answer: str                # what the model answered to it (greedy, PREV_ANSWER_TOKENS at most)
    next: list[int]            # prev + answer + a new user message: the turn being timed
    unrelated: list[int]       # a short prompt with nothing in common, that takes the slot over


def build_conversation(engine, history_tokens: int, next_words: int, seed: int) -> tuple[Conversation, object]:
    """The conversation, and the seed store holding the previous turn's blocks. Runs the previous turn
    once (a full prefill: also the kernels' warm-up)."""
    from ..kv.store import TieredStore
    rng = random.Random(seed)
    msgs = long_chat(engine, history_tokens, rng)
    prev = list(engine.apply_chat_template(msgs))
    seed_store = TieredStore(engine.store.ident, BIG)
    engine.store, engine.prefix_reuse = seed_store, True
    engine.slots[0].reset()
    answer = engine.generate(prev, max_tokens=PREV_ANSWER_TOKENS, temperature=0.0).text
    seed_store.save(engine.slots[0])
    msgs += [{"role": "assistant", "content": answer},
             {"role": "user", "content": synthetic_text(rng, next_words)}]
    nxt = list(engine.apply_chat_template(msgs))
    unrelated = engine.tokenizer.encode("Unrelated request: " + synthetic_text(random.Random(seed + 1), 12))
    return Conversation(prev, answer, nxt, unrelated), seed_store


# ---- one case ------------------------------------------------------------------------------------

def _previous_turn(engine, conv: Conversation, seed_store) -> None:
    """The slot as the previous turn left it: prev's KV (from the seed store: a cheap tail prefill,
    bit-identical KV) + the answer's decoded tokens."""
    engine.store, engine.prefix_reuse = seed_store, True
    engine.slots[0].reset()
    c = engine.generate(conv.prev, max_tokens=PREV_ANSWER_TOKENS, temperature=0.0)
    if c.text != conv.answer:
        raise RuntimeError("the previous turn did not reproduce its answer")


def _evict(engine, conv: Conversation) -> dict:
    """An unrelated request takes the slot over: the slot's blocks are copied down a tier on its path;
    disk (and Redis) writes go on the store's spill threads, waited for here (untimed) so that the next
    turn finds them written and not still pending in memory. Returns the evicting request's figures."""
    disk = engine.store.disk
    w0 = (disk.stats.bytes_written, disk.stats.write_s) if disk is not None else None
    u = engine.generate(conv.unrelated, max_tokens=1)
    if engine.slots[0].record.fed[:len(conv.unrelated)] != conv.unrelated:
        raise RuntimeError("the unrelated prompt did not take the slot")
    t = time.perf_counter()
    if not engine.store.flush(timeout=600):
        raise RuntimeError("the disk tier's writes did not finish in 10 minutes")
    evict = {"ttft_s": u.timings.ttft_s, "prefill_s": u.timings.prefill_s, "flush_wait_s": time.perf_counter() - t}
    if w0 is not None:
        evict["disk_bytes_written"] = disk.stats.bytes_written - w0[0]
        evict["disk_write_s"] = disk.stats.write_s - w0[1]
    return evict


def _held(engine, case: str, namespace: bytes) -> dict | None:
    """What the case's tier holds of the conversation, once stored there (HELD_IN: slot, ram, disk-cold,
    redis; None for the other cases)."""
    store = engine.store
    if case == "slot":
        return slot_held(engine)
    if case == "ram":
        return ram_held(store)
    if case == "disk-cold":
        return disk_held(store)
    if case == "redis":
        if store.ram.blocks:
            raise RuntimeError("the redis case's RAM tier holds blocks")
        return redis_held(store, namespace)
    return None


def run_case(engine, case: str, conv: Conversation, seed_store, disk_store, redis_store=None) -> tuple[dict, torch.Tensor]:
    """Set the case up (untimed), then time the next turn. `disk_store`: this round's disk-only store
    (RAM budget 0), shared by disk-cold and disk-warm; `redis_store`: the run's Redis-only store (the
    redis case). Returns one sample (with `held`: what the case's tier holds, measured before the timed
    turn, where HELD_IN names the case) and the first token's logits."""
    from ..kv.store import TieredStore
    ident = seed_store.ident
    cache, evict, held = {}, None, None
    if case == "none":
        engine.store, engine.prefix_reuse = None, False
        engine.slots[0].reset()
    else:
        _previous_turn(engine, conv, seed_store)
        # slot, ram: a fresh RAM-only store; disk: RAM budget 0 sends evicted blocks on to the disk;
        # redis: RAM budget 0 and no disk, so what the slot saves on eviction goes nowhere
        engine.store = TieredStore(ident, BIG) if case in ("slot", "ram") else \
            redis_store if case == "redis" else disk_store
        namespace = engine.slots[0].record.namespace
        if case == "redis":
            clear_namespace(redis_store, namespace)
            publish_slot(engine, redis_store)
        evict = _evict(engine, conv) if case != "slot" else None
        held = _held(engine, case, namespace)
        if case.startswith("disk"):
            files = block_files(disk_store.disk.root)
            cache = drop_page_cache(files) if case == "disk-cold" else {"method": None}
            cache["resident_before"] = resident_fraction(files)
    store = engine.store
    disk = store.disk if store is not None else None
    d0 = (disk.stats.bytes_read, disk.stats.load_s) if disk is not None else (0, 0.0)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    c = engine.generate(conv.next, max_tokens=1, temperature=0.0, keep_logits=True)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    engine.prefix_reuse = True
    r = c.restored
    sample = {"held": held, "ttft_s": c.timings.ttft_s, "prefill_tokens": c.timings.prefill_tokens,
              "prefill_s": c.timings.prefill_s, "restore_s": c.timings.ttft_s - c.timings.prefill_s,
              "cached_tokens": c.cached_tokens, "prompt_tokens": c.prompt_tokens,
              "restored": {"slot": r.slot, "ram": r.ram, "disk": r.disk, "redis": r.redis, "load_s": r.load_s,
                           "tier": r.tier},
              "first_token": c.logits[0].argmax().item(), "page_cache": cache or None, "evicting_request": evict,
              # page faults and CPU seconds of this process during the timed request (allocator effects)
              "minor_faults": ru1.ru_minflt - ru0.ru_minflt, "major_faults": ru1.ru_majflt - ru0.ru_majflt,
              "user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime}
    if disk is not None:
        sample["disk_bytes_read"] = disk.stats.bytes_read - d0[0]
        sample["disk_load_s"] = disk.stats.load_s - d0[1]
    return sample, c.logits


def bandwidth_round(seq_path: Path, disk_root: Path, buf: bytearray) -> dict:
    """Sequential read of the big file cold and warm, and the block files read raw, cold."""
    out = {}
    drop_page_cache([seq_path])
    n, s = read_files([seq_path], buf)
    out["seq_cold_Bps"] = n / s
    n, s = read_files([seq_path], buf)
    out["seq_warm_Bps"] = n / s
    files = block_files(disk_root)
    drop_page_cache(files)
    n, s = read_files(files, buf)
    out["blockfiles_raw_cold_Bps"], out["blockfiles_bytes"], out["blockfiles"] = n / s, n, len(files)
    drop_page_cache([seq_path])            # leave nothing of ours in the page cache
    return out


# ---- the run -------------------------------------------------------------------------------------

def run(args) -> int:
    """The whole benchmark: exit 0 when every case is bit-identical to the cold prefill and restored from
    its own tier, else 1. The redis case runs inside redis_for(--redis) (a server it started is stopped
    on any exit)."""
    with redis_for(getattr(args, "redis", "off")) as redis:
        if redis["skipped"]:
            print(f"redis case skipped: {redis['skipped']}", flush=True)
        return _run(args, redis)


def _run(args, redis: dict) -> int:
    from ..engine.core import Engine
    from ..kv.store import CacheConfig, TieredStore
    from ..server.cli import default_kv_dir
    torch.set_num_threads(args.threads)
    if args.repeats < 1 or args.history_tokens < 512:
        raise ValueError("--repeats must be >= 1 and --history-tokens >= 512")
    ctx = args.ctx or 8192
    cases = [c for c in CASES if c != "redis" or redis["url"]]
    t0 = time.perf_counter()
    engine = Engine.load(args.model, dtype=args.dtype, weights=getattr(args, "weights", "auto"),
                         kv_dtype=getattr(args, "kv_dtype", "auto"), activations=getattr(args, "activations", "auto"),
                         prefix_reuse=True, min_reuse=args.min_reuse, ctx=ctx, chunk_size=args.chunk, slots=1,
                         cache=CacheConfig(ram_bytes=BIG, disk_dir=None, disk_bytes=0))
    load_s = time.perf_counter() - t0
    args.dtype = engine.dtype_choice.dtype   # "auto" resolved: the result names what ran
    base = Path(args.cache_dir or Path(default_kv_dir()).parent).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=base))
    disk_root, seq_path = work / "kv", work / "seq.bin"
    redis_store = None
    print(f"model {args.model} {args.dtype}, KV {engine.kv_dtype}, {args.threads} threads, ctx {ctx}; disk tier and "
          f"read test in {work}" + (f"; redis {redis['url']} ({redis['source']})" if redis["url"] else ""), flush=True)
    try:
        conv, seed_store = build_conversation(engine, args.history_tokens, args.next_words, args.seed)
        if redis["url"]:
            redis_store = open_redis_store(seed_store.ident, redis["url"])
        print(f"previous turn {len(conv.prev)} tokens, next turn {len(conv.next)} tokens; "
              f"writing a {args.seq_mib} MiB file for the sequential read test", flush=True)
        write_seq_file(seq_path, args.seq_mib << 20)
        buf = bytearray(READ_CHUNK)
        samples: dict[str, list[dict]] = {c: [] for c in cases}
        bw_rounds: list[dict] = []
        first_none = None
        mismatches, wrong_tier = [], []
        for rnd in range(args.warmup + args.repeats):
            warm = rnd < args.warmup
            line, got = [], {}
            rdir = disk_root / f"round{rnd}"      # a fresh disk tier each round: disk-cold writes its blocks
            disk_store = TieredStore(seed_store.ident, 0, rdir, BIG)
            for case in cases:
                s, logits = run_case(engine, case, conv, seed_store, disk_store, redis_store)
                got[case] = (s, logits)
                r = s["restored"]
                others = [t for t in TIERS if t != EXPECT_TIER[case] and r[t]]
                if r["tier"] != EXPECT_TIER[case] or others:
                    wrong_tier.append(f"round {rnd} {case}: restored " +
                                      ", ".join(f"{t} {r[t]}" for t in TIERS) + " tokens")
                line.append(f"{case} {s['ttft_s'] * 1e3:.0f} ms ({s['cached_tokens']} cached, {s['restored']['tier']})")
            ref = got["none"][1]                       # the cold full prefill is the reference
            first_none = ref if first_none is None else first_none
            for case, (s, logits) in got.items():
                other = first_none if case == "none" else ref
                s["same_first_token"] = int(logits[0].argmax()) == int(other[0].argmax())
                s["identical"] = bool(torch.equal(logits, other))
                s["max_abs_logit_diff"] = (logits - other).abs().max().item()
                if not s["identical"]:
                    mismatches.append(f"round {rnd} {case}: first token {s['first_token']} vs {int(other[0].argmax())}"
                                      f" (none{', round 0' if case == 'none' else ''}), "
                                      f"max |dlogit| {s['max_abs_logit_diff']:.3g}")
                if not warm:
                    samples[case].append(s)
            bw = bandwidth_round(seq_path, rdir, buf)
            shutil.rmtree(rdir, ignore_errors=True)
            if not warm:
                bw_rounds.append(bw)
            print(f"  round {rnd}{' (warm-up)' if warm else ''}: " + "  ".join(line)
                  + f"  | seq read cold {bw['seq_cold_Bps'] / 1e9:.2f} GB/s", flush=True)
        sha = sha256_rate(max(1, samples["disk-cold"][0].get("disk_bytes_read", 1 << 20)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if redis_store is not None:           # leave nothing of ours in a Redis we did not start
            with contextlib.suppress(Exception):   # a cleanup error must not hide the run's own
                clear_namespace(redis_store, engine.namespace())
            redis_store.close(timeout=10)

    result = summarize(args, engine, conv, samples, bw_rounds, sha, load_s, ctx)
    result["redis"] = {"url": redact_url(redis["url"]), "source": redis["source"], "skipped": redis["skipped"]}
    result["identical"] = not mismatches
    result["same_first_token"] = all(r["same_first_token"] for rows in samples.values() for r in rows)
    result["mismatches"] = mismatches
    result["tiers_ok"] = not wrong_tier
    result["wrong_tier"] = wrong_tier
    path = write_json(Path(args.out), f"tiers-{Path(str(args.model)).name}.json", result)
    report(result, path)
    return 0 if not mismatches and not wrong_tier else 1


def redact_url(url: str | None) -> str | None:
    """The URL as the results may show it (no password)."""
    from ..kv.redis_tier import redact
    return redact(url) if url else None


def summarize(args, engine, conv: Conversation, samples: dict, bw_rounds: list[dict], sha: float,
              load_s: float, ctx: int) -> dict:
    n = len(conv.next)
    cases = {}
    for case, rows in samples.items():
        med = median([r["ttft_s"] for r in rows])
        ev = [r["evicting_request"] for r in rows if r["evicting_request"]]
        cases[case] = {
            "ttft_s_median": med, "ttft_s": [r["ttft_s"] for r in rows],
            "restore_s_median": median([r["restore_s"] for r in rows]),
            "prefill_s_median": median([r["prefill_s"] for r in rows]),
            "load_s_median": median([r["restored"]["load_s"] for r in rows]),
            "cached_tokens": rows[0]["cached_tokens"], "prefill_tokens": rows[0]["prefill_tokens"],
            "reuse_fraction": rows[0]["cached_tokens"] / n,
            "tokens_by_tier": {t: rows[0]["restored"][t] for t in TIERS},
            # the hit: positions restored from the tier the case is named after
            "restored_from_tier": rows[0]["restored"].get(EXPECT_TIER[case], 0),
            "tier": rows[0]["restored"]["tier"],
            "minor_faults_median": median([r["minor_faults"] for r in rows]),
            "evicting_request_ttft_s_median": median([e["ttft_s"] for e in ev]) if ev else None,
            "evicting_request_disk_write_s_median": (median([e["disk_write_s"] for e in ev])
                                                     if ev and "disk_write_s" in ev[0] else None),
            "sys_s_median": median([r["sys_s"] for r in rows]),
            "identical_logits": all(r["identical"] for r in rows),
            "same_first_token": all(r["same_first_token"] for r in rows),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        }
        if "disk_bytes_read" in rows[0] and rows[0]["disk_bytes_read"]:
            cases[case]["disk_bytes_read"] = rows[0]["disk_bytes_read"]
            cases[case]["disk_load_s_median"] = median([r["disk_load_s"] for r in rows])
            cases[case]["disk_load_Bps_median"] = median([r["disk_bytes_read"] / r["disk_load_s"] for r in rows])
            cases[case]["page_cache"] = [r["page_cache"] for r in rows]
    none = cases["none"]["ttft_s_median"]
    for case, rows in samples.items():
        if rows[0]["held"] is not None:
            cases[case]["held"] = per_token(rows[0]["held"])
    for c in cases.values():
        c["speedup_vs_none"] = none / c["ttft_s_median"]
    bw = {k: median([r[k] for r in bw_rounds]) for k in bw_rounds[0]}
    bw["sha256_Bps"] = sha
    if "disk_load_Bps_median" in cases["disk-cold"]:
        bw["disk_tier_cold_Bps"] = cases["disk-cold"]["disk_load_Bps_median"]
        bw["disk_tier_warm_Bps"] = cases["disk-warm"]["disk_load_Bps_median"]
        bw["disk_tier_cold_over_seq_cold"] = bw["disk_tier_cold_Bps"] / bw["seq_cold_Bps"]
        bw["disk_tier_warm_over_seq_warm"] = bw["disk_tier_warm_Bps"] / bw["seq_warm_Bps"]
        bw["blockfiles_raw_cold_over_seq_cold"] = bw["blockfiles_raw_cold_Bps"] / bw["seq_cold_Bps"]
    cfg = engine.config
    return {"command": command_line(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}, "ctx": ctx, "repeats": args.repeats,
            "warmup_rounds": args.warmup, "engine_load_s": load_s,
            "previous_turn_tokens": len(conv.prev), "next_turn_tokens": n,
            "kv_dtype": engine.kv_dtype, "kv_bytes_per_token": engine.kv_stats()["bytes_per_token"],
            "tiers": tier_figures(cases),
            "seq_file_bytes": args.seq_mib << 20, "cases": cases, "bandwidth": bw,
            "samples": samples, "bandwidth_rounds": bw_rounds}


def tier_figures(cases: dict) -> dict:
    """Per tier: what it held of the conversation (bytes, tokens, bytes a token; HELD_IN's case) and the
    positions each case restored from it; a tier whose case did not run is absent."""
    out = {}
    for case, tier in HELD_IN.items():
        if case in cases and "held" in cases[case]:
            out[tier] = dict(cases[case]["held"], restored={c: v["restored_from_tier"] for c, v in cases.items()
                                                            if EXPECT_TIER[c] == tier})
    return out


def held_table(res: dict):
    """The per-tier bytes a token table (rich)."""
    from rich.table import Table
    t = Table(title=f"bytes a token each tier holds · KV {res['kv_dtype']} "
                    f"({res['kv_bytes_per_token']:,} B a token of K+V, every attention layer)")
    for col in ("tier", "bytes held", "tokens held", "bytes a token", "÷ K+V a token", "tokens restored (case)",
                "measured as"):
        t.add_column(col, justify="left" if col in ("tier", "measured as") else "right")
    for tier, h in res["tiers"].items():
        extra = (f" (Redis MEMORY USAGE {h['memory_usage_per_token']:,.0f} a token)"
                 if h.get("memory_usage_per_token") else "")
        t.add_row(tier, f"{h['bytes']:,}", f"{h['tokens']:,}", f"{h['bytes_per_token']:,.1f}",
                  f"{h['bytes_per_token'] / res['kv_bytes_per_token']:.4f}",
                  ", ".join(f"{n} ({c})" for c, n in h["restored"].items()), h["what"] + extra)
    return t


def report(res: dict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title=f"next turn of a {res['previous_turn_tokens']}-token conversation · {res['model']} "
                    f"{res['dtype']} · {res['threads']} threads · median of {res['repeats']}")
    for col in ("prefix from", "TTFT", "× vs none", "reused", "slot / ram / disk / redis tokens", "prefilled",
                "restore (TTFT - prefill)", "tier load_s", "page faults", "sys s", "logits = none"):
        t.add_column(col, justify="left" if col == "prefix from" else "right")
    for case, c in res["cases"].items():
        tk = c["tokens_by_tier"]
        same = ("yes" if c["identical_logits"] else
                f"NO (max |d| {c['max_abs_logit_diff']:.3g}, first token {'same' if c['same_first_token'] else 'DIFFERS'})")
        t.add_row(case, f"{c['ttft_s_median'] * 1e3:.1f} ms", f"×{c['speedup_vs_none']:.1f}",
                  f"{c['cached_tokens']} ({100 * c['reuse_fraction']:.1f}%)",
                  " / ".join(str(tk.get(t, 0)) for t in TIERS), str(c["prefill_tokens"]),
                  f"{c['restore_s_median'] * 1e3:.1f} ms", f"{c['load_s_median'] * 1e3:.1f} ms",
                  f"{c['minor_faults_median']:,}", f"{c['sys_s_median']:.2f}", same)
    con.print(t)
    con.print(held_table(res))
    if res["redis"]["skipped"]:
        con.print(f"[bold yellow]redis case skipped[/]: {res['redis']['skipped']}")
    ev = [(case, c) for case, c in res["cases"].items() if case in ("ram", "disk-cold", "redis")]
    con.print("the unrelated request that evicted the slot (its blocks go down a tier on its path), TTFT: "
              + "; ".join(f"{case} {c['evicting_request_ttft_s_median'] * 1e3:.0f} ms"
                          + ("" if c["evicting_request_disk_write_s_median"] is None else
                             f" (+ its disk writes, on the spill thread: "
                             f"{c['evicting_request_disk_write_s_median'] * 1e3:.0f} ms)")
                          for case, c in ev))
    bw = res["bandwidth"]
    b = Table(title="disk tier load bandwidth vs the disk (GB/s, medians)")
    for col in ("what", "GB/s", "÷ sequential (same cache state)"):
        b.add_column(col, justify="left" if col == "what" else "right")
    g = lambda x: f"{x / 1e9:.2f}"   # noqa: E731
    b.add_row(f"sequential read, {res['seq_file_bytes'] >> 20} MiB file, page cache dropped", g(bw["seq_cold_Bps"]), "1")
    b.add_row("sequential read, page cache warm", g(bw["seq_warm_Bps"]), "1")
    if "disk_tier_cold_Bps" in bw:
        b.add_row(f"disk tier load (read + verify), cold: {res['cases']['disk-cold']['disk_bytes_read'] / 1e6:.0f} MB",
                  g(bw["disk_tier_cold_Bps"]), f"{bw['disk_tier_cold_over_seq_cold']:.2f}")
        b.add_row("disk tier load (read + verify), warm", g(bw["disk_tier_warm_Bps"]),
                  f"{bw['disk_tier_warm_over_seq_warm']:.2f}")
        b.add_row(f"the {bw['blockfiles']} block files read raw, cold", g(bw["blockfiles_raw_cold_Bps"]),
                  f"{bw['blockfiles_raw_cold_over_seq_cold']:.2f}")
    b.add_row("sha256 in memory (verification)", g(bw["sha256_Bps"]), "")
    con.print(b)
    if res["identical"]:
        con.print(f"first token and logits bit-identical to the cold prefill in all {len(res['cases'])} cases, "
                  "all rounds")
    else:
        con.print(f"[bold red]MISMATCH[/] (logits not bit-identical to the cold prefill; first token "
                  f"{'the same everywhere' if res['same_first_token'] else 'DIFFERS'}): " + "; ".join(res["mismatches"]))
    if not res["tiers_ok"]:
        con.print("[bold red]WRONG TIER[/]: " + "; ".join(res["wrong_tier"]))
    con.print(f"wrote {path}")
