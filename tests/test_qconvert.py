"""kernels/convert.c (models/qconvert.py): GGML blocks -> lanes layouts natively, the same bits as the
Python path qweight.to_lanes(qweight.from_gguf(...)), every field, dtype and shape.

Oracle: the Python conversion, itself checked against the gguf package's dequantizer
(tests/test_qweight.py). Blocks are random bytes with well-formed fp16 scales, plus extreme ones (the
largest and smallest fp16, subnormals, zero, negative zero, negative d); floats are compared by their
bits, so a NaN or -0 in a K-quant's sup (kept as GGML's bytes) must match too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.kernels.build import load
from ternlm.linear.qconvert import NATIVE, lanes_empty, lanes_from_gguf
from ternlm.linear.qweight import QWeight, from_gguf, to_int8, to_lanes
from test_qweight import _F16_AT, kernels, random_blocks
from lesser_isa import LESSER, run_built_for

TYPES = sorted(NATIVE, key=lambda t: t.name)
_FP16_EXTREMES = np.array([65504.0, -65504.0, 6.1e-5, -6.1e-5, 6e-8, -6e-8, 0.0, -0.0, 1.0, -2.5],
                          dtype=np.float16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers (a float NaN equals itself, -0 differs from +0)."""
    if t.dtype.is_floating_point:
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def assert_same(a: QWeight, b: QWeight) -> None:
    assert a.fmt == b.fmt and a.mode == b.mode
    for f in ("codes", "scale", "bias", "high", "sup"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous(), f
            assert torch.equal(_bits(x), _bits(y)), f


def extreme_blocks(qtype: QT, out: int, inp: int, seed: int, special: bool = False) -> np.ndarray:
    """random_blocks with its fp16 fields drawn from the extremes (and, with `special`, an inf and a NaN
    too: a K-quant keeps them as bytes; the other types then convert in Python's "f32" mode)."""
    raw = random_blocks(qtype, out, inp, seed)
    size = NATIVE[qtype][3]
    blocks = raw.reshape(-1, size)
    rng = np.random.default_rng(seed + 1)
    pool = np.concatenate([_FP16_EXTREMES, np.array([np.inf, -np.inf, np.nan], dtype=np.float16)]) if special \
        else _FP16_EXTREMES
    for off in _F16_AT[qtype]:
        pick = rng.random(len(blocks)) < 0.5
        vals = rng.choice(pool, int(pick.sum())).astype(np.float16)
        blocks[pick, off:off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return raw


def python_path(raw: torch.Tensor, qtype: QT, out: int, inp: int) -> QWeight:
    q = from_gguf(raw, qtype, out, inp)
    return to_lanes(q) or q


SHAPES = [(16, 256), (48, 512), (768, 2048), (2048, 768), (160, 1536)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_native_equals_python(qtype, shape):
    out, inp = shape
    k = kernels()
    for seed, make in ((out + inp, random_blocks), (3, extreme_blocks)):
        raw = torch.from_numpy(make(qtype, out, inp, seed))
        native = lanes_from_gguf(raw, qtype, out, inp, kernels=k)
        assert native is not None and native.lanes
        assert_same(native, python_path(raw, qtype, out, inp))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_inf_or_nan_scales(qtype):
    """A K-quant keeps an inf/NaN d as GGML's bytes: native, the same bits. The one-scale types decide
    "f32" mode on such a matrix (qweight._scale_mode): not native, None, the Python path's."""
    raw = torch.from_numpy(extreme_blocks(qtype, 64, 512, seed=11, special=True))
    native = lanes_from_gguf(raw, qtype, 64, 512)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        assert_same(native, python_path(raw, qtype, 64, 512))
    else:
        assert native is None and python_path(raw, qtype, 64, 512).mode == "f32"


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q5_0], ids=lambda t: t.name)
def test_gathered_rows_equal_permuted_python(qtype):
    """order: the loader's q/k permutations and fused-matrix splits (whole rows) -> the Python path's
    permute_rows then to_lanes of the same rows."""
    out, inp = 96, 512
    raw = torch.from_numpy(random_blocks(qtype, out, inp, seed=5))
    q = from_gguf(raw, qtype, out, inp)
    for order in (torch.randperm(out, generator=torch.Generator().manual_seed(1)), torch.arange(32, 80)):
        native = lanes_from_gguf(raw, qtype, len(order), inp, order=order)
        assert_same(native, to_lanes(q.permute_rows(order)))


def test_not_covered_is_none():
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 24, 256, seed=1))
    assert lanes_from_gguf(raw, QT.Q4_K, 24, 256) is None                      # rows % 16: Python's path
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 16, 256, seed=1))
    assert lanes_from_gguf(raw, QT.Q4_K, 32, 256) is None                      # not the matrix's rows
    assert lanes_from_gguf(torch.zeros(16 * 256 * 2, dtype=torch.uint8), QT.F16, 16, 256) is None
    from ternlm.kernels.build import Unavailable
    assert lanes_from_gguf(raw, QT.Q4_K, 16, 256, kernels=Unavailable("test")) is None


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_out_is_written_and_returned_with_the_same_bits(qtype):
    """out= (a streamed expert's reused buffers, moe.StreamedExperts [RING]): the same bits as new tensors,
    written into out's own storage; a second matrix into the same out overwrites all of it."""
    out, inp = 48, 512
    k = kernels()
    buf = lanes_empty(qtype, out, inp)
    ptrs = [t.data_ptr() for t in (buf.codes, buf.scale, buf.bias, buf.high, buf.sup) if t is not None]
    for seed in (1, 2):
        raw = torch.from_numpy(random_blocks(qtype, out, inp, seed=seed))
        got = lanes_from_gguf(raw, qtype, out, inp, kernels=k, out=buf)
        assert got is buf
        assert [t.data_ptr() for t in (got.codes, got.scale, got.bias, got.high, got.sup) if t is not None] == ptrs
        assert_same(got, lanes_from_gguf(raw, qtype, out, inp, kernels=k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int_layout_in_one_pass_equals_to_int8_of_the_lanes(qtype):
    """int8=True (tq_convert_int: a streamed expert read straight into qint8.c's layout): the bits of
    qweight.to_int8 of the lanes weight, every field, for random and extreme blocks, gathered rows, and
    written into a reused int buffer (lanes_empty(..., int8=True)) twice."""
    k = kernels()
    for out, inp in ((16, 256), (48, 512), (160, 1536), (768, 2048), (2048, 768)):   # the last two: a 30B expert's
        for seed, make in ((out + inp, random_blocks), (3, extreme_blocks)):
            raw = torch.from_numpy(make(qtype, out, inp, seed))
            native = lanes_from_gguf(raw, qtype, out, inp, kernels=k, int8=True)
            assert native is not None and native.int8
            assert_same(native, to_int8(python_path(raw, qtype, out, inp)))
    out, inp = 96, 512
    raw = torch.from_numpy(random_blocks(qtype, out, inp, seed=5))
    order = torch.randperm(out, generator=torch.Generator().manual_seed(1))
    assert_same(lanes_from_gguf(raw, qtype, out, inp, order=order, int8=True),
                to_int8(to_lanes(from_gguf(raw, qtype, out, inp).permute_rows(order))))
    buf = lanes_empty(qtype, 48, 512, int8=True)
    for seed in (1, 2):
        raw = torch.from_numpy(random_blocks(qtype, 48, 512, seed=seed))
        assert lanes_from_gguf(raw, qtype, 48, 512, out=buf, int8=True) is buf
        assert_same(buf, to_int8(python_path(raw, qtype, 48, 512)))
    with pytest.raises(ValueError):                           # a lanes buffer is not an int one
        lanes_from_gguf(raw, qtype, 48, 512, out=lanes_empty(qtype, 48, 512), int8=True)


def test_out_that_does_not_fit_is_refused():
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 32, 512, seed=3))
    for wrong in (lanes_empty(QT.Q4_K, 16, 512), lanes_empty(QT.Q4_K, 32, 256), lanes_empty(QT.Q6_K, 32, 512),
                  lanes_empty(QT.Q5_K, 32, 512)):
        with pytest.raises(ValueError, match="does not fit"):
            lanes_from_gguf(raw, QT.Q4_K, 32, 512, out=wrong)
    w = lanes_empty(QT.Q4_K, 32, 512)
    w = QWeight(w.fmt, w.codes, w.scale.to(torch.int8), w.bias, w.high, w.sup)     # a dtype off
    with pytest.raises(ValueError, match="scale"):
        lanes_from_gguf(raw, QT.Q4_K, 32, 512, out=w)
    assert lanes_empty(QT.Q4_K, 24, 256) is None and lanes_empty(QT.F16, 16, 256) is None   # not covered


def test_threads_do_not_change_bits(monkeypatch):
    from ternlm.linear import qconvert
    monkeypatch.setattr(qconvert, "PARALLEL_BYTES", 0)           # this small matrix converts with the threads too
    raw = torch.from_numpy(random_blocks(QT.Q5_K, 256, 1024, seed=9))
    k = load()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lanes_from_gguf(raw, QT.Q5_K, 256, 1024, kernels=k)
        torch.set_num_threads(max(2, before))
        many = lanes_from_gguf(raw, QT.Q5_K, 256, 1024, kernels=k)
    finally:
        torch.set_num_threads(before)
    assert_same(one, many)


_ISA_SCRIPT = """
import torch
from ternlm.kernels.build import load
from ternlm.linear.qconvert import NATIVE, lanes_empty, lanes_from_gguf
from ternlm.linear.qweight import to_int8
from test_qconvert import assert_same, extreme_blocks, python_path
k = load()
for qtype in NATIVE:
    raw = torch.from_numpy(extreme_blocks(qtype, 48, 512, seed=4))
    assert_same(lanes_from_gguf(raw, qtype, 48, 512, kernels=k), python_path(raw, qtype, 48, 512))
    assert_same(lanes_from_gguf(raw, qtype, 48, 512, kernels=k, int8=True), to_int8(python_path(raw, qtype, 48, 512)))
print(k.isa, "ok")
"""


@LESSER
def test_lesser_isa_builds_convert_alike(march, isa, tmp_path):
    """convert.c is plain C: an AVX2-only or baseline x86-64 build gives the same bits (lanes and int layouts)."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]
