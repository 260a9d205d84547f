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

from ternlm.linear.qlinear import QLinear
from ternlm.linear.qweight import Q8, QWeight, to_lanes
from lesser_isa import run_built_for
from test_qweight import K_LAYOUTS, LAYOUTS, _weights, kernels


@pytest.mark.parametrize("layout", LAYOUTS + K_LAYOUTS, ids=lambda f: f"{f[0]}_{f[1]}")
def test_to_lanes_keeps_every_weight(layout):
    """The same weights, codes and bytes, rows interleaved."""
    q = _weights(layout, 96, 512)
    lanes = to_lanes(q)
    assert lanes.lanes and not q.lanes and lanes.out is None
    assert (lanes.shape, lanes.mode, lanes.nbytes) == (q.shape, q.mode, q.nbytes)
    assert torch.equal(lanes.dequantize(), q.dequantize())
    rows = torch.tensor([0, 95, 17, 16, 15, 33])
    assert torch.equal(lanes.codes_of_rows(rows), q.codes_of_rows(rows))
    assert torch.equal(lanes.dequantize(rows), q.dequantize(rows))
    assert to_lanes(lanes) is lanes
    with pytest.raises(ValueError):
        lanes.permute_rows(torch.arange(96))


@pytest.mark.parametrize("layout", LAYOUTS + K_LAYOUTS, ids=lambda f: f"{f[0]}_{f[1]}")
@pytest.mark.parametrize("out", [40, 8])                             # 2 x 16 + 8; less than one block
def test_to_lanes_pads_the_last_block(layout, out):
    """An output count not a multiple of 16: the last block padded with zero weights, the real count kept;
    the kernel's product has the real columns only, equal to the float64 one, alone or in a batch."""
    q = _weights(layout, out, 512)
    lanes = to_lanes(q)
    assert lanes.lanes and lanes.out == out and lanes.shape == q.shape and lanes.codes.shape[0] == -(-out // 16)
    assert torch.equal(lanes.dequantize(), q.dequantize())
    assert torch.equal(lanes.codes_of_rows(torch.tensor([out - 1, 0])), q.codes_of_rows(torch.tensor([out - 1, 0])))
    lin = QLinear([q], None, kernels())
    assert lin.parts[0].lanes
    x = torch.randn(40, 512)
    full = lin(x)
    ref = x.double() @ q.dequantize().double().T
    assert full.shape == (40, out) and (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for m in (1, 3, 13):
        assert torch.equal(lin(x[2:2 + m]), full[2:2 + m]), m


def test_row_layout_without_lanes_has_no_kernel():
    """q8g16 with a scale mode other than Q6_K's "k6" is made by no GGML type: no kernel, said at load."""
    q = _weights((Q8, "k6"), 32, 512)
    groups16 = QWeight(Q8, q.codes, q.scale_bias()[0].float(), q.scale_bias()[1].float())
    assert groups16.mode == "f32" and to_lanes(groups16) is None
    with pytest.raises(ValueError, match="no kernel"):
        QLinear([groups16], None, kernels())


_BITS_SCRIPT = textwrap.dedent("""
    import hashlib, torch
    from ternlm.kernels.build import load
    from ternlm.linear.qlinear import QLinear
    from test_qweight import _weights, LAYOUTS, K_LAYOUTS
    k = load()
    print(k.isa)
    torch.manual_seed(0)
    x = torch.randn(40, 1536)
    for lay in LAYOUTS + K_LAYOUTS:
        lin = QLinear([_weights(lay, 576, 1536)], None, k)
        y = torch.cat([lin(x), lin(x[:1]), lin(x[1:5])])           # the GEMM and the GEMV paths
        print(lay[0] + "_" + lay[1], hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16])
""")


def test_lanes_bits_do_not_depend_on_the_vector_width(tmp_path):
    """Each output is one chain of FMAs per lane in the order of k, so the AVX2 build (8 lanes) gives the
    bits of this host's (16 lanes on AVX-512) -- what row kernels with a horizontal sum cannot (their partial sums
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
