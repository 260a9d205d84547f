"""kernels/attention.c against a float64 softmax attention we did not tune, and its batch invariance:
a query row's bits must not depend on the chunk it was computed in (prefill of any size, a tail after
a reuse, a single decode step), nor on the thread count."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ternlm.kernels.build import Kernels, Unavailable, load
from ternlm.models.llama import KV_DTYPE, native_attention
from lesser_isa import LESSER, run_built_for


def kernels() -> Kernels:
    k = load()
    if isinstance(k, Unavailable):
        pytest.fail(f"the native kernels are part of the product and must build here: {k.reason}")
    return k


def reference(q, k, v, start):
    """float64 causal softmax attention: q (H, T, D), k/v (KV, cap, D) -> (T, H * D)."""
    H, T, D = q.shape
    G = H // k.shape[0]
    out = torch.empty(T, H * D, dtype=torch.float64)
    pos = start + torch.arange(T)
    for h in range(H):
        s = (q[h].double() * D ** -0.5) @ k[h // G].double().T               # (T, cap)
        s[torch.arange(k.shape[1])[None, :] > pos[:, None]] = float("-inf")
        out[:, h * D:(h + 1) * D] = torch.softmax(s, -1) @ v[h // G].double()
    return out


SHAPES = [(9, 3, 64), (14, 2, 64), (16, 8, 128), (4, 4, 64)]   # smollm2, qwen2.5-0.5b, qwen3-like, MHA


@pytest.mark.parametrize("H,KV,D", SHAPES, ids=str)
def test_matches_float64_softmax(H, KV, D):
    torch.manual_seed(H * D)
    cap = 1024
    k, v = torch.randn(KV, cap, D), torch.randn(KV, cap, D)
    q = torch.randn(H, 300, D) * 3              # peaked softmaxes too
    out = native_attention(kernels(), q, k, v, 600)
    ref = reference(q, k, v, 600)
    assert (out.double() - ref).abs().max().item() < 2e-5


@pytest.mark.parametrize("H,KV,D", SHAPES[:2], ids=str)
def test_rows_are_batch_invariant(H, KV, D):
    """Every split of 700 positions (block edges at 256 and 512 inside some chunks) gives the bits of
    one 700-row call, with 1 or 2 threads."""
    torch.manual_seed(1)
    cap = 1024
    k, v = torch.randn(KV, cap, D), torch.randn(KV, cap, D)
    q = torch.randn(H, 700, D)
    kn = kernels()
    full = native_attention(kn, q, k, v, 0)
    for a, b in [(0, 1), (255, 256), (256, 257), (0, 37), (200, 300), (250, 520), (511, 700), (699, 700)]:
        assert torch.equal(native_attention(kn, q[:, a:b], k, v, a), full[a:b]), (a, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_attention(kn, q, k, v, 0), full)
    finally:
        torch.set_num_threads(threads)


def test_never_reads_past_the_position():
    """Keys after a row's position do not exist for it: garbage (even NaN) there changes nothing."""
    torch.manual_seed(2)
    k, v = torch.randn(3, 512, 64), torch.randn(3, 512, 64)
    q = torch.randn(9, 10, 64)
    kn = kernels()
    before = native_attention(kn, q, k, v, 100)
    k[:, 110:], v[:, 110:] = float("nan"), float("nan")
    assert torch.equal(native_attention(kn, q, k, v, 100), before)


def test_refuses_mismatched_caches():
    kn = kernels()
    q = torch.randn(9, 4, 64)
    with pytest.raises(Exception, match="caches do not match"):
        native_attention(kn, q, torch.randn(3, 256, 64).bfloat16(), torch.randn(3, 256, 64).bfloat16(), 0)
    with pytest.raises(Exception, match="caches do not match"):
        native_attention(kn, q, torch.randn(3, 256, 64), torch.randn(3, 256, 64), 254)   # 254 + 4 > 256


_ISA_SCRIPT = textwrap.dedent("""
    import torch
    from ternlm.kernels.build import load
    from ternlm.models.llama import native_attention
    from test_native_attention import reference
    kn = load()
    k, v = torch.randn(2, 768, 64), torch.randn(2, 768, 64)
    q = torch.randn(14, 600, 64)
    full = native_attention(kn, q, k, v, 0)
    assert (full.double() - reference(q, k, v, 0)).abs().max() < 2e-5
    for a, b in [(0, 1), (250, 300), (599, 600)]:
        assert torch.equal(native_attention(kn, q[:, a:b], k, v, a), full[a:b]), (a, b)
    print(kn.isa, "ok")
""")


@LESSER
def test_lesser_isa_builds(march, isa, tmp_path):
    """The kernels as an AVX2-only (or a baseline x86-64) CPU builds them: exact and invariant too."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]


def test_engine_without_native_kernels_falls_back(tmp_path):
    """TERNLM_NATIVE=0 (or no compiler): torch attention, dense weights, a distinct fingerprint, and
    --weights gguf refused in one line."""
    script = textwrap.dedent("""
        from ternlm import Engine
        from ternlm.engine.weights import WeightsUnavailable
        e = Engine.load("smollm2-135m", dtype="float32")
        assert e.kernels is None and "attention=torch" in e.kernel_fingerprint
        out = e.generate(e.apply_chat_template([{"role": "user", "content": "Hi"}]), max_tokens=4)
        assert len(out.token_ids) == 4 or out.finish_reason == "stop"
        try:
            Engine.load("smollm2-135m", weights="gguf")
        except WeightsUnavailable as err:
            print("refused:", err)
    """)
    env = dict(os.environ, TERNLM_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused: --weights gguf needs the native kernel: native kernels turned off" in r.stdout


def test_many_sequences_in_one_call_equal_each_alone():
    """tq_attention_segments (a step's sequences in one call) gives each row the bits of its own call."""
    from types import SimpleNamespace

    from ternlm.models.llama import Segment, segment_table
    torch.manual_seed(3)
    cfg = SimpleNamespace(num_layers=2, attention_layers=(0, 1), num_kv_heads=3, head_dim=64)
    segs = [Segment(start, n, torch.randn(2, 3, cap, 64), torch.randn(2, 3, cap, 64))
            for start, n, cap in [(0, 5, 256), (700, 1, 1024), (255, 40, 512), (12, 1, 256)]]
    M = sum(s.length for s in segs)
    q = torch.randn(9, M, 64)
    kn = kernels()
    for layer in range(2):
        qs = (q * 64 ** -0.5).contiguous()
        out = torch.empty(M, 9 * 64)
        table = segment_table(segs, cfg)
        kn.attention_segments(table.data_ptr(), len(segs), layer, qs.data_ptr(), M, 9, 3, 64, out.data_ptr(),
                              torch.get_num_threads())
        r0 = 0
        for s in segs:
            alone = native_attention(kn, q[:, r0:r0 + s.length], s.k_cache[layer], s.v_cache[layer], s.start)
            assert torch.equal(out[r0:r0 + s.length], alone)
            r0 += s.length
    with pytest.raises(Exception, match="caches do not fit"):
        segment_table([Segment(0, 1, torch.randn(2, 3, 256, 64).bfloat16(), torch.randn(2, 3, 256, 64).bfloat16())],
                      cfg)


def test_lone_row_of_one_kv_head_splits_its_heads_with_the_same_bits():
    """A decode row of a model with one kv head (gemma3: 4 query heads) is one task; with more threads than
    tasks the group's query heads are split across threads. Every thread count gives the bits of one
    thread, and the rows match the float64 reference."""
    from types import SimpleNamespace

    from ternlm.models.llama import Segment, segment_table
    g = torch.Generator().manual_seed(5)
    cfg = SimpleNamespace(num_layers=1, attention_layers=(0,), num_kv_heads=1, head_dim=256)
    cap, start = 3000, 2999                      # one row at position 2999: all 3,000 keys
    k, v = torch.randn(1, 1, cap, 256, generator=g), torch.randn(1, 1, cap, 256, generator=g)
    q = torch.randn(4, 1, 256, generator=g)
    qs = (q * 256 ** -0.5).contiguous()
    table = segment_table([Segment(start, 1, k, v)], cfg)
    kn = kernels()
    outs = []
    for threads in (1, 2, 3, 4):
        out = torch.empty(1, 4 * 256)
        kn.attention_segments(table.data_ptr(), 1, 0, qs.data_ptr(), 1, 4, 1, 256, out.data_ptr(), threads)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = reference(q, k[0], v[0], start)
    assert (outs[0].double() - ref).abs().max().item() < 1e-5


def kv_formats_check(kn) -> None:
    """An fp16 or q8_0 cache gives exactly the bits of an fp32 cache holding the same (widened) values: the
    kernel widens each element exactly (q8_0: code x scale, exact in fp32), the arithmetic is the fp32 one
    (q8_0: on the rotated queries, its keys being rotated [KV-ROTATE]). The q8_0 rows the kernel writes are
    q8_0_reference's bytes (a second rendering of the rule, in torch), and its attention stays close to the
    fp32 attention on the unquantized values (a rotation missing on either side would not)."""
    from types import SimpleNamespace

    from ternlm.kv.kvtype import KV_TYPES, q8_0_reference, q8_0_values
    from ternlm.models.llama import Segment, segment_table
    cfg = SimpleNamespace(num_layers=2, attention_layers=(0, 1), num_kv_heads=3, head_dim=64)
    g = torch.Generator().manual_seed(11)
    raw = [(start, n, torch.randn(2, 3, cap, 64, generator=g) * 3, torch.randn(2, 3, cap, 64, generator=g))
           for start, n, cap in [(0, 5, 256), (700, 1, 1024), (255, 40, 512)]]
    raw[0][2][0, 0, 0, :32] = 0.0                                   # an all-zero block: scale 0, codes 0
    M = sum(n for _, n, _, _ in raw)
    qs = (torch.randn(9, M, 64, generator=g) * 64 ** -0.5).contiguous()

    def q8(x, keys):                                # (2, 3, cap, 64) -> (2, 3, cap, 68) by the kernel
        rows = kn.kv_q8_rows(x.reshape(-1, 64), keys)
        assert torch.equal(rows, q8_0_reference(x.reshape(-1, 64), keys))
        return rows.view(*x.shape[:3], 68)

    def attend(kv, caches, q, layer):
        segs = [Segment(s, n, k.contiguous(), v.contiguous()) for s, n, k, v in caches]
        out = torch.empty(M, 9 * 64)
        table = segment_table(segs, cfg, kv)
        kn.attention_segments(table.data_ptr(), len(segs), layer, q.data_ptr(), M, 9, 3, 64, out.data_ptr(),
                              torch.get_num_threads(), kv_mode=kv.mode)
        return out

    stored = {"float16": [(s, n, k.half(), v.half()) for s, n, k, v in raw],
              "q8_0": [(s, n, q8(k, True), q8(v, False)) for s, n, k, v in raw]}
    widened = {"float16": [(s, n, k.float(), v.float()) for s, n, k, v in stored["float16"]],
               "q8_0": [(s, n, q8_0_values(k, 64), q8_0_values(v, 64)) for s, n, k, v in stored["q8_0"]]}
    rotated = kn.kv_rotate_q(qs.reshape(-1, 64)).view(qs.shape)
    for name in ("float16", "q8_0"):
        for layer in range(2):
            got = attend(KV_TYPES[name], stored[name], qs, layer)
            assert torch.equal(got, attend(KV_TYPES["float32"], widened[name], rotated if name == "q8_0" else qs,
                                           layer)), name
            exact = attend(KV_TYPES["float32"], raw, qs, layer)
            assert (got - exact).abs().max() < (0.15 if name == "q8_0" else 1e-2), name
    with pytest.raises(Exception, match="caches do not fit"):   # the table's format is checked, not trusted
        segment_table([Segment(0, 1, stored["float16"][0][2], stored["float16"][0][3])], cfg, KV_TYPES["float32"])
    with pytest.raises(Exception, match="caches do not fit"):   # q8_0 rows are 68 bytes wide, not 64
        segment_table([Segment(0, 1, raw[0][2].to(torch.uint8), raw[0][3].to(torch.uint8))], cfg, KV_TYPES["q8_0"])


def test_fp16_and_q8_0_caches_read_as_their_fp32_values():
    kv_formats_check(kernels())


def test_q8_0_rows_hold_each_value_within_half_a_step():
    """Each value comes back within half its block's step (scale d = max|x| / 127 in fp16), blocks of 32
    apart, over the magnitudes whose d is a normal fp16 (K/V values of real models lie well inside); the
    scale is the block's own."""
    from ternlm.kv.kvtype import q8_0_values
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 128, generator=g) * torch.logspace(-2, 4, 50).unsqueeze(1)
    rows = kernels().kv_q8_rows(x, False)
    back = q8_0_values(rows, 128)
    step = rows[:, 128:].contiguous().view(torch.float16).float().repeat_interleave(32, -1)
    assert ((back - x).abs() <= step * 0.5 * (1 + 2 ** -10) + 1e-30).all()
    amax = x.view(50, 4, 32).abs().amax(-1).repeat_interleave(32, -1)
    assert ((step - amax / 127).abs() <= amax / 127 * 2 ** -10 + 2 ** -24).all()


def test_rotated_keys_lose_less_to_an_outlier_dimension():
    """[KV-ROTATE]: keys with one dimension ~50x the rest (as Qwen2's key bias makes them): q . k from rotated
    q8_0 keys and rotated queries errs much less than from plain q8_0 keys, and the rotation itself keeps q . k."""
    from ternlm.kv.kvtype import q8_0_values
    kn, g = kernels(), torch.Generator().manual_seed(3)
    k, q = torch.randn(512, 128, generator=g), torch.randn(512, 128, generator=g)
    k[:, 5] *= 50
    exact = (q.double() * k.double()).sum(-1)
    plain = (q.double() * q8_0_values(kn.kv_q8_rows(k, False), 128).double()).sum(-1)
    rotated = (kn.kv_rotate_q(q).double() * q8_0_values(kn.kv_q8_rows(k, True), 128).double()).sum(-1)
    assert (rotated - exact).abs().mean() < 0.4 * (plain - exact).abs().mean()
    from ternlm.kv.kvtype import hadamard32
    assert torch.allclose((kn.kv_rotate_q(q) * hadamard32(k)).sum(-1).double(), exact, rtol=1e-4, atol=1e-3)


_ISA_SCRIPT_F16 = textwrap.dedent("""
    import pytest  # noqa: F401  (the check raises through pytest.raises)
    from ternlm.kernels.build import load
    from test_native_attention import kv_formats_check
    kn = load()
    kv_formats_check(kn)
    print(kn.isa, "ok")
""")


@LESSER
def test_lesser_isa_fp16_and_q8_0_caches(march, isa, tmp_path):
    """The fp16 and q8_0 caches written and read by the AVX2 (F16C) and baseline (software) builds: the same
    q8_0 bytes and the same exact widening."""
    assert run_built_for(march, _ISA_SCRIPT_F16, tmp_path) == [isa, "ok"]
