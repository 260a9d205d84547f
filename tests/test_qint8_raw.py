"""[RAW] qint8.c's tq_int8_raw_range: a streamed expert's K-quant matrix multiplied straight from its GGML blocks
(each block of 16 rows converted in the call's scratch by convert.c's tq_convert_int_block, then multiplied) must
give the bits of the int-layout product on the whole converted matrix (tq_int8_range on lanes_from_gguf(int8=True)).

Oracle: the converted path, itself checked against qweight.to_int8(to_lanes(from_gguf(...))) (tests/test_qconvert.py)
and against the dequantized weights (tests/test_qint8.py). Blocks are random bytes with well-formed fp16 scales and
with extreme ones (inf and NaN too: a K-quant keeps them as bytes, and the products must match bit for bit, NaN
included). The same on the AVX2 and baseline x86-64 builds.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.linear.qconvert import lanes_from_gguf
from test_qconvert import _bits, extreme_blocks
from test_qweight import kernels, random_blocks
from lesser_isa import LESSER, run_built_for

RAW_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
_INT_CODE = {"i4x16": 8, "i5x16": 9, "i8x16": 10, "i6x16": 11}
_MODE_CODE = {"k": 2, "k6": 3}


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _prepared(x: torch.Tensor):
    """tq_int8_prepare of x (M, K): q, d, s16, ds."""
    M, K = x.shape
    q, d, s16, ds = (torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // 32),
                     torch.empty(M, K // 16, dtype=torch.int32), torch.empty(M, K // 32))
    kernels().lib.tq_int8_prepare(x.data_ptr(), K, 0, M, q.data_ptr(), d.data_ptr(), s16.data_ptr(), ds.data_ptr())
    return q, d, s16, ds


def _converted(raw: torch.Tensor, qtype: QT, n: int, k: int, act, m: int) -> torch.Tensor:
    """The int-layout product of the whole converted matrix (tq_int8_range over every block): (m, n)."""
    w = lanes_from_gguf(raw, qtype, n, k, int8=True)
    q, d, s16, ds = act
    y = torch.empty(m, n)
    assert kernels().lib.tq_int8_range(_INT_CODE[w.fmt], _MODE_CODE[w.mode], q.data_ptr(), d.data_ptr(),
                                       s16.data_ptr(), ds.data_ptr(), m, k, w.codes.data_ptr(), _ptr(w.high),
                                       w.scale.data_ptr(), _ptr(w.bias), _ptr(w.sup), n, 0, n // 16, y.data_ptr(), n) == 0
    return y


def _raw(raw: torch.Tensor, qtype: QT, n: int, k: int, act, m: int, b0: int, b1: int) -> tuple[int, torch.Tensor]:
    q, d, s16, ds = act
    y = torch.full((m, n), float("nan"))
    rc = kernels().lib.tq_int8_raw_range(int(qtype), q.data_ptr(), d.data_ptr(), s16.data_ptr(), ds.data_ptr(), m, k,
                                         raw.data_ptr(), n, b0, b1, y.data_ptr(), n)
    return rc, y


@pytest.mark.parametrize("qtype", RAW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(48, 512), (32, 768)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("extreme", [False, True], ids=["plain", "extreme-fp16"])
def test_raw_blocks_give_the_converted_products_bits(qtype, shape, extreme):
    n, k = shape
    raw = torch.from_numpy(extreme_blocks(qtype, n, k, seed=n + k, special=True) if extreme
                           else random_blocks(qtype, n, k, seed=n + k))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)) * 3
    act = _prepared(x)
    blocks = n // 16
    for m in (1, 3, 8, 13, 40):
        want = _converted(raw, qtype, n, k, act, m)
        if not extreme:
            assert want.isfinite().all()                # the oracle means something: no NaN compared with itself
        for b0, b1 in ((0, blocks), (0, 1), (1, blocks), (blocks - 1, blocks)):
            rc, y = _raw(raw, qtype, n, k, act, m, b0, b1)
            assert rc == 0
            c0, c1 = 16 * b0, 16 * b1
            assert torch.equal(_bits(y[:, c0:c1]), _bits(want[:, c0:c1])), (m, b0, b1)
            assert y[:, :c0].isnan().all() and y[:, c1:].isnan().all(), "only its blocks' columns are written"


def test_raw_range_refuses_what_it_does_not_take():
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 32, 512, seed=1))
    act = _prepared(torch.randn(2, 512))
    assert _raw(raw, QT.Q8_0, 32, 512, act, 2, 0, 2)[0] == -2                     # not a K-quant
    assert _raw(raw, QT.Q4_K, 32, 512, act, 2, 0, 3)[0] == -2                     # past the last block
    assert _raw(raw, QT.Q4_K, 24, 512, act, 2, 0, 1)[0] == -2                     # rows % 16
    rc, y = _raw(raw, QT.Q4_K, 32, 512, act, 2, 1, 1)                             # an empty range: nothing written
    assert rc == 0 and y.isnan().all()


@pytest.mark.parametrize("qtype", RAW_TYPES, ids=lambda t: t.name)
def test_one_block_converts_as_in_the_whole_matrix(qtype):
    """tq_convert_int_block on rows 16b..16b+15 writes block b of tq_convert_int's fields, every byte."""
    n, k = 48, 512
    raw = torch.from_numpy(extreme_blocks(qtype, n, k, seed=4, special=True))
    whole = lanes_from_gguf(raw, qtype, n, k, int8=True)
    row_bytes = raw.numel() // n
    work = torch.empty(16 * k, dtype=torch.uint8)
    for b in range(n // 16):
        one = lanes_from_gguf(raw[16 * b * row_bytes:16 * (b + 1) * row_bytes].clone(), qtype, 16, k, int8=True)
        for f in ("codes", "high", "scale", "bias", "sup"):
            t = getattr(one, f)
            if t is not None:
                t.fill_(0x55 if t.dtype == torch.uint8 else 0)
        assert kernels().lib.tq_convert_int_block(int(qtype), raw.data_ptr() + 16 * b * row_bytes, k,
                                                  one.codes.data_ptr(), _ptr(one.high), one.scale.data_ptr(),
                                                  _ptr(one.bias), _ptr(one.sup), work.data_ptr()) == 0
        for f in ("codes", "high", "scale", "bias", "sup"):
            a, w = getattr(one, f), getattr(whole, f)
            if a is not None:
                assert torch.equal(_bits(a[0]), _bits(w[b])), (b, f)


_ISA_SCRIPT = textwrap.dedent("""
    import torch
    from gguf import GGMLQuantizationType as QT
    from test_qint8_raw import RAW_TYPES, _converted, _prepared, _raw
    from test_qconvert import _bits, extreme_blocks
    from test_qweight import kernels
    for qtype in RAW_TYPES:
        n, k = 32, 512
        raw = torch.from_numpy(extreme_blocks(qtype, n, k, seed=9, special=True))
        act = _prepared(torch.randn(13, k, generator=torch.Generator().manual_seed(1)))
        for m in (1, 13):
            rc, y = _raw(raw, qtype, n, k, act, m, 0, 2)
            assert rc == 0 and torch.equal(_bits(y), _bits(_converted(raw, qtype, n, k, act, m))), (qtype, m)
    print(kernels().isa, "ok")
""")


@LESSER
def test_lesser_isa_builds_multiply_raw_blocks_alike(march, isa, tmp_path):
    """An AVX2-only or baseline x86-64 build ([GATHER] there: 8-lane gathers, or none and the row-major work
    buffer) gives the converted product's bits too."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]
