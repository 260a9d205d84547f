"""Experts streamed from the GGUF under a byte budget (issue 36): the same bits as resident experts.

A tiny random qwen3moe written as llama.cpp's converter lays it out (tests/hf_to_gguf.py, Q8_0
experts), loaded twice from the same file: every expert converted at load (resident), and the
experts left in the file behind a cache (moe.StreamedExperts). Logits must be torch.equal, not
close: a streamed expert is the same bytes through the same conversion. The cache's own accounting
must never exceed its budget, and a budget that holds every expert reads nothing after warm-up.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import FastGGUFReader, config_from_gguf, expert_slabs, load_gguf
from ternlm.models.moe import EXPERTS_IN_USE, ExpertStore, StreamedExperts, plan_expert_cache
from ternlm.engine.weights import choose_weights
from hf_to_gguf import write_gguf
from test_moe import hf_model, ids_of


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-q8.gguf"
    write_gguf(hf_model("qwen3moe", seed=5), path, "qwen3moe", quant=QT.Q8_0)
    return path


def _engine(path, budget: int | None, quantized: bool = True) -> Engine:
    loaded = load_gguf(path, torch.float32, keep_quantized=quantized, lanes=quantized, expert_budget=budget)
    weights = choose_weights("gguf", "auto", True, activations="fp32") if quantized else None
    return Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32")


def _expert_bytes(engine: Engine) -> int:
    """One converted expert's bytes (every expert has the same shapes and types here)."""
    store = engine.model.experts
    return store.get(0, 0).nbytes


@pytest.mark.parametrize("quantized", [True, False], ids=["q8_0-native", "q8_0-dense"])
def test_streamed_experts_give_the_resident_bits(moe_file, quantized):
    resident = _engine(moe_file, None, quantized)
    assert isinstance(resident.model.experts, ExpertStore)
    one = _expert_bytes(resident)
    budget = 2 * one + one // 2                        # room for two experts of the 8 x 2 layers
    streamed = _engine(moe_file, budget, quantized)
    store = streamed.model.experts
    assert isinstance(store, StreamedExperts) and len(store) == 0, "nothing converted at load"

    ids = ids_of(70, seed=3)
    whole = resident.logits(ids)
    assert torch.equal(streamed.logits(ids), whole)
    s = store.stats
    assert s.misses > 0 and s.evictions > 0 and s.bytes_read > 0
    assert store.nbytes <= budget and len(store) <= 2

    # chunked prefill (chunks of 5: experts seeing 1..5 rows, the cache thrashing) then decode
    streamed.runner.chunk_size = 5
    resident.runner.chunk_size = 5
    last = streamed.runner.prefill(streamed.slots[0], ids[:-1])
    assert torch.equal(last, whole[-2])
    assert torch.equal(streamed.runner.decode(streamed.slots[0], ids[-1]), whole[-1])
    assert store.nbytes <= budget


@pytest.mark.parametrize("kept", [0, 2], ids=["ring-only", "ring-and-kept"])
def test_experts_served_unkept_reuse_the_rings_buffers_with_the_resident_bits(moe_file, kept):
    """[RING] an expert served and not kept is converted into one of EXPERTS_IN_USE reused buffer sets:
    the same logits as resident (torch.equal), the rings within the budget, no new buffers a miss."""
    resident = _engine(moe_file, None)
    one = _expert_bytes(resident)
    budget = EXPERTS_IN_USE * one + kept * one + one // 2     # one signature here (every expert Q8_0 alike)
    streamed = _engine(moe_file, budget)
    store = streamed.model.experts
    assert store.ring_reserve == EXPERTS_IN_USE * one
    ids = ids_of(70, seed=3)
    whole = resident.logits(ids)
    assert torch.equal(streamed.logits(ids), whole)
    streamed.runner.chunk_size = resident.runner.chunk_size = 5
    assert torch.equal(streamed.runner.prefill(streamed.slots[0], ids[:-1]), whole[-2])
    assert torch.equal(streamed.runner.decode(streamed.slots[0], ids[-1]), whole[-1])
    s = store.stats
    assert s.evictions > EXPERTS_IN_USE and len(store) == kept
    assert store.ring_bytes == store.ring_reserve and store.nbytes + store.ring_reserve <= budget
    ring = next(iter(store._rings.values()))
    assert len(ring.slots) == EXPERTS_IN_USE                     # bounded: slots reused, none added


def test_an_unkept_expert_is_valid_for_experts_in_use_more(moe_file):
    """The contract at `get`: an expert served and not kept stays valid until EXPERTS_IN_USE more experts
    have been served unkept after it; the next one overwrites its buffers (so the contract is real)."""
    resident = _engine(moe_file, None)
    streamed = _engine(moe_file, 0)                         # nothing kept: every get is served unkept
    store, cfg = streamed.model.experts, streamed.config
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    keys = [(layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts)][:EXPERTS_IN_USE + 1]
    want = [resident.model.experts.get(*k).gate_up(x) for k in keys]
    got = [store.get(*k) for k in keys[:EXPERTS_IN_USE]]
    for g, w in zip(got, want):                             # EXPERTS_IN_USE held at once: all valid
        assert torch.equal(g.gate_up(x), w)
    store.get(*keys[EXPERTS_IN_USE])                        # one more served unkept
    assert torch.equal(got[0].gate_up(x), want[EXPERTS_IN_USE])      # the first's buffers now hold it
    for g, w in zip(got[1:], want[1:EXPERTS_IN_USE]):
        assert torch.equal(g.gate_up(x), w)
    assert store.nbytes == 0 and store.ring_bytes == store.ring_reserve


def test_each_expert_is_read_once_per_layer_per_step(moe_file):
    """A prefill chunk asks the store once per expert a row uses, for all its rows: with a cache that
    keeps nothing, bytes read == that many experts' slabs, never once per row."""
    engine = _engine(moe_file, 0)
    store, cfg = engine.model.experts, engine.config
    ids = ids_of(40, seed=4)
    engine.logits(ids)
    s = store.stats
    assert len(store) == 0 and store.nbytes == 0 and s.hits == 0
    assert s.rows == 40 * cfg.experts_per_token * cfg.num_layers
    assert s.misses <= cfg.num_layers * cfg.num_experts < s.rows      # grouped by expert
    slab = sum(x.length for x in store._slabs[(0, 0)])
    assert s.bytes_read == s.misses * slab


def test_a_budget_for_every_expert_reads_nothing_after_warm_up(moe_file):
    engine = _engine(moe_file, 1 << 30)
    store = engine.model.experts
    ids = ids_of(60, seed=6)
    first = engine.logits(ids)
    read, misses = store.stats.bytes_read, store.stats.misses
    assert read > 0 and store.stats.evictions == 0
    assert torch.equal(engine.logits(ids), first)
    assert store.stats.bytes_read == read and store.stats.misses == misses     # all hits
    assert store.stats.hits >= misses
    stats = engine.expert_stats()
    assert stats["streamed"] and stats["budget"] == 1 << 30 and stats["bytes_read"] == read
    assert stats["resident_bytes"] == store.nbytes <= stats["budget"]


def test_completion_reports_this_requests_expert_traffic(moe_file):
    engine = _engine(moe_file, 0)
    c = engine.generate(ids_of(20, seed=8), max_tokens=3, temperature=0.0)
    assert c.experts["misses"] > 0 and c.experts["bytes_read"] > 0 and c.experts["hits"] == 0
    before = engine.expert_stats()["bytes_read"]
    c2 = engine.generate(ids_of(20, seed=8), max_tokens=3, temperature=0.0)
    assert c2.experts["bytes_read"] == engine.expert_stats()["bytes_read"] - before
    from ternlm.server.schemas import timings
    assert timings(c2)["experts"] == c2.experts
    assert Engine.expert_stats(_engine_dense_stub()) is None


def _engine_dense_stub():
    class Model:
        experts = None

    class Stub:
        model = Model()
    return Stub()


def test_slabs_are_the_stacked_tensors_pieces(moe_file):
    reader = FastGGUFReader(moe_file)
    cfg = config_from_gguf(reader)
    slabs = expert_slabs(reader, cfg)
    assert len(slabs) == cfg.num_layers * cfg.num_experts
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    gate, up, down = slabs[(1, 3)]
    per = int(t.n_bytes) // cfg.num_experts
    assert down.offset == int(t.data_offset) + 3 * per and down.length == per
    assert (down.rows, down.cols) == (cfg.hidden_size, cfg.expert_intermediate_size)
    with open(moe_file, "rb") as f:
        f.seek(down.offset)
        assert f.read(per) == t.data.reshape(-1).view("uint8")[3 * per:4 * per].tobytes()


def test_a_file_changed_in_place_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(hf_model("qwen3moe", seed=5), path, "qwen3moe", quant=QT.Q8_0)
    engine = _engine(path, 0)
    import os
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(RuntimeError, match="changed since it was loaded"):
        engine.logits(ids_of(5))


def _fake_store(tmp_path, layers: int, experts: int, budget: int,
                direct: bool | None = None) -> tuple[StreamedExperts, int]:
    """A StreamedExperts over a file of 64-byte slabs whose 'conversion' is a (16,) fp32 tensor: each
    expert holds 3 x 64 bytes. -> (store, one expert's bytes)."""
    from ternlm.models.moe import Slab
    path = tmp_path / "slabs.bin"
    n = layers * experts * 3
    path.write_bytes(bytes(range(256)) * (n * 64 // 256 + 1))
    slabs = {(l, e): tuple(Slab(((l * experts + e) * 3 + i) * 64, 64, 0, 4, 4) for i in range(3))
             for l in range(layers) for e in range(experts)}
    store = StreamedExperts(path, slabs, budget, lambda raw, slab: raw.float()[:16].clone(), direct=direct)
    for l in range(layers):
        store.bind(l, lambda parts: list(parts))             # the 'projection': its decoded parts, to compare
    return store, 3 * 64


def _sweep(store, layers, experts) -> tuple[int, int]:
    """Every expert of every layer in order, as a prefill chunk asks for them. -> (hits, misses) of the
    sweep; checks the budget after every get and that held == misses - evictions."""
    h, m = store.stats.hits, store.stats.misses
    for l in range(layers):
        for e in range(experts):
            store.get(l, e, 1)
            assert store.nbytes <= store.budget
            assert len(store) == store.stats.misses - store.stats.evictions
    return store.stats.hits - h, store.stats.misses - m


@pytest.mark.parametrize("layers,experts,fit", [(1, 16, 8), (2, 8, 8), (4, 8, 10), (2, 8, 17), (2, 8, 0)])
def test_a_sweep_keeps_its_pinned_experts(tmp_path, layers, experts, fit):
    """[SCAN-RESISTANT] Sweeps in one order (a prefill chunk each): an LRU for `fit` of the experts would
    hit nothing on the second sweep; the pinned placement hits every pinned expert (each layer's fair
    share), and never holds more than the budget."""
    store, one = _fake_store(tmp_path, layers, experts, fit * 3 * 64)
    hits, misses = _sweep(store, layers, experts)
    assert hits == 0 and misses == layers * experts
    pinned = store.pinned
    share = min(experts, (fit // layers) if layers else 0)
    assert pinned == layers * share
    for _ in range(2):
        hits, misses = _sweep(store, layers, experts)
        assert hits >= pinned and hits + misses == layers * experts
        assert hits == min(fit, layers * experts)      # the tail keeps what the shares' rounding leaves
    assert store.pinned == pinned                      # pins are never evicted
    if fit >= layers * experts:
        assert store.stats.evictions == 0


def test_random_gets_keep_the_budget_and_pins(tmp_path):
    import random
    rng = random.Random(3)
    layers, experts = 3, 12
    one = 3 * 64
    store, _ = _fake_store(tmp_path, layers, experts, 7 * one + one // 2)
    pinned_seen = set()
    for _ in range(500):
        l, e = rng.randrange(layers), rng.randrange(experts)
        before = (l, e) in store._pinned
        hits = store.stats.hits
        store.get(l, e)
        if before:
            assert store.stats.hits == hits + 1
        pinned_seen |= set(store._pinned)
        assert store.nbytes <= store.budget and len(store) == store.stats.misses - store.stats.evictions
    assert pinned_seen == set(store._pinned) and store.pinned == layers * 2      # 7.5 // 3 = 2 a layer
    stats = store.stats.as_dict()
    for l in range(layers):
        for e in range(experts):                                    # holds: a hit-to-be, no counter moves
            assert store.holds(l, e) == ((l, e) in store._pinned or (l, e) in store._tail)
    assert store.stats.as_dict() == stats


def test_read_ahead_advises_a_window_of_hinted_misses(tmp_path, monkeypatch):
    """[READ-AHEAD] A hint advises (WILLNEED) the slabs of at most READ_AHEAD hinted experts not held, in
    the hinted order, topped up as they are got; the counters are those of the same gets unhinted."""
    import os
    from ternlm.models import moe
    layers, experts = 2, 24
    advised = []
    real = os.posix_fadvise

    def record(fd, off, n, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append(off)
        return real(fd, off, n, advice)
    monkeypatch.setattr(os, "posix_fadvise", record)
    hinted, _ = _fake_store(tmp_path, layers, experts, 10 * 3 * 64, direct=False)
    (tmp_path / "plain").mkdir()
    plain, _ = _fake_store(tmp_path / "plain", layers, experts, 10 * 3 * 64, direct=False)
    offsets = {key: slabs[0].offset for key, slabs in hinted._slabs.items()}
    for sweep in range(2):
        for l in range(layers):
            want = list(range(0, experts, 2))
            advised.clear()
            hinted.read_ahead(l, want)
            not_held = [e for e in want if (l, e) not in hinted._pinned and (l, e) not in hinted._tail]
            assert advised == [offsets[(l, e)] + i * 64 for e in not_held[:moe.READ_AHEAD] for i in range(3)]
            for e in want:
                hinted.get(l, e, 1)
                plain.get(l, e, 1)
                assert len(hinted._advised) <= moe.READ_AHEAD
            assert advised == [offsets[(l, e)] + i * 64 for e in not_held for i in range(3)]   # each once
    assert hinted.stats.as_dict() == plain.stats.as_dict() and hinted.stats.hits > 0


def test_direct_reads_give_the_page_cache_reads_bytes(tmp_path):
    """[DIRECT] O_DIRECT reads by the reader threads (slabs at offsets and lengths that are not aligned,
    hinted, skipped, re-hinted and unhinted) decode the same bytes as preads through the page cache, with
    at most READ_AHEAD experts in flight and READ_AHEAD + 1 buffers."""
    from ternlm.models import moe
    layers, experts = 2, 40
    direct, _ = _fake_store(tmp_path, layers, experts, 6 * 3 * 64, direct=True)
    (tmp_path / "plain").mkdir()
    plain, _ = _fake_store(tmp_path / "plain", layers, experts, 6 * 3 * 64, direct=False)
    assert direct._direct is not None and plain._direct is None
    import random
    rng = random.Random(7)
    buffers = set()
    for step in range(12):
        l = step % layers
        want = sorted(rng.sample(range(experts), 20))
        if step % 3:
            direct.read_ahead(l, want)
            plain.read_ahead(l, want)
        for e in want:
            if rng.random() < 0.2:
                continue                                        # a hinted expert not asked for
            a, b = direct.get(l, e, 1), plain.get(l, e, 1)
            assert all(torch.equal(x, y) for x, y in zip(a.gate_up + a.down, b.gate_up + b.down))
            assert torch.equal(a.down[0][:1], torch.tensor([((l * experts + e) * 3 + 2) * 64 % 256.0]))
            assert len(direct._direct._inflight) <= moe.READ_AHEAD
            buffers |= {id(x) for x in direct._direct._free}
    assert 0 < len(buffers) <= moe.READ_AHEAD + 1
    assert direct.stats.as_dict() == plain.stats.as_dict()
    direct.close()
    plain.close()


def test_prefetch_reads_a_layer_before_its_hint_and_the_hint_keeps_those_reads(tmp_path, monkeypatch):
    """[PREFETCH] a layer's experts not held are read ahead before its routing; its hint (here every other
    expert, ascending) keeps the reads it wants going and drops the others: each wanted expert's slabs are
    read once, the bytes are the page cache path's, the counters those of the same gets unhinted."""
    from ternlm.models import moe
    layers, experts = 3, 20
    reads = []
    real = moe._pread_direct
    monkeypatch.setattr(moe, "_pread_direct",                      # (aligned offset, bytes needed): one a slab
                        lambda fd, off, view, need: (reads.append((off, need)), real(fd, off, view, need)))
    direct, _ = _fake_store(tmp_path, layers, experts, 4 * 3 * 64, direct=True)
    (tmp_path / "plain").mkdir()
    plain, _ = _fake_store(tmp_path / "plain", layers, experts, 4 * 3 * 64, direct=False)
    assert direct._direct is not None
    for l in range(layers):
        reads.clear()
        direct.prefetch(l)
        assert direct._direct._inflight, "reads started before the layer's hint"
        assert len(direct._advised) == min(moe.READ_AHEAD, experts - sum(k[0] == l for k in direct._pinned))
        want = list(range(0, experts, 2))
        direct.read_ahead(l, want)
        assert all(k[0] == l and k[1] % 2 == 0 for k in direct._advised)
        for e in want:
            a, b = direct.get(l, e, 1), plain.get(l, e, 1)
            assert all(torch.equal(x, y) for x, y in zip(a.gate_up + a.down, b.gate_up + b.down))
        lo = lambda x: x.offset - x.offset % moe.DIRECT_ALIGN      # noqa: E731
        wanted = {(lo(x), x.offset + x.length - lo(x)) for e in want for x in direct._slabs[(l, e)]}
        assert wanted <= set(reads)                # every wanted slab read ...
        assert all(reads.count(o) == 1 for o in wanted)   # ... once: the hint kept the prefetch's reads
    direct.prefetch(layers)                        # past the last layer: nothing
    assert direct.stats.as_dict() == plain.stats.as_dict()
    direct.close()
    plain.close()


def test_plan_expert_cache():
    G = 1 << 30
    assert plan_expert_cache(5 * G, 10 * G, G, G, None).budget == 5 * G
    assert plan_expert_cache("resident", 10 * G, G, G, 2 * G).budget is None
    assert plan_expert_cache("auto", 2 * G, G, G, 64 * G).budget is None          # fits: resident
    p = plan_expert_cache("auto", 17 * G, G, G, 8 * G)
    assert p.budget is not None and 0 < p.budget < 8 * G and "streamed" in p.reason
    assert plan_expert_cache("auto", 17 * G, 8 * G, G, 8 * G).budget == 0          # nothing left: read each use
    assert plan_expert_cache("auto", 17 * G, G, G, None).budget is None           # unknown: as before
    with pytest.raises(ValueError):
        plan_expert_cache("lots", 1, 1, 1, 1)


def test_auto_plan_leaves_room_for_the_prefill_chunk(moe_file, monkeypatch):
    """--expert-cache auto counts the step's working set with the resident parts (beside the KV), so a
    larger --chunk leaves the cache less (a 2,048-row chunk with a cache that took all the room was
    OOM-killed under a cgroup cap: benchmarks/results/moe-capped)."""
    import ternlm.models.moe as moe
    real, seen = moe.plan_expert_cache, {}

    def recording(requested, experts, others, kv, available):
        seen["experts"], seen["others"], seen["kv"] = experts, others, kv
        return real(requested, experts, others, kv, available)
    monkeypatch.setattr(moe, "plan_expert_cache", recording)
    others = {}
    for chunk in (256, 2048):
        e = Engine.load(str(moe_file), weights="gguf", expert_cache="auto", chunk_size=chunk, ctx=256)
        others[chunk] = seen["others"]
    cfg = e.config
    assert others[2048] - others[256] == moe.step_work_bytes(cfg, 2048) - moe.step_work_bytes(cfg, 256) > 0
    # with exactly the memory a 256-row chunk leaves the experts, the 2,048-row chunk streams them
    avail = others[256] + seen["kv"] + moe.EXPERT_OVERHEAD + others[256] // moe.RESIDENT_SLACK + seen["experts"]
    assert real("auto", seen["experts"], others[256], seen["kv"], avail).budget is None
    assert real("auto", seen["experts"], others[2048], seen["kv"], avail).budget is not None


def test_chunk_auto_plans_more_rows_where_experts_stream(moe_file, monkeypatch):
    """--chunk auto (chunk_size None): 256 rows where the experts are resident; where they stream, the
    chunk is planned with the cache (every chunk sweeps the experts again: fewer chunks, fewer reads) and
    the cache planned again beside that chunk's work. The logits are the resident engine's either way."""
    import ternlm.engine.core as engine_mod
    import ternlm.models.moe as moe
    real, seen = moe.plan_expert_cache, []

    def recording(requested, experts, others, kv, available):
        plan = real(requested, experts, others, kv, available)
        seen.append((experts, others, kv, plan.budget))
        return plan
    monkeypatch.setattr(moe, "plan_expert_cache", recording)
    # the tiny model's experts (~100 KB) are smaller than a real step's work (~3 KB a row): 8 bytes a row
    monkeypatch.setattr(moe, "step_work_bytes", lambda cfg, rows: 8 * rows)
    resident = Engine.load(str(moe_file), weights="gguf", expert_cache="auto", ctx=256)
    assert resident.chunk_size == moe.CHUNK_RESIDENT and resident.expert_plan.budget is None
    experts, others, kv, _ = seen[-1]
    # memory for half the experts beside the rest: they stream, with a cache of about half of them
    room = others + kv + moe.EXPERT_OVERHEAD + others // moe.RESIDENT_SLACK + experts // 2
    monkeypatch.setattr(engine_mod, "_available_memory", lambda: room + moe.step_work_bytes(resident.config, 256))
    seen.clear()
    streamed = Engine.load(str(moe_file), weights="gguf", expert_cache="auto", ctx=256)
    first, final = seen
    assert first[3] is not None, "planned at 256 rows first: the experts stream"
    want = moe.streamed_chunk(streamed.config, first[3])
    assert streamed.chunk_size == want == 1024           # 8 KB of work <= a quarter of a ~52 KB cache
    assert final[1] - first[1] == moe.step_work_bytes(streamed.config, want) - moe.step_work_bytes(streamed.config, 256)
    assert streamed.expert_plan.budget == final[3] < first[3]
    assert isinstance(streamed.model.experts, StreamedExperts)
    ids = ids_of(70, seed=3)
    assert torch.equal(streamed.logits(ids), resident.logits(ids))
    # an explicit --chunk stays as given
    seen.clear()
    assert Engine.load(str(moe_file), weights="gguf", expert_cache="auto", ctx=256, chunk_size=64).chunk_size == 64


def test_streamed_chunk_rows():
    """Powers of two from 256 to 2,048 whose step work is at most a quarter of the cache."""
    from types import SimpleNamespace

    from ternlm.models.moe import CHUNK_RESIDENT, CHUNK_STREAMED_MAX, step_work_bytes, streamed_chunk
    cfg = SimpleNamespace(hidden_size=2048, experts_per_token=8, expert_intermediate_size=768, num_heads=32,
                          num_kv_heads=4, head_dim=128)     # Qwen3-30B-A3B's shapes: ~200 KB a row
    assert streamed_chunk(cfg, 0) == CHUNK_RESIDENT
    assert streamed_chunk(cfg, 6 << 30) == CHUNK_STREAMED_MAX
    for budget in (1 << 28, 1 << 29, 1 << 30):
        rows = streamed_chunk(cfg, budget)
        assert rows == CHUNK_RESIDENT or step_work_bytes(cfg, rows) <= budget // 4
        assert rows == CHUNK_STREAMED_MAX or step_work_bytes(cfg, 2 * rows) > budget // 4


def test_miss_times_are_counted_apart_from_the_counts(moe_file):
    """A streamed miss's wait for its bytes and its conversion are timed (timings' experts, moe_capped), but
    outside `as_dict`, which runs compare for equality."""
    streamed = _engine(moe_file, 0)
    store = streamed.model.experts
    streamed.logits(ids_of(20, seed=1))
    snap = store.stats.snapshot()
    assert set(snap) == set(store.stats.as_dict()) | {"read_wait_us", "convert_us"}
    assert store.stats.misses > 0 and snap["convert_us"] > 0 and snap["read_wait_us"] >= 0
    assert store.stats.minus(snap) == dict.fromkeys(snap, 0)


def test_a_decode_that_views_the_read_buffer_is_copied_out(tmp_path):
    """[SCRATCH] slabs are read into one reused buffer: a decode that returns a view of the raw bytes
    (a float slab's dequantization can) must not see the next read overwrite it."""
    from ternlm.models.moe import Slab
    path = tmp_path / "slabs.bin"
    path.write_bytes(bytes(range(192)))
    slabs = {(0, 0): tuple(Slab(i * 64, 64, 0, 4, 4) for i in range(3))}
    store = StreamedExperts(path, slabs, 0, lambda raw, slab: raw.view(torch.float32))   # a view, no copy
    store.bind(0, lambda parts: parts)
    e = store.get(0, 0)
    got = [p.view(torch.uint8) for p in e.gate_up + e.down]
    assert [bytes(g.tolist()) for g in got] == [bytes(range(i * 64, (i + 1) * 64)) for i in range(3)]
