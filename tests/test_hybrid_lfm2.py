"""Hybrid models (issue 47), lfm2: LFM2's gated short convolutions (models/shortconv.py, a recurrent state of the
conv's last K - 1 inputs) beside attention with q/k norms, a SwiGLU MLP on every layer.

Oracles: transformers' Lfm2ForCausalLM on a tiny random model (its pure-torch conv: no causal_conv1d here), saved
with save_pretrained and written as GGUF by llama.cpp's own converter (tests/nemotron_to_gguf.py: f32, Q8_0); our
own cold run (`prefix_reuse=False`, a fresh slot, one full pass) for every reuse: a resumed state must give the cold
run's logits bit for bit, at every divergence point, from the slot and from the disk tier. Parity bounds:
[FP64-BOUND] (tests/hybrid_checks.py).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as np_dequantize

from ternlm.engine.core import Engine
from ternlm.kv.blocks import BLOCK_TOKENS
from ternlm.kv.recurrent import recurrent_shape
from ternlm.kv.store import CacheConfig
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.engine.weights import choose_weights
from hybrid_checks import (assert_batched_equals_alone, assert_chunks_match_one_pass, assert_fp64_parity,
                           assert_greedy_text_matches, assert_int8_exact_on_every_path, assert_reuse_gives_cold_bits,
                           assert_threads_do_not_change_bits, folder_engine, save_folder)
from nemotron_to_gguf import convert
from test_moe import ids_of

KINDS = ["conv", "conv", "full_attention", "conv"]
# block_* as LFM2's releases set them (the MLP width adjusted: int(2 * 128 / 3) = 85, up to a multiple of 32: 96)
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, layer_types=KINDS,
            num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, max_position_embeddings=1024,
            block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=32,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def hf_lfm2(seed: int = 0, **kw):
    import transformers as tf
    cfg = tf.Lfm2Config(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = tf.Lfm2ForCausalLM(cfg).float().eval()
    with torch.no_grad():       # norms away from their ones, sharper weights
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.normal_(1, 0.3)
            else:
                p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    hf = hf_lfm2(seed=3)
    folder = tmp_path_factory.mktemp("lfm2")
    save_folder(hf, folder)
    return hf, folder


def test_config_and_layers_from_the_folder(lfm2):
    _, folder = lfm2
    cfg = load_hf_folder(folder, torch.float32).config
    assert cfg.arch == "lfm2" and cfg.qk_norm and cfg.tie_word_embeddings and cfg.intermediate_size == 96
    assert cfg.layer_kinds == ("shortconv", "shortconv", "attention", "shortconv")
    assert cfg.recurrent_layers == (0, 1, 3) and cfg.attention_layers == (2,)
    assert recurrent_shape(cfg).shapes == ((3, 64, 2), (3, 0, 0, 0))


def test_logits_and_greedy_text_match_transformers(lfm2):
    hf, folder = lfm2
    engine = folder_engine(folder)
    ids = ids_of(150, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, "hf folder")
    assert_greedy_text_matches(engine, hf, ids[:40], max_tokens=24)


@pytest.mark.parametrize("dtype", ["float32", "auto"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(lfm2, dtype):
    """[RESUME-EXACT] a prompt in chunks of 7, then decoded token by token, gives the bits of one pass."""
    _, folder = lfm2
    engine = folder_engine(folder, dtype)
    ids = ids_of(90, seed=5)
    assert_chunks_match_one_pass(engine, ids, engine.logits(ids), chunk_size=7, tail=10)


def test_reuse_at_every_divergence_gives_the_cold_bits(lfm2):
    _, folder = lfm2
    warm, cold = folder_engine(folder, state_interval=32), folder_engine(folder, prefix_reuse=False)
    assert_reuse_gives_cold_bits(warm, cold, ids_of(200, seed=7), ids_of(200, seed=8), range(0, 201), max_tokens=3)


def test_batched_equals_alone(lfm2):
    _, folder = lfm2
    engine = folder_engine(folder, slots=5, chunk_size=16)
    assert_batched_equals_alone(engine, [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)], [0, 0, 2, 3], budget=40)


def test_threads_do_not_change_the_bits(lfm2):
    _, folder = lfm2
    assert_threads_do_not_change_bits(folder_engine(folder), ids_of(70, seed=9))


def test_reuse_from_the_disk_tier_gives_the_cold_bits(lfm2, tmp_path):
    """Entries carry the conv state at their end (the state has no ssm part for this kind): a prompt pushed down
    to the disk tier (RAM budget 0: written, read back, verified) resumes at the last block or tail with a state,
    bit for bit the cold run's."""
    _, folder = lfm2
    base, filler, other = ids_of(200, seed=7), ids_of(90, seed=9), ids_of(200, seed=8)
    warm = folder_engine(folder, cache=CacheConfig(ram_bytes=0, disk_dir=tmp_path / "kv", disk_bytes=64 << 20))
    cold = folder_engine(folder, prefix_reuse=False)
    try:
        for d in (0, 63, 64, 65, 130, 200):
            warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)
            warm.generate(filler, max_tokens=1, ignore_eos=True, slot=0)       # base goes down a tier
            warm.store.flush(10)
            prompt = base[:d] + other[d:] if d < 200 else base + other[:20]
            got = warm.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
            assert got.cached_tokens == (200 if d == 200 else d // BLOCK_TOKENS * BLOCK_TOKENS), d
            assert got.restored.disk == got.cached_tokens, d
            assert torch.equal(got.logits, cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]), d
    finally:
        warm.store.close(10)


@pytest.fixture(scope="module")
def converted(lfm2, tmp_path_factory):
    """{outtype: GGUF path} by llama.cpp's converter (LFM2Model) from the saved folder."""
    _, folder = lfm2
    out = tmp_path_factory.mktemp("lfm2_gguf")
    paths = {}
    for outtype in ("f32", "q8_0"):
        paths[outtype] = out / f"lfm2-{outtype}.gguf"
        convert(folder, paths[outtype], outtype, TINY["vocab_size"], model="lfm2.LFM2Model")
    return paths


_GGUF_TO_HF = {"token_embd": "model.embed_tokens", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj", "ffn_gate": "feed_forward.w1",
               "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "shortconv.in_proj": "conv.in_proj",
               "shortconv.out_proj": "conv.out_proj"}


def _reference_weights(hf, path) -> int:
    """Every quantized matrix of the GGUF, dequantized, into `hf` (the converter keeps q/k rows as transformers
    has them for this architecture). Returns how many were replaced."""
    params = dict(hf.named_parameters())
    n = 0
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        parts = t.name.removesuffix(".weight").split(".", 2)
        name = (f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight" if parts[0] == "blk"
                else f"{_GGUF_TO_HF[parts[0]]}.weight")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np_dequantize(np.array(t.data), t.tensor_type).copy()).reshape(shape)
        with torch.no_grad():
            params[name].copy_(w)
        n += 1
    return n


@pytest.mark.parametrize("outtype,act", [("f32", None), ("q8_0", "fp32")])
def test_converter_gguf_matches_transformers(lfm2, converted, outtype, act):
    """The converter's file through our loader and kernels (Q8_0: its blocks kept, fp32 activations) against
    transformers on the file's numbers: within fp32 rounding (float64-judged), greedy tokens equal."""
    hf = copy.deepcopy(lfm2[0])
    path = converted[outtype]
    # Q8_0: 3 conv layers x in/out, q/k/v/o, 4 MLPs x gate/up/down, the (tied) embedding
    assert _reference_weights(hf, path) == (0 if outtype == "f32" else 23)
    keep = outtype != "f32"
    loaded = load_gguf(path, torch.float32, keep_quantized=keep, lanes=keep)
    assert loaded.config.layer_kinds == ("shortconv", "shortconv", "attention", "shortconv")
    assert loaded.config.intermediate_size == 96 and loaded.config.shortconv_kernel == 3
    weights = choose_weights("gguf", "auto", True, activations=act) if keep else None
    engine = Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32", min_reuse=1)
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, outtype)
    assert_greedy_text_matches(engine, hf, ids[:30], max_tokens=16)


def test_converter_q8_0_int8_is_exact_on_every_path(lfm2, converted):
    """int8 activations (the default for quantized files): top-1 agreement with transformers, and chunks + decode
    == one pass, reuse at divergence points == the cold run, batched == alone, bit for bit."""
    hf = copy.deepcopy(lfm2[0])
    _reference_weights(hf, converted["q8_0"])

    def engine(**kw):
        return Engine(load_gguf(converted["q8_0"], torch.float32, keep_quantized=True, lanes=True), dtype="float32",
                      weights=choose_weights("gguf", "auto", True, activations="int8"), kv_dtype="float32",
                      min_reuse=1, **kw)
    e = engine()
    assert e.model.activations == "int8"
    assert_int8_exact_on_every_path(hf, e, engine(slots=4, chunk_size=16))


def test_conv_bias_is_refused(tmp_path):
    save_folder(hf_lfm2(seed=1, conv_bias=True), tmp_path)
    from ternlm.models.config import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="conv_bias"):
        load_hf_folder(tmp_path, torch.float32)
