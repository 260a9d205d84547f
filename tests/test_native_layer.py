"""kernels/layer.c: a whole decoder layer in one call (fp32 activations, quantized projections).

Oracles: the torch layer in models/llama.py on the same weights (the fused layer must agree with it to
fp32 rounding), transformers through tests/test_qweight.py (the real model), and the fused layer's own
runs split differently (batch invariance, bit for bit). Synthetic models cover what the default model
lacks: qwen2's q/k/v bias, qwen3's per-head q/k norms, mixed layouts in one projection, and gemma3's
layer kinds as data (GeGLU, post-attention / post-MLP norms, a window on one layer with its own RoPE
base, a query scale other than head_dim ** -0.5; tests/test_gemma3.py checks them against transformers)."""
from __future__ import annotations

import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.models.config import ModelConfig
from ternlm.kernels.build import Unavailable, load
from ternlm.models.llama import Segment, Transformer
from ternlm.linear.qweight import from_gguf
from ternlm.models.rope import Rope
from test_qweight import random_blocks
from lesser_isa import LESSER, run_built_for


GEMMA_WINDOW = 8


def tiny_model(qkv_bias: bool, qk_norm: bool, seed: int = 0, dense_o: bool = False,
               kquants: bool = False, kv_dtype: str = "float32", gemma: bool = False) -> Transformer:
    """2 layers, 4 heads over 2 kv heads, random GGML blocks of several types: hidden 64 (head_dim 32)
    with the 32-blocks types, or hidden 256 (head_dim 64) with the K-quants, whose blocks are 256.
    gemma: gemma3's kinds (with qk_norm): GeGLU, 4 norms a layer, layer 0 windowed (GEMMA_WINDOW, RoPE
    base 10k; layer 1 full, base 1e6), query scale 24 ** -0.5."""
    h, hd, inter = (256, 64, 512) if kquants else (64, 32, 160)
    kinds = dict(layer_windows=(GEMMA_WINDOW, 0), swa_rope=Rope(theta=10000.0), post_norms=True,
                 mlp_act="gelu_tanh", embed_scale=h ** 0.5, query_scale=24 ** -0.5) if gemma else {}
    cfg = ModelConfig(arch="gemma3" if gemma else "qwen3" if qk_norm else "qwen2" if qkv_bias else "llama",
                      vocab_size=96, hidden_size=h, intermediate_size=inter, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=hd, rope_theta=1e6 if gemma else 10000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=2048, tie_word_embeddings=True, qkv_bias=qkv_bias,
                      qk_norm=qk_norm, **kinds)
    g = torch.Generator().manual_seed(seed)
    types = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0] if kquants else [QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_0, QT.Q5_1]

    def q(name: str, out: int, inp: int, i: int):
        qt = types[i % len(types)]
        return from_gguf(torch.from_numpy(random_blocks(qt, out, inp, seed=seed * 100 + i)), qt, out, inp)

    qs, kvs = 4 * hd, 2 * hd
    w: dict = {"model.embed_tokens.weight": q("embed", 96, h, 0),
               "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    i = 1
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        for name, out, inp in [("self_attn.q_proj", qs, h), ("self_attn.k_proj", kvs, h),
                               ("self_attn.v_proj", kvs, h), ("self_attn.o_proj", h, qs),
                               ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h), ("mlp.down_proj", h, inter)]:
            w[p + name + ".weight"] = q(name, out, inp, i)
            if dense_o and name == "self_attn.o_proj":
                w[p + name + ".weight"] = w[p + name + ".weight"].dequantize()
            i += 1
        norms = ("input_layernorm", "post_attention_layernorm") + (
            ("pre_feedforward_layernorm", "post_feedforward_layernorm") if gemma else ())
        for n in norms:
            w[p + n + ".weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        if qkv_bias:
            for n, size in (("q", qs), ("k", kvs), ("v", kvs)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(size, generator=g)
        if qk_norm:
            for n in ("q_norm", "k_norm"):
                w[p + f"self_attn.{n}.weight"] = 1 + 0.1 * torch.randn(hd, generator=g)
    k = load()
    if isinstance(k, Unavailable):
        pytest.fail(f"the native kernels are part of the product and must build here: {k.reason}")
    return Transformer(cfg, w, torch.float32, pack=False, kernels=k, keep_quantized=True, kv_dtype=kv_dtype)


def caches(m: Transformer, cap: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (m.cfg.num_layers, m.cfg.num_kv_heads, cap, m.cfg.head_dim)
    return torch.zeros(shape, dtype=m.kv_dtype), torch.zeros(shape, dtype=m.kv_dtype)


VARIANTS = [(False, False, False, False), (True, False, False, False), (False, True, False, False),
            (True, False, True, False), (False, True, False, True), (False, True, True, True)]
VARIANT_IDS = ["llama", "qwen2-bias", "qwen3-qknorm", "qwen2-kquants", "gemma3", "gemma3-kquants"]


@pytest.mark.parametrize("qkv_bias,qk_norm,kquants,gemma", VARIANTS, ids=VARIANT_IDS)
def test_fused_layer_matches_the_torch_layer(qkv_bias, qk_norm, kquants, gemma):
    m = tiny_model(qkv_bias, qk_norm, kquants=kquants, gemma=gemma)
    assert m.native is not None, "every layer of this model fits layer.c"
    ids = torch.randint(0, 96, (300,), generator=torch.Generator().manual_seed(1))
    k1, v1 = caches(m)
    fused = m.forward(m.embed_ids(ids), 0, k1, v1, all_logits=True)
    native, m.native = m.native, None            # the torch layers on the same weights
    try:
        k2, v2 = caches(m)
        ref = m.forward(m.embed_ids(ids), 0, k2, v2, all_logits=True)
    finally:
        m.native = native
    scale = ref.abs().max().item()
    assert (fused - ref).abs().max().item() <= 1e-4 * scale
    assert (k1 - k2).abs().max().item() <= 1e-4 * k2.abs().max().item()
    assert (v1 - v2).abs().max().item() <= 1e-4 * v2.abs().max().item()
    assert k1[:, :, 300:].abs().max() == 0, "nothing written past the positions fed"


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("qkv_bias,qk_norm,kquants,gemma", VARIANTS, ids=VARIANT_IDS)
def test_fused_layer_is_batch_invariant(qkv_bias, qk_norm, kquants, gemma, kv_dtype):
    """[BATCH-INVARIANT] a sequence's logits and KV bits are the same whole, in chunks, token by token,
    and batched with other sequences, with an fp32 or an fp16 cache (gemma3: 70 tokens span several of
    layer 0's windows)."""
    m = tiny_model(qkv_bias, qk_norm, seed=2, kquants=kquants, kv_dtype=kv_dtype, gemma=gemma)
    ids = torch.randint(0, 96, (70,), generator=torch.Generator().manual_seed(4))
    kw, vw = caches(m)
    whole = m.forward(m.embed_ids(ids), 0, kw, vw, all_logits=True)
    kc, vc = caches(m)
    chunks = [m.forward(m.embed_ids(ids[a:b]), a, kc, vc, all_logits=True) for a, b in [(0, 9), (9, 40), (40, 70)]]
    assert torch.equal(torch.cat(chunks), whole)
    ks, vs = caches(m)
    m.forward(m.embed_ids(ids[:60]), 0, ks, vs)
    steps = [m.forward(m.embed_ids(ids[t:t + 1]), t, ks, vs) for t in range(60, 70)]
    assert torch.equal(torch.cat(steps), whole[60:])
    for a, b in ((kw, kc), (vw, vc), (kw, ks), (vw, vs)):
        assert torch.equal(a, b)
    # with two other sequences in the same forward (a decode row and a prefill chunk)
    other = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(5))
    kb, vb = caches(m)
    ko, vo = caches(m, 256)
    m.forward(m.embed_ids(ids[:60]), 0, kb, vb)
    m.forward(m.embed_ids(other[:20]), 0, ko, vo)
    x = torch.cat([m.embed_ids(other[20:21]), m.embed_ids(ids[60:70]), m.embed_ids(other[:5])])
    kn, vn = caches(m, 256)
    out = m.forward_batch(x, [Segment(20, 1, ko, vo), Segment(60, 10, kb, vb, "all"), Segment(0, 5, kn, vn, "none")])
    assert torch.equal(out[1], whole[60:])
    assert out[2] is None
    assert torch.equal(kb, kw) and torch.equal(vb, vw)


@pytest.mark.parametrize("gemma", [False, True], ids=["qwen2-bias", "gemma3"])
def test_fused_layer_threads_do_not_change_bits(gemma):
    m = tiny_model(not gemma, gemma, seed=3, gemma=gemma)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(6))
    k1, v1 = caches(m)
    two = m.forward(m.embed_ids(ids), 0, k1, v1, all_logits=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        k2, v2 = caches(m)
        one = m.forward(m.embed_ids(ids), 0, k2, v2, all_logits=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(k1, k2)


def test_layers_stay_in_torch_when_a_projection_is_dense():
    """A dense projection (here every o_proj) keeps the whole model on the torch layers."""
    assert tiny_model(False, False, dense_o=True).native is None


def test_kv_dtype_choice():
    """auto: fp16 where the layers run fused, fp32 where they cannot. fp16 and q8_0 are taken wherever attention
    runs in C, the torch layers' table path included (fp16 written there as torch rounds it: layer 0's cache is
    the fp32 one rounded, as the fused layers write it); without the kernels both are refused."""
    from tiny import tiny_loaded
    assert tiny_model(False, False, kv_dtype="auto").kv_dtype == torch.float16
    assert tiny_model(False, False, dense_o=True, kv_dtype="auto").kv_dtype == torch.float32
    m16 = tiny_model(False, False, dense_o=True, kv_dtype="float16")
    m32 = tiny_model(False, False, dense_o=True, kv_dtype="float32")
    assert m16.native is None and m16.kv_dtype == torch.float16
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))
    (k16, v16), (k32, v32) = caches(m16), caches(m32)
    m16.forward(m16.embed_ids(ids), 0, k16, v16)
    m32.forward(m32.embed_ids(ids), 0, k32, v32)
    assert torch.equal(k16[0], k32[0].half()) and torch.equal(v16[0], v32[0].half())
    assert tiny_model(False, False, dense_o=True, kv_dtype="q8_0").kv_type.name == "q8_0"
    with pytest.raises(ValueError, match="unknown KV dtype"):
        tiny_model(False, False, kv_dtype="int8")
    _, loaded = tiny_loaded("llama", 0, head_dim=32)
    for kv in ("float16", "q8_0"):
        with pytest.raises(ValueError, match="needs the native kernels"):
            Transformer(loaded.config, dict(loaded.weights), torch.float32, pack=False, kernels=None, kv_dtype=kv)


def fp16_cache_check(qkv_bias: bool, qk_norm: bool, kquants: bool, gemma: bool = False) -> None:
    """The fp16 cache holds exactly the fp32 layer's K/V rounded to nearest even (torch's .half()), and
    the model's answers stay those of the fp32 cache to fp16's precision."""
    m16 = tiny_model(qkv_bias, qk_norm, kquants=kquants, kv_dtype="float16", gemma=gemma)
    m32 = tiny_model(qkv_bias, qk_norm, kquants=kquants, gemma=gemma)
    ids = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(7))
    k16, v16 = caches(m16)
    k32, v32 = caches(m32)
    a16 = m16.forward(m16.embed_ids(ids), 0, k16, v16, all_logits=True)
    a32 = m32.forward(m32.embed_ids(ids), 0, k32, v32, all_logits=True)
    # layer 0 sees the same input in both: its cache entries are the fp32 ones, rounded
    assert torch.equal(k16[0], k32[0].half()) and torch.equal(v16[0], v32[0].half())
    assert (a16 - a32).abs().max() <= 1e-2 * a32.abs().max()


@pytest.mark.parametrize("qkv_bias,qk_norm,kquants,gemma", VARIANTS, ids=VARIANT_IDS)
def test_fp16_cache_is_the_rounded_fp32_cache(qkv_bias, qk_norm, kquants, gemma):
    fp16_cache_check(qkv_bias, qk_norm, kquants, gemma)


_ISA_SCRIPT = textwrap.dedent("""
    import torch
    from test_native_layer import tiny_model, caches, fp16_cache_check, VARIANTS
    for bias, norm, kq, gemma in VARIANTS:
        m = tiny_model(bias, norm, kquants=kq, gemma=gemma)
        assert m.native is not None
        ids = torch.randint(0, 96, (50,), generator=torch.Generator().manual_seed(1))
        k1, v1 = caches(m)
        whole = m.forward(m.embed_ids(ids), 0, k1, v1, all_logits=True)
        k2, v2 = caches(m)
        parts = [m.forward(m.embed_ids(ids[a:b]), a, k2, v2, all_logits=True) for a, b in [(0, 13), (13, 14), (14, 50)]]
        assert torch.equal(torch.cat(parts), whole) and torch.equal(k1, k2) and torch.equal(v1, v2)
        native, m.native = m.native, None
        k3, v3 = caches(m)
        ref = m.forward(m.embed_ids(ids), 0, k3, v3, all_logits=True)
        m.native = native
        assert (whole - ref).abs().max() <= 1e-4 * ref.abs().max()
        fp16_cache_check(bias, norm, kq, gemma)   # F16C (AVX2) / libgcc (baseline) rounding = torch's
    print(m.kernels.isa, "ok")
""")


@LESSER
def test_lesser_isa_builds(march, isa, tmp_path):
    """layer.c as an AVX2-only (or baseline x86-64) CPU builds it: agrees with torch, invariant (gemma3's
    kinds included: GeGLU, output norms, the window)."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]
