"""Tail entries: a conversation's last partial block goes down a tier with its whole blocks, so a tier
hit is as good as a slot hit and a chat shorter than one block survives its slot.

First with fake KV (arange values: a test sees exactly which positions an entry carries), then on a
tiny model against a cold engine (prefix reuse off): random conversations, evictions and restarts
(hypothesis), logits and KV bit-identical, and the record equal to the ids behind the KV.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ternlm.kv.blockfile import MAGIC, BadBlock, decode, read_header
from ternlm.kv.blocks import ROOT, block_refs, tail_key, tail_locator, tail_name
from ternlm.kv.disk import block_path, scan
from ternlm.kv.slots import Slot
from ternlm.kv.store import TAILS_PER_PARENT, CacheConfig, Saved, TieredStore
from ternlm.engine.runner import Runner
from test_kv_store import IDENT, NS, SHAPE, B, check_same, fake_slot, rand_ids


def load(store: TieredStore, prompt: list[int], ns: bytes = NS) -> Slot:
    """What the engine does with a prompt on an empty slot: whole blocks, then the tail; the slot's
    record is then truncated to what the prompt shares ([FRESH-LOGITS] cap included)."""
    limit = len(prompt) - 1
    refs = store.match(prompt, ns, limit)
    got = store.fetch(refs, ns)
    assert len(got.blocks) == len(refs)
    hit = store.find_tail(prompt, ns, refs, limit)
    dst = Slot(1, SHAPE)
    dst.record.clear(ns)
    Runner(model=None).load_blocks(dst, got.blocks + ([hit.block] if hit else []))
    dst.record.truncate(len(refs) * B + (hit.tokens if hit else 0))
    return dst


def assert_positions(slot: Slot, ids: list[int]) -> None:
    """The slot holds exactly `ids` at positions [0, len): the record, and the KV fake_slot wrote."""
    n = len(ids)
    assert slot.record.fed == ids
    assert torch.equal(slot.k[0, 0, :n, 0], torch.arange(n, dtype=torch.float32))
    assert torch.equal(slot.v[1, 1, :n, 3], -torch.arange(n, dtype=torch.float32))


def rewrite(data: bytes, **fields) -> bytes:
    """The file with header fields replaced (None: removed), re-framed with a correct length."""
    header, off = read_header(data)
    for k, v in fields.items():
        if v is None:
            header.pop(k, None)
        else:
            header[k] = v
    body = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(body)) + body + bytes(data[off:])


# ---- keys and the file format ------------------------------------------------------------------

def test_tail_keys_chain_and_scope_like_blocks():
    ids = rand_ids(2 * B + 30, 1)
    refs = block_refs(ids, NS)
    tail = ids[2 * B:]
    assert tail_key(refs[1].key, tail, NS) != tail_key(refs[0].key, tail, NS)      # chained on the parent
    assert tail_key(ROOT, tail, NS) != tail_key(ROOT, tail, b"tenant-B")             # namespace-scoped
    assert tail_locator(ROOT, NS) != tail_locator(ROOT, b"tenant-B")                 # the root too
    assert tail_key(ROOT, tail[:10], NS) != tail_key(ROOT, tail[:11], NS)
    name = tail_name(refs[1].key, tail, NS)
    assert len(name) == 64 and name[:32] == tail_locator(refs[1].key, NS)


def test_a_tail_file_verifies_like_a_block(tmp_path):
    ids = rand_ids(B + 20, 2)
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)                 # RAM 0: straight to disk
    assert store.save(fake_slot(ids)) == Saved(1, 20)
    assert store.flush(30)
    loc = tail_locator(block_refs(ids, NS)[0].key, NS)
    [meta] = store.disk.tail_heads(loc)
    path = block_path(tmp_path, meta.name)
    assert path.name.startswith(loc.hex() + ".") and meta.ids == tuple(ids[B:]) and meta.shape[2] == 20
    good = bytearray(path.read_bytes())
    back = decode(bytearray(good), meta)
    assert back.meta.tail and back.k[0, 0, 0, 0].item() == B         # positions [64, 84)

    def bad(data: bytes, expect=meta) -> str:
        with pytest.raises(BadBlock) as e:
            decode(bytearray(data), expect)
        return e.value.reason

    at = good.index(b'"ids":[') + 7
    head = bytearray(good)
    head[at] = ord("9") if head[at] != ord("9") else ord("8")       # a token id in the header
    assert "hash to its key" in bad(head) or "corrupted" in bad(head)
    flipped = bytearray(good)
    flipped[-5] ^= 1
    assert "checksum" in bad(flipped)
    assert "kind" in bad(rewrite(good, kind="bulk"))
    assert "shape" in bad(rewrite(good, kind=None))                  # read as a block: 20 positions
    other = TieredStore(IDENT, 0, tmp_path / "b", 1 << 30)
    other.save(fake_slot(ids, ns=b"tenant-B"))
    assert other.flush(30)
    foreign = next(p for p in (tmp_path / "b").rglob("*.tkv") if "." in p.stem)
    assert "differs" in bad(foreign.read_bytes())                    # another tenant's tail
    # scan names it by locator + key; every file verifies; `cache verify` agrees
    assert meta.name in scan(tmp_path)
    from ternlm.cli.main import main
    assert main(["cache", "verify", "--dry-run", "--cache-dir", str(tmp_path)]) == 0


# ---- the RAM tier ------------------------------------------------------------------------------

def test_a_tier_hit_gives_the_whole_record_as_a_slot_would():
    ids = rand_ids(3 * B + 40, 3)
    store = TieredStore(IDENT, 1 << 30)
    assert store.save(fake_slot(ids)) == Saved(3, 40)
    assert_positions(load(store, ids + [7, 8]), ids)                 # blocks + all 40 of the tail
    # the prompt's rest is a prefix of the tail (an identical resend): cut at n - 1
    assert_positions(load(store, ids[:3 * B + 25]), ids[:3 * B + 24])
    # the prompt diverges inside the tail: the shared part only
    assert_positions(load(store, ids[:3 * B + 30] + [99999] + ids[3 * B + 31:]), ids[:3 * B + 30])
    # a chat shorter than one block: its tail follows the namespace's root
    short = rand_ids(30, 4)
    store.save(fake_slot(short))
    assert_positions(load(store, short + [1]), short)
    assert store.find_tail(short + [1], b"tenant-B", [], 30) is None  # another tenant finds nothing


def test_tails_are_bounded_a_growing_conversation_keeps_one():
    store = TieredStore(IDENT, 1 << 30)
    opening = rand_ids(20, 5)                                        # the template's shared opening
    conv = opening + rand_ids(10, 6)
    store.save(fake_slot(conv))
    conv += rand_ids(15, 7)
    assert store.save(fake_slot(conv)).tail == 45                    # grew: replaces its shorter tail
    assert [t.meta.ids for t in store.ram.tails(tail_locator(ROOT, NS))] == [tuple(conv)]
    other = opening + rand_ids(12, 8)                                # shares only the opening: kept too
    store.save(fake_slot(other))
    assert store.ram.tail_entries == 2
    assert_positions(load(store, conv + [1]), conv)
    assert_positions(load(store, other + [1]), other)
    conv += rand_ids(B, 9)                                           # crosses a block boundary
    store.save(fake_slot(conv))
    assert [t.meta.ids for t in store.ram.tails(tail_locator(ROOT, NS))] == [tuple(other)]   # block 0 covers it
    for i in range(TAILS_PER_PARENT + 5):                            # many branches after one parent
        store.save(fake_slot(opening + rand_ids(5, 100 + i)))
    assert len(store.ram.tails(tail_locator(ROOT, NS))) == TAILS_PER_PARENT


# ---- the disk tier: spill, restart, damage ---------------------------------------------------------

def test_tails_spill_survive_a_restart_and_bad_ones_are_misses(tmp_path):
    convs = [rand_ids(B * i + 10 + 7 * i, 10 + i) for i in range(4)]   # 10 to 3 blocks + 31 tokens
    store = TieredStore(IDENT, 1 << 30, tmp_path, 1 << 30)
    for c in convs:
        store.save(fake_slot(c))
    assert store.persist([]) == sum(len(c) // B + 1 for c in convs)  # shutdown: blocks and tails on disk
    fresh = TieredStore(IDENT, 1 << 30, tmp_path, 1 << 30)          # as after a restart
    for c in convs:
        slot = load(fresh, c + [1])
        assert_positions(slot, c)
    assert fresh.disk.stats.hits == sum(len(c) // B + 1 for c in convs)
    # a damaged tail is dropped and reported as a miss: the whole blocks still come back
    c = convs[2]
    path = next(block_path(tmp_path, m.name)
                for m in fresh.disk.tail_heads(tail_locator(block_refs(c, NS)[-1].key, NS)))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x20
    path.write_bytes(bytes(data))
    again = TieredStore(IDENT, 1 << 30, tmp_path, 1 << 30)
    assert_positions(load(again, c + [1]), c[:len(c) // B * B])
    assert again.disk.stats.damaged == 1 and not path.exists()


def test_disk_tails_are_bounded_like_ram_ones(tmp_path):
    store = TieredStore(IDENT, 0, tmp_path, 1 << 30)
    conv = rand_ids(B + 10, 20)
    store.save(fake_slot(conv))
    assert store.flush(30)
    conv += rand_ids(20, 21)
    store.save(fake_slot(conv))
    assert store.flush(30)
    loc = tail_locator(block_refs(conv, NS)[0].key, NS)
    assert [m.ids for m in store.disk.tail_heads(loc)] == [tuple(conv[B:])]
    assert sum("." in p.stem for p in tmp_path.rglob("*.tkv")) == 1
    conv += rand_ids(B, 22)                                          # past a block: block 1 covers it
    store.save(fake_slot(conv))
    assert store.flush(30)
    assert store.disk.tail_heads(loc) == []
    assert sum("." in p.stem for p in tmp_path.rglob("*.tkv")) == 1
    for i in range(TAILS_PER_PARENT + 3):                            # branches: the oldest go
        store.save(fake_slot(rand_ids(B, 30) + rand_ids(3, 40 + i)))
        assert store.flush(30)
    heads = store.disk.tail_heads(tail_locator(block_refs(rand_ids(B, 30), NS)[0].key, NS))
    assert len(heads) == TAILS_PER_PARENT
    newest = [tuple(rand_ids(3, 40 + i)) for i in range(3, TAILS_PER_PARENT + 3)]
    assert sorted(m.ids[-3:] for m in heads) == sorted(newest)


# ---- a tiny model: tails never change an answer ------------------------------------------------

@pytest.fixture(scope="module", params=["auto", "q8_0"])
def tiny(request):
    """auto: the fp32 cache; q8_0: int8 codes + fp16 scales (head_dim 32, a multiple of 32 as q8_0 rows need),
    the tiers holding those rows as they are: warm and cold both q8_0."""
    from tiny import tiny_engine
    kw = dict(kv_dtype="q8_0", head_dim=32) if request.param == "q8_0" else {}
    cold = tiny_engine("llama", seed=5, prefix_reuse=False, chunk_size=64, **kw)[1]
    warm = tiny_engine("llama", seed=5, min_reuse=1, chunk_size=64, slots=2,
                       cache=CacheConfig(1 << 30, None, 0), **kw)[1]
    assert warm.kv_dtype == cold.kv_dtype == {"auto": "float32"}.get(request.param, request.param)
    return warm, cold


def restart(warm, root: Path, ram: int) -> None:
    """What a server restart does to the cache: live slots and the RAM tier go to disk, then an
    empty RAM tier and empty slots over the same directory."""
    if warm.store.disk is not None:
        warm.persist_cache()
        warm.store.close(30)
    warm.store = TieredStore(warm.store.ident, ram, root, 1 << 30)
    for s in warm.slots:
        s.reset()


def test_short_chats_on_fewer_slots_come_back_whole(tiny, tmp_path):
    warm, cold = tiny
    restart(warm, tmp_path, 1 << 30)
    opening = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]               # shared by all: below one block
    convs = [opening + [20 + i] * 5 for i in range(3)]              # three chats, two slots
    had = {}                                                        # chat -> positions its slot held
    for t in range(3):
        for i, conv in enumerate(convs):                            # each turn takes the LRU slot
            out = check_same(warm, cold, conv)
            if t:                                                   # all of it came back, from RAM
                assert out.cached_tokens == had[i] > len(opening) and out.restored.ram == had[i], out.restored
            had[i] = len(warm.slots[out.slot].record)
            conv += out.token_ids + [40 + t, 41, 42]
    assert warm.store.ram.tail_entries == 3 and warm.store.ram.blocks == 3


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.data())
def test_random_conversations_evictions_and_restarts_bit_exact(tiny, tmp_path_factory, data):
    warm, cold = tiny
    root = tmp_path_factory.mktemp("kv")
    block_bytes = 2 * warm.config.num_layers * warm.config.num_kv_heads * B * warm.slots[0].k.shape[-1] \
        * warm.slots[0].k.element_size()           # a row: head_dim floats, or q8_0's head_dim * 17/16 bytes
    ram = data.draw(st.sampled_from([0, 2 * block_bytes, 1 << 30]), label="ram budget")
    restart(warm, root, ram)
    opening = [7] * 9
    convs = [opening + data.draw(st.lists(st.integers(0, 255), min_size=0, max_size=150), label=f"conv {i}")
             for i in range(3)]
    actions = data.draw(st.lists(st.one_of(st.integers(0, 2), st.just("restart"), st.just("evict"),
                                           st.tuples(st.just("edit"), st.integers(0, 2))),
                                 min_size=3, max_size=10), label="actions")
    for a in actions:
        if a == "restart":
            restart(warm, root, ram)
        elif isinstance(a, tuple):                  # an edited turn: the conversation branches anywhere
            conv = convs[a[1]]
            cut = data.draw(st.integers(0, len(conv)))
            conv[cut:] = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=40))
        elif a == "evict":
            for s in range(warm.num_slots):
                warm.generate([200 + s] * data.draw(st.integers(1, 90)), max_tokens=1, slot=s)
        else:
            conv = convs[a]
            out = check_same(warm, cold, conv)      # logits bit-identical; record == ids behind the KV
            slot = warm.slots[out.slot]
            assert slot.record.fed[:len(conv)] == conv
            assert out.restored.tokens == out.cached_tokens
            conv += out.token_ids + data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=70))
    warm.store.close(30)
