"""Integer products (kernels/qint8.c, `--activations int8`): the int layouts (models/qweight.py to_int8)
multiplied with activations quantized to int8 per row and group of 32.

Oracles: the layouts' own dequantization (checked against the gguf package in test_qweight.py), the
activations' quantization recomputed with torch's IEEE fp32 operations, a float64 evaluation of the
product of the quantized activations and the exact weights (within a bound derived from the kernel's
fp32 roundings), transformers on the same file (top-1 agreement), and the kernels built for AVX2 and
for baseline x86-64 on this host, which must give the same bits."""
from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from ternlm.linear.qlinear import QLinear
from ternlm.linear.qweight import GROUP, to_int8, to_lanes
from lesser_isa import run_built_for
from test_qweight import K_LAYOUTS, LAYOUTS, _weights, kernels

ALL = LAYOUTS + K_LAYOUTS
IDS = [f"{f}_{m}" for f, m in ALL]
U = 2.0 ** -24                       # fp32's unit roundoff


def int8_kernels():
    return dataclasses.replace(kernels(), activations="int8")


def int_linear(q) -> QLinear:
    """A QLinear over q's int layout, multiplied by qint8.c."""
    lin = QLinear([to_int8(to_lanes(q))], None, int8_kernels())
    assert lin.parts[0].int8
    return lin


def quantize(x: torch.Tensor):
    """The kernel's own activation quantization (tq_int8_quant): q (M, K) int8, d (M, K/32), s16 (M, K/16)."""
    M, K = x.shape
    x = x.contiguous()
    q, d, s16 = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // 32), torch.empty(M, K // 16, dtype=torch.int32)
    kernels().lib.tq_int8_quant(x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(), s16.data_ptr())
    return q, d, s16


@pytest.mark.parametrize("layout", ALL, ids=IDS)
@pytest.mark.parametrize("out", [96, 40])                            # 40: a padded last block of 16 rows
def test_to_int8_keeps_every_weight_in_as_many_bytes(layout, out):
    """The same weights and codes as the lanes layout, in no more bytes (Q6_K: GGML's 0.82 a weight)."""
    q = _weights(layout, out, 512)
    lanes = to_lanes(q)
    i = to_int8(lanes)
    assert i.int8 and i.lanes and not lanes.int8 and to_int8(i) is i
    assert (i.shape, i.mode, i.out) == (lanes.shape, lanes.mode, lanes.out) and i.nbytes <= lanes.nbytes
    assert torch.equal(i.dequantize(), q.dequantize())
    rows = torch.tensor([0, out - 1, 17, 16, 15, 33])
    assert torch.equal(i.codes_of_rows(rows), q.codes_of_rows(rows))
    if layout == K_LAYOUTS[2]:                                       # Q6_K
        assert i.nbytes <= 210 / 256 * -(-out // 16) * 16 * 512    # rows padded to blocks of 16


def test_activation_quantization_is_the_ieee_formula():
    """q = round-half-even(x * (127 / max|x|)) per group of 32, d = max|x| / 127, s16 = sums of 16 of q:
    torch's fp32 operations (each one IEEE rounding) give the kernel's bits; zero groups give zeros."""
    x = torch.randn(7, 512) * torch.logspace(-20, 20, 512).float()
    x[3, 64:96] = 0.0                                                  # an all-zero group
    x[4, :32] = torch.tensor([0.5, -0.5, 1.5, 2.5] * 8) * (127 / 2.5)  # exact halves: ties to even
    q, d, s16 = quantize(x)
    g = x.view(7, 16, 32)
    a = g.abs().amax(-1, keepdim=True)
    ref_q = torch.where(a > 0, torch.round(g * (torch.tensor(127.0) / a)), torch.zeros(())).to(torch.int8)
    assert torch.equal(q.view(7, 16, 32), ref_q)
    assert torch.equal(d, (a / 127.0).squeeze(-1))
    assert torch.equal(s16, ref_q.view(7, 32, 16).int().sum(-1, dtype=torch.int32))
    assert q.abs().max() <= 127 and (q.view(7, 16, 32)[3, 2] == 0).all() and d[3, 2] == 0


def _float64_product(q_act, d, w):
    """The product the kernel rounds, in float64: sum_k d[m, k/32] q[m, k] W[n, k] with W the exact
    weights (code * scale + bias per group, float64), and the magnitude A that bounds its rounding error."""
    M, K = q_act.shape
    codes = w.codes_of_rows(torch.arange(w.shape[0])).double()
    scale, bias = w.scale_bias()
    grp = GROUP[w.fmt]
    s, b = scale.repeat_interleave(grp, dim=1), bias.repeat_interleave(grp, dim=1)    # (N, K)
    xa = q_act.double() * d.double().repeat_interleave(32, dim=1)                      # (M, K), exact
    ref = xa @ (codes * s + b).T
    mag = xa.abs() @ (codes * s.abs() + b.abs()).T
    return ref, mag


@pytest.mark.parametrize("layout", ALL, ids=IDS)
@pytest.mark.parametrize("shape", [(200, 512), (96, 1536)])
def test_int8_product_is_the_exact_sum_rounded_per_group(layout, shape):
    """Each group adds s*dx*isum and b*dx*sx with one fma each (4 roundings of at most u a group), so the
    result is within (2G + 4) u A of the float64 product of the same quantized activations (A: the sum
    of the terms' magnitudes). A kernel that dropped a code bit, a scale or a group misses by far more."""
    q = _weights(layout, *shape)
    lin = int_linear(q)
    x = torch.randn(37, shape[1])
    y = lin(x)
    qa, d, _ = quantize(x)
    ref, mag = _float64_product(qa, d, lin.parts[0])
    G = shape[1] // 32
    err = (y.double() - ref).abs()
    assert (err <= (2 * G + 4) * U * mag).all(), (err / mag.clamp_min(1e-300)).max().item()
    # and it is a product of the weights: each activation moved by at most half a step d (+ the fp32 roundings
    # of 127 / a and of x * that: < 2^-12 d), so |y - x W| <= sum_k |W| d (1/2 + 2^-12) + the kernel's bound
    w = q.dequantize().double()
    exact = x.double() @ w.T
    step = (d.double() * (0.5 + 2.0 ** -12)).repeat_interleave(32, dim=1)
    assert ((y.double() - exact).abs() <= step @ w.abs().T + (2 * G + 4) * U * mag).all()


@pytest.mark.parametrize("layout", ALL, ids=IDS)
def test_int8_rows_are_batch_and_thread_invariant(layout):
    """[BATCH-INVARIANT] a row's bits depend neither on the rows beside it (M = 1..300, the row tiles of
    4 and their remainders) nor on the thread count (1-4: blocks handed out as threads come free)."""
    lin = int_linear(_weights(layout, 200, 512))
    x = torch.randn(300, 512)
    full = lin(x)
    for m in (1, 2, 3, 4, 5, 7, 9, 63, 200):
        for start in (0, 5):
            assert torch.equal(lin(x[start:start + m]), full[start:start + m]), (m, start)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(lin(x[:40]), full[:40]) and torch.equal(lin(x[:1]), full[:1]), n
    finally:
        torch.set_num_threads(threads)


_BITS_SCRIPT = textwrap.dedent("""
    import dataclasses, hashlib, torch
    from ternlm.kernels.build import load
    from ternlm.linear.qlinear import QLinear
    from ternlm.linear.qweight import to_int8, to_lanes
    from test_qweight import _weights, LAYOUTS, K_LAYOUTS
    k = dataclasses.replace(load(), activations="int8")
    print(k.int8_path)
    torch.manual_seed(0)
    x = torch.randn(40, 1536)
    x[7, 32:64] = 0.0
    for lay in LAYOUTS + K_LAYOUTS:
        for out in (576, 40):
            lin = QLinear([to_int8(to_lanes(_weights(lay, out, 1536)))], None, k)
            y = torch.cat([lin(x), lin(x[:1]), lin(x[1:6])])
            print(lay[0] + "_" + lay[1] + "_" + str(out), hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16])
""")


def test_int8_bits_are_the_same_on_every_cpu_kind(tmp_path):
    """[SAME-BITS-EVERY-ISA] the AVX-512 VNNI path (this host, where it has it), AVX-512 without VNNI
    (built for Skylake where the host has VNNI), the AVX2 path (vpmaddubsw, what an AVX2-only EPYC runs) and
    the baseline x86-64 build (scalar, libm fmaf) give
    the same product bits for every layout, alone and batched: integer sums are exact and every float
    step is one rounding per output in a fixed order. On an AVX2-only host the first two coincide."""
    native = run_built_for("native", _BITS_SCRIPT, tmp_path / "native")
    avx2 = run_built_for("x86-64-v3", _BITS_SCRIPT, tmp_path / "avx2")
    base = run_built_for("x86-64", _BITS_SCRIPT, tmp_path / "base")
    assert (avx2[0], base[0]) == ("avx2", "scalar") and native[0] in ("avx512-vnni", "avx512bw", "avx2")
    assert len(native) == 1 + 2 * 2 * len(ALL)
    assert native[1:] == avx2[1:] == base[1:]
    if native[0] == "avx512-vnni":     # AVX-512 without VNNI (Skylake-SP/X): its own emulated path, same bits
        sky = run_built_for("skylake-avx512", _BITS_SCRIPT, tmp_path / "skx")
        assert sky[0] == "avx512bw" and sky[1:] == native[1:]


def test_int8_engine_agrees_with_transformers(smollm2_q, hf_smollm2):
    """The int8 path is still the model: top-1 next tokens agree with transformers' fp32 forward on the
    same file at >= 90% of the positions (the quality benchmark measures more: `ternlm bench quality`)."""
    from test_model import TEXTS, hf_logits
    assert smollm2_q.model.activations == "int8"
    same = total = 0
    for text in TEXTS[:2]:
        ids = smollm2_q.tokenizer.encode(text)
        ours, ref = smollm2_q.logits(ids).argmax(-1), hf_logits(hf_smollm2, ids).argmax(-1)
        same += int((ours == ref).sum())
        total += len(ids)
    print(f"int8 activations: top-1 agreement with transformers {same}/{total}")
    assert same >= 0.9 * total


def test_int8_engine_batched_equals_alone():
    """The real model with int8 activations: five requests joining a batch at different steps (prefills
    beside decodes) give each one's tokens, logits and KV alone, bit for bit."""
    from ternlm import Engine
    from test_batching import alone, together
    e = Engine.load("smollm2-135m", weights="gguf", activations="int8", slots=6, prefix_reuse=False, chunk_size=64)
    assert e.model.activations == "int8"
    questions = ["What is the capital of France?", "Explain photosynthesis in one sentence. " * 6,
                 "List three prime numbers.", "Why is the sky blue? Answer briefly, for a child. " * 3, "Hi"]
    reqs = [(list(e.apply_chat_template([{"role": "user", "content": q}])), 8) for q in questions]
    solo = []
    for p, m in reqs:
        out, slot = alone(e, p, m)
        solo.append((out, slot.k.clone(), slot.v.clone(), list(slot.record.fed)))
    batched = together(e, reqs, [0, 0, 1, 3, 5], budget=48)
    for i, (b, (a, k, v, fed)) in enumerate(zip(batched, solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i
        n = len(fed)
        slot = e.slots[i + 1]
        assert slot.record.fed == fed
        assert torch.equal(slot.k[:, :, :n], k[:, :, :n]) and torch.equal(slot.v[:, :, :n], v[:, :, :n])


def test_parts_in_one_call_give_each_parts_bits():
    """tq_int8_parts (a fused q|k|v, gate|up or a DeltaNet's input projections: x quantized once, every
    part's blocks in one parallel region) gives each part's own product bits, whatever the layouts mixed,
    the row count and the thread count; a padded last block (40 rows) included."""
    mixed = [(ALL[0], 64), (K_LAYOUTS[-1], 40), (ALL[2], 96)]
    parts = [to_int8(to_lanes(_weights(layout, out, 512))) for layout, out in mixed]
    fused = QLinear(parts, None, int8_kernels())
    assert fused._fused is not None
    alone = [QLinear([p], None, int8_kernels()) for p in parts]
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (1, 7, 70):
                assert torch.equal(fused(x[:m]), torch.cat([q(x[:m]) for q in alone], dim=1)), (threads, m)
    finally:
        torch.set_num_threads(before)
