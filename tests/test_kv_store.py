"""The tiers below the slots, piece by piece: chained block keys, the block file's verification, the
RAM and disk tiers' budgets and faults, with fake KV (arange values, so a test sees exactly which
positions a block carries). No model here except in the last tests, which use tiny random ones.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ternlm.kv.blockfile import BadBlock, BlockKV, decode, encode
from ternlm.kv.blocks import BLOCK_TOKENS, ROOT, block_key, block_refs
from ternlm.kv.disk import DiskTier, block_path, scan
from ternlm.kv.slots import KVShape, Slot
from ternlm.kv.store import Saved, StoreIdentity, TieredStore
from ternlm.engine.runner import Runner

B = BLOCK_TOKENS
NS = b"namespace-A"
IDENT = StoreIdentity("a" * 64, "torch.float32", layers=2, kv_heads=2, row=4)
SHAPE = KVShape(IDENT.layers, IDENT.kv_heads, IDENT.row, torch.float32, 8192, 256)
BLOCK_BYTES = 2 * 2 * 2 * B * 4 * 4      # k + v, fp32


def fake_slot(ids: list[int], ns: bytes = NS, salt: float = 0.0) -> Slot:
    """A slot whose KV at position p holds p (+ salt) everywhere, recorded as fed from `ids`."""
    s = Slot(0, SHAPE, initial_capacity=len(ids))
    pos = torch.arange(s.capacity, dtype=torch.float32) + salt
    s.k[:] = pos.view(1, 1, -1, 1)
    s.v[:] = -pos.view(1, 1, -1, 1)
    s.record.clear(ns)
    s.record.append(list(ids))
    return s


def rand_ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(50000) for _ in range(n)]


# ---- chained keys ------------------------------------------------------------------------------

def test_chained_keys_share_exactly_the_common_full_blocks():
    a = rand_ids(3 * B + 17, 1)
    b = a[:2 * B + 5] + rand_ids(B, 2)          # diverges inside block 2
    ra, rb = block_refs(a, NS), block_refs(b, NS)
    assert len(ra) == 3 and len(rb) == 3          # the partial tail (17 or 5 tokens) has no key
    assert [r.key for r in ra[:2]] == [r.key for r in rb[:2]] and ra[2].key != rb[2].key
    assert ra[0].parent == ROOT and ra[1].parent == ra[0].key
    assert ra[2].key == block_key(ra[1].key, a[2 * B:3 * B], NS)
    # one token changed in block 0 changes every later key: a block's KV depends on all before it
    c = list(a)
    c[3] += 1
    assert all(x.key != y.key for x, y in zip(block_refs(c, NS), ra))
    # another namespace (model, dtype, tenant) shares nothing
    assert all(x.key != y.key for x, y in zip(block_refs(a, b"namespace-B"), ra))
    assert block_refs(a, NS, upto=B + 3)[-1].index == 0


# ---- the block file ----------------------------------------------------------------------------

def make_block(ids: list[int], index: int = 0, ident: StoreIdentity = IDENT, ns: bytes = NS) -> BlockKV:
    refs = block_refs(ids, ns)
    slot = fake_slot(ids, ns)
    store = TieredStore(ident, 1 << 30)
    ref = refs[index]
    return BlockKV(store.meta(ref, ns), slot.k[:, :, ref.start:ref.end].clone(), slot.v[:, :, ref.start:ref.end].clone())


def file_bytes(block: BlockKV) -> bytearray:
    header, payload = encode(block.meta, block.k, block.v, block.state)
    return bytearray(header + b"".join(bytes(p) for p in payload))


def test_block_file_roundtrip_and_every_kind_of_damage():
    ids = rand_ids(2 * B, 3)
    blk = make_block(ids, 1)
    good = file_bytes(blk)
    back = decode(bytearray(good), blk.meta)
    assert torch.equal(back.k, blk.k) and torch.equal(back.v, blk.v)
    assert back.k[0, 0, 0, 0].item() == B     # block 1 starts at position 256

    def bad(data, expect=blk.meta) -> str:
        with pytest.raises(BadBlock) as e:
            decode(bytearray(data), expect)
        return e.value.reason

    assert "truncated" in bad(good[:-1])
    assert "truncated" in bad(good[:5])
    assert "trailing" in bad(good + b"x")
    flipped = bytearray(good)
    flipped[-100] ^= 0x01
    assert "checksum" in bad(flipped)
    assert "magic" in bad(b"PICKLE!!" + good[8:])
    head = bytearray(good)
    at = head.index(b'"ids":[') + 7
    head[at] = ord("9") if head[at] != ord("9") else ord("8")     # a token id in the header
    assert "hash to its key" in bad(head) or "corrupted" in bad(head)
    assert "foreign format" in bad(good.replace(b'"format":1', b'"format":7'))
    foreign = make_block(ids, 1, ident=StoreIdentity("b" * 64, "torch.float32", 2, 2, 4))
    assert "foreign model" in bad(file_bytes(foreign))
    other_ns = make_block(ids, 1, ns=b"tenant-B")
    assert "differs" in bad(file_bytes(other_ns))
    assert "differs" in bad(file_bytes(make_block(ids, 0)))    # another block of the same chain
    decode(bytearray(file_bytes(foreign)))                     # self-consistent: `cache verify` keeps it


# ---- the tiers with fake KV --------------------------------------------------------------------

def test_save_fetch_load_moves_exact_positions(tmp_path):
    ids = rand_ids(3 * B + 40, 4)
    slot = fake_slot(ids)
    store = TieredStore(IDENT, 1 << 30, tmp_path, 1 << 30)
    assert store.save(slot).blocks == 3              # full blocks, and the 40-token tail after them
    assert store.save(slot) == Saved(0, 0)           # already there: nothing copied
    slot.k.zero_()                                   # the slot is reused at once: blocks are copies
    prompt = ids[:3 * B] + [7, 8]
    refs = store.match(prompt, NS, limit=len(prompt) - 1)
    assert [r.index for r in refs] == [0, 1, 2]
    got = store.fetch(refs, NS)
    assert got.tiers == ["ram"] * 3
    dst = Slot(1, SHAPE)
    dst.record.clear(NS)
    Runner(model=None).load_blocks(dst, got.blocks)
    n = 3 * B
    assert dst.record.fed == ids[:n]
    assert torch.equal(dst.k[0, 0, :n, 0], torch.arange(n, dtype=torch.float32))
    assert torch.equal(dst.v[1, 1, :n, 3], -torch.arange(n, dtype=torch.float32))
    assert store.match(prompt, b"other-tenant", len(prompt)) == []


def test_nothing_past_a_taint_or_an_embedding_is_stored(tmp_path):
    ids = rand_ids(4 * B, 5)
    store = TieredStore(IDENT, 1 << 30, tmp_path, 1 << 30)
    tainted = fake_slot(ids)
    tainted.record.tainted_from = 2 * B + 3
    assert store.save(tainted) == Saved(2, 3)       # the tail stops at the taint too
    digest = fake_slot(ids, ns=b"ns2")
    digest.record.digests = {B + 1: b"payload"}
    assert store.save(digest) == Saved(1, 1)


def test_ram_spills_to_disk_and_budgets_hold_under_churn(tmp_path):
    store = TieredStore(IDENT, ram_bytes=2 * BLOCK_BYTES, disk_dir=tmp_path, disk_bytes=5 * BLOCK_BYTES + 40000)
    convs = [rand_ids(2 * B, 100 + i) for i in range(8)]
    for i, ids in enumerate(convs):
        store.save(fake_slot(ids))
        assert store.flush(30)
        assert store.ram.used_bytes <= 2 * BLOCK_BYTES
        on_disk = sum(size for _, size, _ in scan(tmp_path).values())
        assert on_disk <= store.disk.budget and on_disk == store.disk.used_bytes
    assert store.ram.stats.evictions >= 12 and store.disk.stats.evictions > 0
    # the newest conversations are findable, in RAM or on disk; the oldest were evicted
    newest = convs[-1] + [1]
    assert len(store.match(newest, NS, len(newest))) == 2
    oldest = convs[0] + [1]
    assert store.match(oldest, NS, len(oldest)) == []


def test_blocks_waiting_for_disk_serve_as_ram_and_a_full_queue_drops(tmp_path, monkeypatch):
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    gate = threading.Event()
    real_put = store.disk.put

    def slow_put(block):                                         # hold the writer until told
        gate.wait(30)
        return real_put(block)
    monkeypatch.setattr(store.disk, "put", slow_put)
    store.spill.max_pending_bytes = 2 * BLOCK_BYTES
    ids = rand_ids(3 * B, 20)
    store.save(fake_slot(ids))                                   # 3 blocks: 2 wait, the third is dropped
    assert store.spill.dropped == 1
    prompt = ids + [1]
    refs = store.match(prompt, NS, len(prompt))
    assert [r.index for r in refs] == [0, 1]
    got = store.fetch(refs, NS)
    assert got.tiers == ["ram", "ram"] and got.blocks[1].k[0, 0, 0, 0].item() == B
    gate.set()
    assert store.flush(30) and store.disk.blocks == 2
    assert store.fetch(refs, NS).tiers == ["disk", "disk"]


def test_damaged_files_are_dropped_and_reported(tmp_path, caplog):
    ids = rand_ids(3 * B, 6)
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)            # RAM 0: straight to disk
    store.save(fake_slot(ids))
    assert store.flush(30)                                       # the spill thread has written them
    refs = block_refs(ids, NS)
    paths = [block_path(tmp_path, r.key) for r in refs]
    assert all(p.exists() for p in paths)
    with open(paths[1], "r+b") as f:                             # flip one payload byte of block 1
        f.seek(-7, os.SEEK_END)
        b = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x40]))
    fresh = TieredStore(IDENT, 0, tmp_path, 1 << 30)            # as after a restart
    prompt = ids + [5]
    with caplog.at_level(logging.WARNING, logger="ternlm.cache"):
        got = fresh.fetch(fresh.match(prompt, NS, len(prompt)), NS)
    assert got.tiers == ["disk"]                                 # stops before the damaged block
    assert fresh.disk.stats.damaged == 1 and not paths[1].exists()
    assert "checksum" in caplog.text
    paths[2].write_bytes(paths[2].read_bytes()[:1000])           # truncate block 2
    paths[0].unlink()                                            # block 0 gone behind our back
    assert fresh.fetch(fresh.match(prompt, NS, len(prompt)), NS).blocks == []
    assert fresh.match(prompt, NS, len(prompt)) == []            # the miss is remembered


def test_disk_full_turns_writes_off_without_raising(tmp_path, monkeypatch, caplog):
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING, logger="ternlm.cache"):
        store.save(fake_slot(rand_ids(2 * B, 7)))                # must not raise
        assert store.flush(30)
    monkeypatch.setattr(os, "write", real_write)
    assert store.disk.write_disabled and "no space" in caplog.text
    assert list(tmp_path.rglob("*.tmp-*")) == [] and list(tmp_path.rglob("*.tkv")) == []
    assert store.snapshot()["disk"]["write_disabled"] == 1
    store.save(fake_slot(rand_ids(2 * B, 8)))                    # stays off, quietly
    assert store.flush(30)
    assert store.disk.stats.write_errors == 1


def test_unwritable_cache_dir_degrades_to_no_disk_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = TieredStore(IDENT, 0, blocker, 1 << 30)
    assert store.disk.write_disabled
    store.save(fake_slot(rand_ids(B, 9)))


WRITER = textwrap.dedent("""
    import random, sys, torch
    sys.path.insert(0, {tests!r})
    from test_kv_store import IDENT, fake_slot, rand_ids
    from ternlm.kv.store import TieredStore
    store = TieredStore(IDENT, 0, {root!r}, 1 << 40)
    print("ready", flush=True)
    i = 0
    while True:
        store.save(fake_slot(rand_ids(4 * 256, {seed} * 100000 + i)))
        i += 1
""")


def test_two_writers_and_kill_9_leave_only_whole_files(tmp_path):
    """Two processes write blocks into one directory (sharing some keys), both are killed with
    SIGKILL mid-write; every file left verifies, and the next scan removes the orphaned tmp files."""
    tests = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER.format(tests=tests, root=str(tmp_path), seed=s)],
                              stdout=subprocess.PIPE) for s in (1, 1, 2)]   # two share a seed: same keys
    for p in procs:
        assert p.stdout.readline().strip() == b"ready"
    time.sleep(2.0)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    files = scan(tmp_path, clean_tmp=False)
    assert len(files) >= 4
    for key, (path, _, _) in files.items():
        assert decode(bytearray(path.read_bytes())).meta.key == key
    scan(tmp_path)                                      # writers are dead: their tmp files go
    assert list(tmp_path.rglob("*.tmp-*")) == []


def test_a_reader_survives_another_servers_eviction(tmp_path):
    ids = rand_ids(2 * B, 10)
    a = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    b = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    a.save(fake_slot(ids))
    assert a.flush(30)
    prompt = ids + [1]
    refs = b.match(prompt, NS, len(prompt))              # b sees a's files by stat
    assert len(refs) == 2
    DiskTier(tmp_path, 1)._evict(0)                      # a third process evicts everything
    got = b.fetch(refs, NS)
    assert got.blocks == [] and b.disk.stats.damaged == 0


# ---- the engine on tiny models: tiers never change an answer -----------------------------------

@pytest.fixture(scope="module")
def tiny_pair():
    from ternlm.kv.store import CacheConfig
    from tiny import tiny_engine
    cold = tiny_engine("llama", seed=3, prefix_reuse=False, chunk_size=64)[1]

    def warm(root: Path, ram: int, disk: int = 1 << 30, slots: int = 1):
        return tiny_engine("llama", seed=3, min_reuse=1, chunk_size=64, slots=slots,
                           cache=CacheConfig(ram, root, disk))[1]
    return warm, cold


def tiny_block_bytes(engine) -> int:
    c = engine.config
    return 2 * c.num_layers * c.num_kv_heads * B * c.head_dim * 4


def check_same(warm, cold, prompt, **kw):
    a = warm.generate(prompt, max_tokens=4, keep_logits=True, **kw)
    b = cold.generate(prompt, max_tokens=4, keep_logits=True, **kw)
    assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)
    slot = warm.slots[a.slot]
    fed = slot.record.fed
    fresh = Slot(99, slot.shape, initial_capacity=len(fed))
    warm.runner.prefill(fresh, fed)
    assert torch.equal(slot.k[:, :, :len(fed)], fresh.k[:, :, :len(fed)])
    return a


@pytest.mark.parametrize("ram_blocks,tier", [(10**6, "ram"), (0, "disk")])
def test_alternating_conversations_come_back_from_ram_or_disk_bit_exact(tmp_path, tiny_pair, ram_blocks, tier):
    warm_of, cold = tiny_pair
    r = random.Random(11)
    convs = [[r.randrange(256) for _ in range(300 + 90 * i)] for i in range(3)]
    warm = warm_of(tmp_path, ram=ram_blocks * tiny_block_bytes(cold))
    stored = {}                                                 # conversation -> positions of its record
    for step, i in enumerate([0, 1, 2, 0, 2, 1, 0, 1]):
        conv = convs[i]
        out = check_same(warm, cold, conv)
        if step >= 3:                                           # every conversation has been seen
            assert out.restored.tier == tier and out.restored.slot == 0
            assert out.cached_tokens == stored[i]              # all it had (blocks + tail), as a slot
        stored[i] = len(warm.slots[0].record)
        conv += out.token_ids + [r.randrange(256) for _ in range(40)]
        assert warm.store.flush(30)    # spilled blocks reach the disk (else they serve as RAM)
    # restart on the same directory: turn after turn still bit-exact, now from disk
    warm.persist_cache()
    again = warm_of(tmp_path, ram=1 << 30)
    for conv in convs:
        out = check_same(again, cold, conv + [1, 2, 3])
        assert out.restored.tier == "disk" and out.cached_tokens >= B * (len(conv) // B) - B


def test_corrupted_cache_never_changes_an_answer(tmp_path, tiny_pair):
    warm_of, cold = tiny_pair
    r = random.Random(12)
    convs = [[r.randrange(256) for _ in range(600)] for _ in range(4)]
    warm = warm_of(tmp_path, ram=0)
    for conv in convs:
        check_same(warm, cold, conv)
    warm.persist_cache()
    files = sorted(tmp_path.rglob("*.tkv"))
    assert len(files) >= 8
    for i, f in enumerate(files):                           # damage three of every four files
        data = bytearray(f.read_bytes())
        kind = i % 4
        if kind == 0:
            f.write_bytes(data[:len(data) // 2])
        elif kind == 1:
            data[r.randrange(100, len(data))] ^= 0xFF
            f.write_bytes(data)
        elif kind == 2:
            f.write_bytes(b"\0" * len(data))
    fresh = warm_of(tmp_path, ram=0)
    for conv in convs:
        check_same(fresh, cold, conv + [9])
    assert fresh.store.disk.stats.damaged >= 3


def test_tenants_and_embeddings_never_load_foreign_blocks(tmp_path, tiny_pair):
    warm_of, cold = tiny_pair
    warm = warm_of(tmp_path, ram=1 << 30)
    prompt = list(range(200)) * 3                            # 600 tokens, two full blocks
    warm.generate(prompt, max_tokens=2, cache_salt="alice")
    warm.generate([5] * 300, max_tokens=1)                   # evict alice's slot into the tiers
    bob = check_same(warm, cold, prompt + [1], cache_salt="bob")
    assert bob.cached_tokens == 0
    warm.generate([6] * 300, max_tokens=1)
    e = torch.randn(warm.config.hidden_size)
    a = warm.generate(prompt + [2], max_tokens=2, cache_salt="alice", embeds={100: e}, keep_logits=True)
    ref = cold.generate(prompt + [2], max_tokens=2, cache_salt="alice", embeds={100: e}, keep_logits=True)
    # block 0 is loaded only up to the embedding: positions before it do not depend on it
    assert a.cached_tokens == 100 and a.restored.ram == 100 and torch.equal(a.logits, ref.logits)
    warm.generate([7] * 300, max_tokens=1)
    alice = check_same(warm, cold, prompt + [3], cache_salt="alice")
    # the record (prompt + 1 decoded): its blocks and tail, up to n - 1 ([FRESH-LOGITS])
    assert alice.restored.ram == alice.cached_tokens == len(prompt)


def test_close_writes_what_is_pending_and_ends_the_writer(tmp_path):
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    store.save(fake_slot(rand_ids(3 * B, 30)))
    assert store.close(30)
    assert store.disk.blocks == 3 and not store.spill._thread.is_alive()
    store.save(fake_slot(rand_ids(2 * B, 31)))        # after close: dropped, never a hang
    assert store.spill.dropped == 2 and store.disk.blocks == 3
