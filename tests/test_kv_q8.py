"""--kv-dtype q8_0 below the slots: what the tiers hold, whom they serve, and restarts on each model family.

q8_0 rows (int8 codes + one fp16 scale per 32 values, kv/kvtype.py) go down the tiers as the slot holds them: a
block file says kv_dtype "q8_0" and its payload costs a token 17/32 of float16's bytes (K and V of 32 values: 34
bytes against 64). The KV namespace names the format, so a q8_0 engine never loads what a float16 engine wrote
to the same directory (those bits differ by design): it recomputes, and answers as a cold q8_0 engine.

Then restarts from each tier (RAM: pushed down by another request in the slot; disk: a fresh engine over the
directory; Redis: a fresh replica), speculation on, on a dense model (tiny llama: the torch layers, rows written
by the kernels' table path), Gemma 3 (sliding windows) and a mixture of experts (qwen3moe), both fused in
layer.c: every answer is a cold q8_0 engine's, speculation off, tokens and logits bit for bit. Hybrid models'
tiers and speculation run q8_0 in test_hybrid_tiers.py and test_speculative_hybrid.py.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from redis_proc import RedisProc
from ternlm.engine.core import Engine
from ternlm.engine.weights import choose_weights
from ternlm.kv.blockfile import decode, read_header
from ternlm.kv.blocks import BLOCK_TOKENS
from ternlm.kv.disk import scan
from ternlm.kv.store import CacheConfig
from ternlm.models.gguf import load_gguf
from hf_to_gguf import write_gguf
from test_gemma3 import gemma
from test_moe import hf_model, ids_of
from tiny import tiny_engine

B = BLOCK_TOKENS


def _tiny(kv: str, **kw) -> Engine:
    """The tiny llama with head_dim 32 (q8_0 rows need a multiple of 32) and the KV format `kv`."""
    return tiny_engine("llama", seed=1, head_dim=32, dtype=torch.float32, min_reuse=1, chunk_size=16,
                       kv_dtype=kv, **kw)[1]


def _blocks(root) -> list[tuple[dict, int, object]]:
    """(header, payload bytes, decoded entry) of every block file under the disk tier `root`."""
    out = []
    for path, size, _ in scan(root).values():
        data = bytearray(path.read_bytes())
        header, off = read_header(data)
        out.append((header, size - off, decode(data)))
    return out


def test_q8_0_blocks_on_disk_say_q8_0_and_cost_at_most_054x_float16(tmp_path):
    prompt = ids_of(3 * B + 20, seed=4)
    per_token = {}
    for kv in ("float16", "q8_0"):
        root = tmp_path / kv
        e = _tiny(kv, cache=CacheConfig(ram_bytes=1 << 20, disk_dir=root, disk_bytes=64 << 20))
        e.generate(prompt, max_tokens=2, ignore_eos=True)
        assert e.persist_cache() >= 3
        e.store.close(10)
        files = _blocks(root)
        whole = [(h, n, b) for h, n, b in files if not b.meta.tail]
        assert len(whole) == 3 and all(h["kv_dtype"] == kv for h, _, _ in files)
        cfg = e.config
        row = cfg.head_dim + cfg.head_dim // 16 if kv == "q8_0" else cfg.head_dim
        for h, n, b in whole:
            assert b.k.dtype == {"float16": torch.float16, "q8_0": torch.uint8}[kv]
            assert tuple(b.k.shape) == tuple(b.v.shape) == (cfg.num_layers, cfg.num_kv_heads, B, row)
            assert n == b.k.nbytes + b.v.nbytes           # the payload is K and V (no state on a dense model)
        per_token[kv] = {n / B for _, n, _ in whole}
        assert len(per_token[kv]) == 1
    (q8,), (f16,) = per_token["q8_0"], per_token["float16"]
    assert q8 <= 0.54 * f16, (q8, f16)


def test_q8_0_never_loads_blocks_a_float16_engine_wrote(tmp_path):
    """Same model, same directory: the float16 engine's blocks are not the q8_0 engine's (its namespace says
    kv=q8_0); it recomputes and answers as cold q8_0. Its own blocks, after a restart, it loads."""
    cache = CacheConfig(ram_bytes=1 << 20, disk_dir=tmp_path / "kv", disk_bytes=64 << 20)
    prompt = ids_of(3 * B + 9, seed=5)
    nxt = prompt + [7, 8, 9]
    f16 = _tiny("float16", cache=cache)
    f16.generate(prompt, max_tokens=2, ignore_eos=True)
    assert f16.persist_cache() >= 3
    f16.store.close(10)
    cold = _tiny("q8_0", prefix_reuse=False).generate(nxt, max_tokens=6, ignore_eos=True, keep_logits=True)
    q8 = _tiny("q8_0", cache=cache)
    assert b"kv=q8_0" in q8.model_namespace and b"kv=float16" in f16.model_namespace
    try:
        got = q8.generate(nxt, max_tokens=6, ignore_eos=True, keep_logits=True)
        assert got.cached_tokens == got.restored.disk == 0
        assert got.token_ids == cold.token_ids and torch.equal(got.logits, cold.logits)
        assert q8.persist_cache() >= 3
    finally:
        q8.store.close(10)
    again = _tiny("q8_0", cache=cache)           # a restart: now the directory holds q8_0 blocks of nxt
    try:
        got = again.generate(nxt, max_tokens=6, ignore_eos=True, keep_logits=True)
        assert got.restored.disk >= 3 * B
        assert got.token_ids == cold.token_ids and torch.equal(got.logits, cold.logits)
    finally:
        again.store.close(10)


# ---- restart from each tier, speculation on, per model family ------------------------------------------

@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """Q8_0 GGUFs of a tiny Gemma 3 (head_dim 32, window 8) and a tiny qwen3moe widened to head_dim 32."""
    root = tmp_path_factory.mktemp("q8kv")
    write_gguf(gemma(seed=7), root / "gemma3.gguf", "gemma3", quant=QT.Q8_0)
    write_gguf(hf_model("qwen3moe", seed=7, hidden_size=128), root / "qwen3moe.gguf", "qwen3moe", quant=QT.Q8_0)
    return root


def _family(family: str, files, **kw) -> Engine:
    """A q8_0 engine of `family`: dense (torch layers, the kernels' table path) or fused in layer.c."""
    if family == "dense":
        return _tiny("q8_0", **kw)
    loaded = load_gguf(files / f"{family}.gguf", torch.float32, keep_quantized=True, lanes=True)
    e = Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="fp32"),
               kv_dtype="q8_0", min_reuse=1, chunk_size=16, **kw)
    assert e.model.native is not None, f"every {family} layer fused in layer.c"
    return e


def _prompt() -> list[int]:
    """Past two blocks, ending inside a repeated segment: lookup finds drafts."""
    seg = ids_of(23, seed=12)
    return ids_of(100, seed=11) + seg * 3 + seg[:3]


@pytest.mark.parametrize("tier", ["ram", "disk", "redis"])
@pytest.mark.parametrize("family", ["dense", "gemma3", "qwen3moe"])
def test_restart_from_a_tier_speculating_answers_as_cold(family, tier, gguf_files, tmp_path):
    prompt = _prompt()
    nxt = prompt + [5, 6] + prompt[100:140]
    cold = _family(family, gguf_files, prefix_reuse=False).generate(
        nxt, max_tokens=16, ignore_eos=True, keep_logits=True, speculative=False)
    redis = RedisProc() if tier == "redis" else None
    engines = []
    try:
        if tier == "ram":
            cache = CacheConfig(ram_bytes=64 << 20)
        elif tier == "disk":
            cache = CacheConfig(ram_bytes=1 << 20, disk_dir=tmp_path / "kv", disk_bytes=64 << 20)
        else:
            redis.__enter__()
            cache = CacheConfig(ram_bytes=64 << 20, redis_url=redis.url)
        first = _family(family, gguf_files, cache=cache, slots=1)
        engines.append(first)
        assert first.kv_dtype == "q8_0"
        first.generate(prompt, max_tokens=2, ignore_eos=True)
        if tier == "ram":                          # the slot's blocks go down to RAM: another prompt takes it
            first.generate(ids_of(70, seed=13), max_tokens=1, ignore_eos=True)
            second = first
        else:
            if tier == "disk":
                assert first.persist_cache() >= 2
            assert first.store.flush(10)
            second = _family(family, gguf_files, cache=cache, slots=1)    # a restart / another replica
            engines.append(second)
        got = second.generate(nxt, max_tokens=16, ignore_eos=True, keep_logits=True, speculative=True)
        assert getattr(got.restored, tier) >= 2 * B, got.restored
        assert got.timings.drafted > 0
        assert got.token_ids == cold.token_ids and torch.equal(got.logits, cold.logits)
    finally:
        for e in engines:
            e.store.close(10)
        if redis is not None:
            redis.__exit__(None, None, None)
