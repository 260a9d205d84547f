"""The lanes layouts (models/qweight.py to_lanes, kernels/qlanes.c): GGML's weights with 16 rows
interleaved, multiplied with a weight row in each vector lane.

Oracles: the row layout's own dequantization (itself checked against the gguf package in
test_qweight.py), a float64 matmul, and the kernels built for another vector width on this host. The
kernels' exactness, batch invariance and the AVX2 / scalar builds run for every layout in test_qweight.py
(QLinear holds every part that has a lanes layout in it)."""
from __future__ import annotations

import textwrap

import pytest
import torch

from ternlm.models.qlinear import QLinear
from ternlm.models.qweight import LANES, Q8, QWeight, to_lanes
from lesser_isa import run_built_for
from test_qweight import K_LAYOUTS, LAYOUTS, _weights, kernels


@pytest.mark.parametrize("layout", LAYOUTS + K_LAYOUTS, ids=lambda f: f"{f[0]}_{f[1]}")
def test_to_lanes_keeps_every_weight(layout):
    """The same weights, codes and bytes, rows interleaved; rows it has no kernel for: None."""
    q = _weights(layout, 96, 512)
    lanes = to_lanes(q)
    if layout[0] == Q8 and layout[1] != "k6":       # groups of 16 with a bias: no lanes kernel
        assert lanes is None and (q.fmt, q.mode) not in LANES
        return
    assert lanes.lanes and not q.lanes
    assert (lanes.shape, lanes.mode, lanes.nbytes) == (q.shape, q.mode, q.nbytes)
    assert torch.equal(lanes.dequantize(), q.dequantize())
    rows = torch.tensor([0, 95, 17, 16, 15, 33])
    assert torch.equal(lanes.codes_of_rows(rows), q.codes_of_rows(rows))
    assert torch.equal(lanes.dequantize(rows), q.dequantize(rows))
    assert to_lanes(lanes) is lanes
    with pytest.raises(ValueError):
        lanes.permute_rows(torch.arange(96))


def test_to_lanes_needs_whole_blocks_of_rows():
    assert to_lanes(_weights(LAYOUTS[0], 40, 512)) is None          # 40 = 2 x 16 + 8
    q = _weights(LAYOUTS[0], 40, 512)
    lin = QLinear([q], None, kernels())                               # the row kernel takes it
    assert lin.parts[0] is q
    x = torch.randn(3, 512)
    ref = x.double() @ q.dequantize().double().T
    assert (lin(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


_BITS_SCRIPT = textwrap.dedent("""
    import hashlib, torch
    from ternlm.kernels.build import load
    from ternlm.models.qlinear import QLinear
    from test_qweight import _weights, LAYOUTS, K_LAYOUTS
    k = load()
    print(k.isa)
    torch.manual_seed(0)
    x = torch.randn(40, 1536)
    for lay in LAYOUTS + K_LAYOUTS:
        lin = QLinear([_weights(lay, 576, 1536)], None, k)
        if lin.parts[0].lanes:
            y = torch.cat([lin(x), lin(x[:1]), lin(x[1:5])])       # the GEMM and the GEMV paths
            print(lay[0] + "_" + lay[1], hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16])
""")


def test_lanes_bits_do_not_depend_on_the_vector_width(tmp_path):
    """Each output is one chain of FMAs per lane in the order of k, so the AVX2 build (8 lanes) gives the
    bits of this host's (16 lanes on AVX-512) -- what qmatmul.c's row kernels cannot (their partial sums
    are as wide as the vector). On an AVX2-only host both builds are AVX2 and this checks less."""
    native = run_built_for("native", _BITS_SCRIPT, tmp_path / "native")
    avx2 = run_built_for("x86-64-v3", _BITS_SCRIPT, tmp_path / "avx2")
    assert avx2[0] == "avx2" and native[0] in ("avx512", "avx2")
    assert len(native) > 20 and native[1:] == avx2[1:]


def test_tied_embedding_and_lm_head_share_one_copy(smollm2_q):
    """The model converts its QWeights once (llama.py): the tied lm_head multiplies the embedding's own
    lanes copy, and lookups read it too."""
    model = smollm2_q.model
    assert isinstance(model.embed, QWeight) and model.embed.lanes
    assert model.lm_head.parts[0] is model.embed
    ids = torch.tensor([0, 17, 49151])
    assert torch.equal(model.embed_ids(ids), model.embed.dequantize(ids).to(model.dtype))


def test_embedding_lookups_from_kept_rows_are_the_dequantized_rows(smollm2_q, monkeypatch):
    """Decode-sized lookups come from llama.py's kept rows: the same values as dequantize, repeats
    and all, through the dict's clearing when full; writing into a result never reaches the kept rows."""
    from ternlm.models import llama
    model = smollm2_q.model
    monkeypatch.setattr(llama, "EMBED_ROWS_KEPT", 5)
    monkeypatch.setattr(model, "_embed_rows", {})
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        ids = torch.randint(0, 12, (1 + step % 4,), generator=g)      # few ids: repeats, clears
        if step % 7 == 0:
            ids = torch.tensor([3, 3, 49151])
        got = model.embed_ids(ids)
        assert torch.equal(got, model.embed.dequantize(ids).to(model.dtype)), ids
        assert len(model._embed_rows) <= 5
        got.fill_(float("nan"))                                        # callers write into it
    big = torch.arange(100, 100 + llama.EMBED_LOOKUP_MAX + 1)          # a prefill chunk: not kept
    assert torch.equal(model.embed_ids(big), model.embed.dequantize(big).to(model.dtype))
    assert not any(100 <= t for t in model._embed_rows)
