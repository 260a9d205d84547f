"""Tiers below the slots: host RAM, then disk, then (optionally) Redis shared by replicas. Blocks go
down as they age; lookups walk them in that order.

    slot KV --save (on discard)--> RAM tier --LRU spill (background thread)--> disk tier --LRU--> deleted
    prompt --match (walk chained keys)--> refs found in RAM or disk --fetch--> verified BlockKV
           --find_tail (after the last ref)--> the tail entry sharing most ids with the rest
    finished request --publish--> its slot's whole blocks not yet written --Redis spill thread--> Redis

Why publish on finish, not on eviction: another replica may take the conversation's next turn at
once, while this one still holds it in a slot; a block reaches Redis only if it is there by then.
The Redis walk starts where the local walk missed and is one pipelined EXISTS; its load one pipelined
GET (kv/redis_tier.py).

What is saved is only what the slot's record vouches for: full blocks of record.fed before any
taint or caller-supplied embedding (their ids do not describe their KV), and the partial block after
them as a tail entry (kv/blocks.py). Without the tail a tier hit re-prefilled up to 63 tokens a slot
hit did not, and a conversation shorter than one block did not survive its slot at all.
Tails are bounded: saving one drops the shorter tails of the same conversation (same parent, ids a
prefix of its own) and those a saved whole block covers; at most TAILS_PER_PARENT per parent.
Blocks are copies, so a slot may be overwritten right after `save` returns. This module reads
slots; it never writes one: copying blocks into a slot (and recording them) is the runner's job
([RECORD-WHERE-FED]).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from .blockfile import BlockKV, BlockMeta
from .blocks import BLOCK_TOKENS, BlockRef, block_refs, tail_key, tail_locator, tail_parent
from .record import lcp
from .disk import DiskTier
from .ram import RamTier
from .redis_tier import RedisTier, check_url
from .spill import Spiller
from .slots import Slot

log = logging.getLogger("ternlm.cache")

# Distinct tails kept after one parent block (branches: edited or regenerated turns, or short chats
# that share only the template's opening, all of which follow ROOT); the oldest beyond it goes.
TAILS_PER_PARENT = 16


@dataclass(frozen=True)
class StoreIdentity:
    """What every stored block of this engine shares (written into each block file's header)."""
    model_sha256: str
    dtype: str                       # compute dtype, e.g. "torch.bfloat16"
    layers: int                      # attention layers: the slot's KV (a stored block of another count is refused)
    kv_heads: int
    row: int                         # a K/V row's storage elements (kv/kvtype.py KVType.width of head_dim)
    kv_dtype: str = "float32"        # its format's name (KVType.name)
    # a hybrid model's recurrent state shapes (kv/recurrent.RecurrentShape.shapes): what an entry's state
    # must look like; None for a model without recurrent layers
    state: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.layers, self.kv_heads, BLOCK_TOKENS, self.row)


@dataclass(frozen=True)
class Fetched:
    """Blocks read for a prompt, in order from its start; `tiers[i]` is "ram", "disk" or "redis"."""
    blocks: list[BlockKV] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    load_s: float = 0.0

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK_TOKENS


@dataclass(frozen=True)
class TailHit:
    """A tail entry that continues a prompt after its matched whole blocks: positions
    [start, start + tokens) of the prompt equal the tail's first `tokens` ids (its KV there is valid:
    attention KV of a position does not depend on later ones)."""
    block: BlockKV
    tier: str                        # "ram" | "disk"
    start: int                       # the prompt position it starts at (whole blocks before it)
    tokens: int                      # usable positions, >= 1, already capped at the lookup's limit


@dataclass(frozen=True)
class Saved:
    """What `save` copied into the RAM tier."""
    blocks: int                      # whole blocks not there before
    tail: int                        # positions of the tail entry copied (0: none, or already there)


def storable(slot: Slot) -> int:
    """Positions of the slot's KV that may be stored: before any taint or embedding payload."""
    rec = slot.record
    n = len(rec)
    if rec.tainted_from is not None:
        n = min(n, rec.tainted_from)
    if rec.digests:
        n = min(n, min(rec.digests))
    return n


class TieredStore:
    """Not thread-safe: the engine (on the scheduler's worker thread) is its only user. Disk writes
    happen on the Spiller's thread; blocks waiting for it count as RAM (they are in memory)."""

    def __init__(self, ident: StoreIdentity, ram_bytes: int, disk_dir: Path | None = None,
                 disk_bytes: int = 0, redis: RedisTier | None = None):
        self.ident = ident
        self.ram = RamTier(ram_bytes)
        self.disk = DiskTier(Path(disk_dir), disk_bytes, TAILS_PER_PARENT) \
            if disk_dir is not None and disk_bytes > 0 else None
        self.spill = Spiller(self.disk) if self.disk is not None else None
        self.redis = redis
        # Published blocks wait here for their SET; past 256 MiB a publish drops them (counted).
        self.redis_spill = Spiller(redis, 256 << 20, name="ternlm-kv-redis") if redis is not None else None

    @classmethod
    def from_config(cls, ident: StoreIdentity, cache: "CacheConfig") -> "TieredStore":
        """The tiers a CacheConfig describes. Connects to Redis (short timeouts; down is not an error)."""
        redis = RedisTier(cache.redis_url, cache.redis_ttl, cache.redis_timeout) if cache.redis_url else None
        return cls(ident, cache.ram_bytes, cache.disk_dir, cache.disk_bytes, redis)

    def meta(self, ref: BlockRef, namespace: bytes) -> BlockMeta:
        """What a block of this store at `ref` must be (an expectation: `state` is the shape a state must
        have; `_entry` fixes it for an entry being stored)."""
        i = self.ident
        return BlockMeta(ref.key, ref.parent, namespace, i.model_sha256, i.dtype, i.kv_dtype, i.shape, ref.ids,
                         state=i.state)

    # ---- down: slots -> RAM -> disk --------------------------------------------------------------
    def tail_meta(self, parent: bytes, ids: tuple[int, ...], namespace: bytes) -> BlockMeta:
        i = self.ident
        return BlockMeta(tail_key(parent, list(ids), namespace), parent, namespace, i.model_sha256, i.dtype,
                         i.kv_dtype, (i.layers, i.kv_heads, len(ids), i.row), ids, tail=True, state=i.state)

    @staticmethod
    def _entry(meta: BlockMeta, slot: Slot, start: int, end: int) -> BlockKV:
        """Copies of the slot's KV at [start, end) and, for a hybrid model, of its recurrent state at
        `end` when the slot holds one there (the live state or a snapshot; else the entry is KV only):
        the slot may be reused as soon as this returns."""
        # (layers, kv_heads, end - start, head_dim)
        k = slot.k[:, :, start:end].clone()
        v = slot.v[:, :, start:end].clone()
        at = slot.state.at(end) if slot.state is not None else None
        state = (at[0].clone(), at[1].clone()) if at is not None else None
        return BlockKV(dataclasses.replace(meta, state=None if state is None else meta.state), k, v, state)

    def _held(self, name: bytes, slot: Slot, end: int) -> bool:
        """Whether the RAM tier holds entry `name` as well as the slot could store it now (touched if
        so): an entry stored without a recurrent state is replaced by one with it."""
        if name not in self.ram:
            return False
        if self.ram.peek(name).state is None and slot.state is not None and slot.state.at(end) is not None:
            self.ram.remove(name)
            return False
        self.ram.touch(name)
        return True

    def save(self, slot: Slot, wait: bool = False) -> Saved:
        """Copy the slot's recorded full blocks (those not there yet) and the tail after them into the
        RAM tier, spilling the RAM tier's oldest entries to disk (`wait`: block while the write queue
        is full instead of dropping them). Drops the RAM tails this save supersedes. Reads the slot,
        does not modify it."""
        rec = slot.record
        if not rec.namespace:
            return Saved(0, 0)
        ns, end = rec.namespace, storable(slot)
        refs = block_refs(rec.fed, ns, end)
        copied = 0
        for ref in refs:
            self._drop_tails(tail_locator(ref.parent, ns), ref.ids)   # a whole block covers them
            if self._held(ref.key, slot, ref.end):
                continue
            self._ram_put(self._entry(self.meta(ref, ns), slot, ref.start, ref.end), wait)
            copied += 1
        start = len(refs) * BLOCK_TOKENS
        if start >= end:
            return Saved(copied, 0)
        ids = tuple(rec.fed[start:end])
        meta = self.tail_meta(tail_parent(refs), ids, ns)
        if self._held(meta.name, slot, end):
            return Saved(copied, 0)
        loc = meta.name[:32]
        self._drop_tails(loc, ids)                       # the conversation grew: its shorter tail goes
        for old in self.ram.tails(loc)[:max(0, len(self.ram.tails(loc)) - TAILS_PER_PARENT + 1)]:
            self.ram.remove(old.meta.name)
        self._ram_put(self._entry(meta, slot, start, end), wait)
        return Saved(copied, end - start)

    def _drop_tails(self, locator: bytes, ids: tuple[int, ...]) -> None:
        """Remove the RAM tails after one parent whose ids are a strict prefix of `ids`."""
        for t in self.ram.tails(locator):
            got = t.meta.ids
            if len(got) < len(ids) and ids[:len(got)] == got:
                self.ram.remove(t.meta.name)

    def _ram_put(self, block: BlockKV, wait: bool) -> None:
        for old in self.ram.put(block):
            if self.spill is not None:
                self.spill.submit(old, wait)   # without wait a full queue drops it: a cache may forget

    def publish(self, slot: Slot) -> int:
        """Copy the slot's recorded whole blocks that Redis lacks (one pipelined EXISTS) onto
        the Redis writer's queue (a full queue drops them: a cache may forget). Reads the slot, does not
        modify it. Returns how many were queued. Worker thread, after a request finished."""
        rec, redis = slot.record, self.redis
        if redis is None or not redis.up or not rec.namespace:
            return 0
        queued = 0
        try:
            refs = [r for r in block_refs(rec.fed, rec.namespace, storable(slot)) if r.key not in self.redis_spill]
            for ref, missing in zip(refs, redis.missing(rec.namespace, [r.key for r in refs])):
                if not missing:
                    continue
                queued += self.redis_spill.submit(self._entry(self.meta(ref, rec.namespace), slot, ref.start, ref.end))
        except Exception:       # a bug here must not fail the step it runs after: log, publish less
            log.exception("redis KV cache: publishing a slot's blocks failed")
        return queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until blocks on their way to disk (and Redis) are written. Returns False on timeout."""
        ok = self.spill.flush(timeout) if self.spill is not None else True
        return (self.redis_spill.flush(timeout) if self.redis_spill is not None else True) and ok

    def close(self, timeout: float | None = None) -> bool:
        """Finish pending disk and Redis writes and stop the writer threads. The tiers stay readable."""
        ok = self.spill.close(timeout) if self.spill is not None else True
        if self.redis_spill is not None:
            ok = self.redis_spill.close(timeout) and ok
            self.redis.close()
        return ok

    def persist(self, slots: list[Slot], timeout: float | None = None) -> int:
        """Shutdown: write the RAM tier (oldest first) and then every slot's blocks (most recent last,
        so they are the last the disk's LRU would drop) to disk, and wait for the writes.
        Returns how many of those blocks are on disk afterwards. Also waits for blocks on their way to
        Redis (published, so another replica can take the conversations over)."""
        if self.redis_spill is not None:
            self.redis_spill.flush(10.0 if timeout is None else timeout)   # a cache: never hang the exit
        if self.spill is None or self.disk is None:
            return 0
        for s in slots:
            self.save(s, wait=True)      # slot blocks become the newest RAM entries
        blocks = self.ram.oldest_first()
        for block in blocks:
            self.spill.submit(block, wait=True)
        self.spill.flush(timeout)
        return sum(self.disk.has(b.meta.name) for b in blocks)

    # ---- up: tiers -> a prompt ------------------------------------------------------------------
    def match(self, prompt: list[int], namespace: bytes, limit: int) -> list[BlockRef]:
        """The prompt's leading blocks that some tier holds, walking chained keys from position 0 and
        stopping at the first miss or at `limit` tokens. Reads no payload; changes only counters and
        the disk index (a file another server wrote is indexed when found). Where the local tiers
        miss, one pipelined EXISTS asks Redis for the rest."""
        found = []
        refs = [r for r in block_refs(prompt, namespace, len(prompt)) if r.start < limit]
        for ref in refs:
            if ref.key not in self.ram and not self._pending(ref.key) and \
                    (self.disk is None or not self.disk.has(ref.key)):
                self.ram.stats.misses += 1      # the local walk ends at a block no local tier holds
                if self.disk is not None:
                    self.disk.stats.misses += 1
                break
            found.append(ref)
        if self.redis is not None and len(found) < len(refs):
            rest = refs[len(found):]
            found += rest[:self.redis.present(namespace, [r.key for r in rest])]
        return found

    def find_tail(self, prompt: list[int], namespace: bytes, refs: list[BlockRef], limit: int,
                  beat: int = 0) -> TailHit | None:
        """The tail entry that continues the prompt after its matched whole blocks `refs` (store.match)
        furthest, up to `limit`, or None. Looks only when a tail could take the prompt past `beat`
        positions (what the caller has without it). RAM (and blocks waiting for disk) first; the disk's
        tails (listed and read by header) only when they could give more; the chosen disk tail is read
        and verified in full. Touches LRU order and counters of the tier it comes from."""
        start = len(refs) * BLOCK_TOKENS
        cap = min(limit, start + BLOCK_TOKENS - 1, len(prompt)) - start   # a tail is < one block
        if cap <= 0 or start + cap <= beat:
            return None
        rest = prompt[start:start + cap]
        parent = tail_parent(refs)
        loc = tail_locator(parent, namespace)

        def usable(ids: tuple[int, ...]) -> int:
            return lcp(list(ids[:cap]), rest)
        mem = self.ram.tails(loc) + (self.spill.tails(loc) if self.spill is not None else [])
        best = max(mem, key=lambda b: usable(b.meta.ids), default=None)
        got = usable(best.meta.ids) if best is not None else 0
        if got < cap and self.disk is not None:
            heads = [m for m in self.disk.tail_heads(loc) if usable(m.ids) > got]
            for head in sorted(heads, key=lambda m: -usable(m.ids)):
                # what this request needs: our parent, namespace, model and shape; the header's ids
                # (its key, recomputed from them, must be the one in the file's name)
                expect = self.tail_meta(parent, head.ids, namespace)
                block = self.disk.get(expect) if expect.name == head.name else None   # verified
                if block is not None:
                    return TailHit(block, "disk", start, usable(head.ids))
        if got <= 0:
            return None
        if best.meta.name in self.ram:
            self.ram.get(best.meta.name)                       # LRU touch + hit
        else:
            self.ram.stats.hits += 1                           # waiting for disk: served as RAM
        return TailHit(best, "ram", start, got)

    def fetch(self, refs: list[BlockRef], namespace: bytes) -> Fetched:
        """Read `refs` in order from RAM or disk (verified); stops at the first block that is gone or
        bad (it is dropped from disk and recomputed by the caller). Touches LRU order."""
        t0 = time.perf_counter()
        blocks, tiers = [], []
        for ref in refs:
            t = time.perf_counter()
            tier = "ram"
            if ref.key in self.ram:
                b = self.ram.get(ref.key)
            elif self._pending(ref.key):
                b = self.spill.get(ref.key)      # on its way to disk; None if it just got there
                self.ram.stats.hits += b is not None
            else:
                b = None
            if b is not None:
                self.ram.stats.load_s += time.perf_counter() - t
            elif self.disk is not None:
                self.ram.stats.misses += 1
                b, tier = self.disk.get(self.meta(ref, namespace)), "disk"   # times itself
            if b is None:
                if self.redis is not None:         # the rest, in one pipelined GET, verified
                    got = self.redis.fetch([self.meta(r, namespace) for r in refs[len(blocks):]])
                    blocks += got
                    tiers += ["redis"] * len(got)
                break
            blocks.append(b)
            tiers.append(tier)
        return Fetched(blocks, tiers, time.perf_counter() - t0)

    def _pending(self, key: bytes) -> bool:
        return self.spill is not None and key in self.spill

    # ---- reporting ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per-tier counters and sizes, for /metrics."""
        r = self.ram
        out = {"ram": {"hits": r.stats.hits, "misses": r.stats.misses, "evictions": r.stats.evictions,
                       "bytes": r.used_bytes, "budget_bytes": r.budget, "blocks": r.blocks,
                       "tails": r.tail_entries,
                       "load_seconds": r.stats.load_s}}
        if self.disk is not None:
            d = self.disk
            out["disk"] = {"hits": d.stats.hits, "misses": d.stats.misses, "evictions": d.stats.evictions,
                           "bytes": d.used_bytes, "budget_bytes": d.budget, "blocks": d.blocks,
                           "load_seconds": d.stats.load_s, "damaged": d.stats.damaged,
                           "writes": d.stats.writes, "write_errors": d.stats.write_errors,
                           "write_seconds": d.stats.write_s,
                           "write_disabled": 0 if d.write_disabled is None else 1,
                           "pending_bytes": self.spill.pending_bytes, "write_dropped": self.spill.dropped}
        if self.redis is not None:
            s = self.redis.stats
            out["redis"] = {"hits": s.hits, "misses": s.misses, "damaged": s.damaged, "writes": s.writes,
                            "write_errors": s.write_errors, "load_seconds": s.load_s, "write_seconds": s.write_s,
                            "bytes_read": s.bytes_read, "bytes_written": s.bytes_written, "outages": s.outages,
                            "up": 1 if self.redis.up else 0, "pending_bytes": self.redis_spill.pending_bytes,
                            "write_dropped": self.redis_spill.dropped}
        return out



@dataclass(frozen=True)
class CacheConfig:
    """Budgets of the tiers below the slots. ram_bytes = 0 sends blocks straight to disk;
    disk_dir None or disk_bytes = 0: no disk tier. redis_url None: no Redis tier; redis_ttl 0: keys
    without expiry (Redis's maxmemory policy evicts them); redis_timeout: per connect/read, seconds."""
    ram_bytes: int = 2 << 30
    disk_dir: Path | None = None
    disk_bytes: int = 20 << 30
    redis_url: str | None = None
    redis_ttl: int = 0
    redis_timeout: float = 0.5

    def __post_init__(self) -> None:
        if self.ram_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("cache budgets must be >= 0 bytes")
        if self.redis_url is not None:
            check_url(self.redis_url)
        if self.redis_ttl < 0 or self.redis_timeout <= 0:
            raise ValueError("redis TTL must be >= 0 and its timeout > 0 seconds")
