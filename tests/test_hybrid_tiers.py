"""Hybrid models' recurrent state in the KV tiers (issue 47): RAM, disk and Redis entries carry the state after
their last position, a tier load resumes the recurrent layers at the last loaded entry that has one
([RESUME-AT-SNAPSHOT]), and n > 1 choices fork a hybrid slot's state.

Oracle: our own cold run (`--no-prefix-kv`, one full pass), bit for bit: whatever tier a prefix comes from,
the answer is the cold run's. What is reused is predicted exactly: the longest prefix ending where an entry
with a state ends (a whole block on the 64-token grid, or the conversation's tail entry used in full), at most
min(common prefix, prompt - 1) ([FRESH-LOGITS]).
"""
from __future__ import annotations

import pytest
import torch

from redis_proc import RedisProc
from ternlm.kv.blockfile import BadBlock, decode, encode
from ternlm.kv.blocks import BLOCK_TOKENS
from ternlm.kv.record import lcp
from ternlm.kv.store import CacheConfig
from hybrid_checks import folder_engine
from test_hybrid import hf_qwen35
from test_loaders import _save_tokenizer
from test_moe import ids_of

B = BLOCK_TOKENS
BASE, FILLER = ids_of(300, seed=7), ids_of(90, seed=9)
# differs from BASE at every position: prompts leaving BASE at different points then share exactly their common
# BASE prefix, so what a tier holds from earlier prompts never reaches further than BASE's own entries
OTHER = [o if o != b else 3 + (o - 2) % 253 for o, b in zip(ids_of(300, seed=8), BASE)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35-tiers")
    hf_qwen35(seed=3).save_pretrained(path)
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def cold(folder):
    return folder_engine(folder, prefix_reuse=False)


@pytest.fixture(scope="module")
def folder_q8(tmp_path_factory):
    """The same model with head_dim 32, for --kv-dtype q8_0 (int8 codes + fp16 scales: rows of a multiple of 32)."""
    path = tmp_path_factory.mktemp("qwen35-tiers-hd32")
    hf_qwen35(seed=3, head_dim=32).save_pretrained(path)
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def cold_q8(folder_q8):
    return folder_engine(folder_q8, prefix_reuse=False, kv_dtype="q8_0")


# The KV formats the tier properties run on: auto (fp32) and q8_0, whose rows the tiers keep as they are. Each
# format's runs are judged against a cold engine of that format.
KVS = ["auto", "q8_0"]


def _model(request, kv: str):
    """(folder, cold engine, Engine kwargs) of a KV format."""
    if kv == "q8_0":
        return request.getfixturevalue("folder_q8"), request.getfixturevalue("cold_q8"), {"kv_dtype": "q8_0"}
    return request.getfixturevalue("folder"), request.getfixturevalue("cold"), {}


def _diverging(d: int) -> list[int]:
    """A prompt that leaves BASE at position d (d = 300: BASE continued)."""
    return BASE[:d] + OTHER[d:] if d < 300 else BASE + OTHER[:20]


def _tier_reach(prompt: list[int], tail: bool) -> int:
    """What a tier holding BASE's blocks (each with its state) and, when `tail`, its tail entry (state at 300)
    lets `prompt` reuse."""
    k = min(lcp(BASE, prompt), len(prompt) - 1)
    return 300 if tail and k >= 300 else k // B * B


def _check_cold(got, prompt, cold) -> None:
    ref = cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]
    assert torch.equal(got.logits, ref)


def _stride(step: int) -> list[int]:
    """Divergence points: every `step`-th, and every one around the block edges and the tail."""
    edges = {d for e in (B, 2 * B, 3 * B, 4 * B, 300) for d in range(e - 2, e + 2)}
    return sorted(set(range(0, 301, step)) | {d for d in edges if 0 <= d <= 300})


@pytest.mark.parametrize("kv", KVS)
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_reuse_from_a_tier_at_every_divergence_gives_the_cold_bits(request, kv, tier, tmp_path):
    """BASE is served in slot 0, pushed down a tier by an unrelated request in the same slot, then a prompt
    leaving BASE at d is served from the tier: it reuses exactly the predicted prefix, from that tier, and
    its logits (first token's and decoded ones') are the cold run's bit for bit. RAM: every d in 0..300;
    disk (RAM budget 0: every entry written, read back and verified): every 3rd and every block edge."""
    cache = CacheConfig(ram_bytes=64 << 20) if tier == "ram" else \
        CacheConfig(ram_bytes=0, disk_dir=tmp_path / "kv", disk_bytes=256 << 20)
    folder, cold, kw = _model(request, kv)
    warm = folder_engine(folder, cache=cache, **kw)
    assert warm.kv_dtype == cold.kv_dtype
    try:
        for d in (range(301) if tier == "ram" else _stride(3)):
            warm.generate(BASE, max_tokens=1, ignore_eos=True, slot=0)
            warm.generate(FILLER, max_tokens=1, ignore_eos=True, slot=0)   # BASE goes down a tier
            warm.store.flush(10)
            prompt = _diverging(d)
            got = warm.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
            expect = _tier_reach(prompt, tail=True)
            assert got.cached_tokens == expect, d
            assert getattr(got.restored, tier) == expect, d
            _check_cold(got, prompt, cold)
    finally:
        warm.store.close(10)


def test_entries_carry_the_state_at_their_end(folder, tmp_path):
    """Stored blocks and the tail carry the slot's state at their end (the grid snapshot, the live state), the
    same bits; a disk file round-trips them; an entry whose state has another shape is refused."""
    warm = folder_engine(folder, cache=CacheConfig(ram_bytes=64 << 20))
    warm.generate(BASE, max_tokens=1, ignore_eos=True, slot=0)
    st = warm.slots[0].state
    saved = warm.store.save(warm.slots[0])
    assert saved.blocks == 300 // B and saved.tail == 300 % B
    entries = warm.store.ram.oldest_first()
    ends = sorted(len(e.meta.ids) + (i * B if not e.meta.tail else 300 // B * B) for i, e in enumerate(entries))
    assert ends == [B, 2 * B, 3 * B, 4 * B, 300]
    for e, end in zip(entries, ends):
        conv, ssm = st.at(end)
        assert torch.equal(e.state[0], conv) and torch.equal(e.state[1], ssm)
        header, payload = encode(e.meta, e.k, e.v, e.state)
        back = decode(bytearray(b"".join([header, *payload])), e.meta)
        assert torch.equal(back.state[0], conv) and torch.equal(back.state[1], ssm) and torch.equal(back.k, e.k)
        wrong = e.meta.__class__(**{**e.meta.__dict__, "state": (e.meta.state[0], (1, 1, 1, 1))})
        with pytest.raises(BadBlock, match="recurrent state shape"):
            decode(bytearray(b"".join([header, *payload])), wrong)


@pytest.mark.parametrize("kv", KVS)
def test_restart_serves_the_conversation_from_disk(request, kv, tmp_path):
    """A conversation persisted at shutdown is served by a fresh engine from the disk tier: the next turn
    prefills only its new tail (the tail entry's state resumes at the record's end) and answers as cold."""
    cache = CacheConfig(ram_bytes=64 << 20, disk_dir=tmp_path / "kv", disk_bytes=256 << 20)
    folder, cold, kw = _model(request, kv)
    first = folder_engine(folder, cache=cache, **kw)
    one = first.generate(BASE, max_tokens=5, ignore_eos=True)
    record = list(first.slots[0].record.fed)
    assert first.persist_cache() >= 300 // B
    first.store.close(10)
    second = folder_engine(folder, cache=cache, **kw)
    try:
        prompt = BASE + one.token_ids + OTHER[:30]
        got = second.generate(prompt, max_tokens=4, ignore_eos=True, keep_logits=True)
        assert got.cached_tokens == got.restored.disk == len(record)
        _check_cold(got, prompt, cold)
    finally:
        second.store.close(10)


@pytest.mark.parametrize("kv", KVS)
def test_redis_replica_resumes_at_the_published_blocks(request, kv):
    """One replica answers BASE and publishes its whole blocks (with their states) to Redis; another, fresh,
    serves prompts leaving BASE at several points from Redis, as cold."""
    with RedisProc() as redis:
        cache = CacheConfig(ram_bytes=64 << 20, redis_url=redis.url)
        folder, cold, kw = _model(request, kv)
        a, b = folder_engine(folder, cache=cache, **kw), folder_engine(folder, cache=cache, **kw)
        try:
            a.generate(BASE, max_tokens=1, ignore_eos=True)
            assert a.store.flush(10)
            for d in (0, 63, 64, 65, 130, 255, 256, 299, 300):
                prompt = _diverging(d)
                b.slots[0].reset()
                b.store.ram = type(b.store.ram)(b.store.ram.budget)   # forget what the last prompt stored
                got = b.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
                expect = _tier_reach(prompt, tail=False)
                assert got.cached_tokens == got.restored.redis == expect, d
                _check_cold(got, prompt, cold)
        finally:
            a.store.close(10)
            b.store.close(10)


def test_n_choices_fork_the_recurrent_state(folder, cold):
    """n > 1 on a hybrid model: choice 1 forks choice 0's slot at the latest position where it holds the
    state (its grid snapshot below the prompt's end) and answers as a lone cold request would."""
    engine = folder_engine(folder, slots=2)
    prompt = ids_of(150, seed=11)
    lead = engine.open(prompt, max_tokens=3, ignore_eos=True, slot=0, keep_logits=True)
    while lead.prefilling:
        engine.step([(lead, min(engine.want(lead).pending, engine.chunk_size))])
    follow = engine.open(prompt, max_tokens=3, ignore_eos=True, slot=1, fork_from=0, keep_logits=True)
    assert follow.restored.sibling == 128           # the grid snapshot <= 149 (the prompt's end is fed anew)
    got = None
    while got is None:
        out = engine.step([(follow, min(engine.want(follow).pending, engine.chunk_size))])[0]
        assert out.error is None
        got = next((ev for ev in out.events if hasattr(ev, "cached_tokens")), None)
    _check_cold(got, prompt, cold)


def _old_layout(path, layers: int) -> None:
    """Rewrite a block file as the engine wrote it before its KV held attention layers only: K and V of every
    layer (the recurrent ones zeros), the same key, ids and state."""
    b = decode(bytearray(path.read_bytes()))
    full = (layers,) + tuple(b.meta.shape[1:])
    k, v = torch.zeros(full, dtype=b.k.dtype), torch.zeros(full, dtype=b.v.dtype)
    k[-b.k.shape[0]:], v[-b.v.shape[0]:] = b.k, b.v
    header, payload = encode(b.meta.__class__(**{**b.meta.__dict__, "shape": full}), k, v, b.state)
    path.write_bytes(b"".join([header, *payload]))


def test_kv_holds_the_attention_layers_only(folder, cold, tmp_path):
    """A hybrid slot's K and V hold its attention layers only (1 of this model's 4: 3 DeltaNet layers keep a state
    instead), and so does every tier entry: a 64-token block's payload is that KV plus the state. Blocks a disk tier
    holds in the old layout (every layer's K and V) are refused and recomputed, never misread: the answer is cold's."""
    cache = CacheConfig(ram_bytes=64 << 20, disk_dir=tmp_path / "kv", disk_bytes=256 << 20)
    first = folder_engine(folder, cache=cache)
    cfg, slot = first.config, first.slots[0]
    assert cfg.attention_layers == (3,) and cfg.num_layers == 4
    assert tuple(slot.k.shape) == (1, cfg.num_kv_heads, slot.capacity, cfg.head_dim) == tuple(slot.v.shape)
    per_token = 2 * 1 * cfg.num_kv_heads * cfg.head_dim * 4                # K and V, one layer, fp32
    assert slot.k.nbytes + slot.v.nbytes == per_token * slot.capacity
    first.generate(BASE, max_tokens=1, ignore_eos=True, slot=0)
    first.store.save(slot)
    state = slot.state.shape.nbytes
    for e in first.store.ram.oldest_first():
        n = len(e.meta.ids)
        assert tuple(e.k.shape) == (1, cfg.num_kv_heads, n, cfg.head_dim)
        header, payload = encode(e.meta, e.k, e.v, e.state)
        assert sum(len(p) for p in payload) == per_token * n + state     # was 4x the KV: every layer's
    assert first.persist_cache() >= 300 // B
    first.store.close(10)
    files = sorted((tmp_path / "kv").rglob("*.tkv"))
    assert files
    for f in files:
        _old_layout(f, cfg.num_layers)
    second = folder_engine(folder, cache=cache)
    try:
        prompt = BASE + OTHER[:30]
        got = second.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True)
        assert got.cached_tokens == 0
        _check_cold(got, prompt, cold)
    finally:
        second.store.close(10)
