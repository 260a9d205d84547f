"""Mixture-of-experts layers fused in C (kernels/moe_layer.py, layer.c's tq_layer_attn / tq_moe_route /
tq_moe_experts / tq_moe_sum; qlanes.c's tq_lanes_range).

Oracles: transformers on the same file (tests/test_moe.py runs its parity and bit families on these
layers too: qwen3moe and Mixtral with Q8_0 experts are fused), the whole lanes product for its block
ranges, torch's softmax / stable sort for the routing, and the kernels built for lesser ISAs.
"""
from __future__ import annotations

import ctypes
import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.native_moe import NativeMoELayer
from ternlm.models import moe
from ternlm.models.gguf import load_gguf
from ternlm.models.moe import select_experts
from ternlm.linear.qlinear import QLinear
from ternlm.engine.weights import choose_weights
from ternlm.linear.qweight import to_int8, to_lanes
from hf_to_gguf import write_gguf
from lesser_isa import LESSER, run_built_for
from test_moe import _engine, hf_logits, hf_model, ids_of
from test_qint8 import int8_kernels
from test_qweight import K_LAYOUTS, LAYOUTS, _weights, kernels

_CODES = {"q4x16": 4, "q5x16": 5, "q8x16": 6, "q6x16": 7, "i4x16": 8, "i5x16": 9, "i8x16": 10, "i6x16": 11}
_MODES = {"f32": 0, "f16": 1, "k": 2, "k6": 3, "f16s": 4}


def _ptr(t):
    return 0 if t is None else t.data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS + K_LAYOUTS, ids=lambda f: f"{f[0]}_{f[1]}")
@pytest.mark.parametrize("out", [96, 40])                          # whole blocks; 2 x 16 + a padded 8
def test_a_block_range_gives_the_whole_products_bits(layout, out):
    """tq_lanes_range: blocks [b0, b1) on one thread are the same bits as those columns of the whole
    product (GEMV and GEMM paths: M below and above LANES_GEMM_M), and nothing else is written."""
    w = to_lanes(_weights(layout, out, 512))
    lin = QLinear([w], None, kernels())
    lib, blocks = kernels().lib, -(-out // 16)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(out))
    for m in (1, 3, 13, 40):
        full = lin(x[:m])
        for b0, b1 in ((0, blocks), (0, 1), (1, blocks), (blocks - 1, blocks), (1, 2)):
            y = torch.full((m, out), float("nan"))
            rc = lib.tq_lanes_range(_CODES[w.fmt], _MODES[w.mode], x.data_ptr(), m, 512, w.codes.data_ptr(),
                                    _ptr(w.high), w.scale.data_ptr(), _ptr(w.bias), _ptr(w.sup), out, b0, b1,
                                    y.data_ptr(), out)
            assert rc == 0
            c0, c1 = 16 * b0, min(16 * b1, out)
            assert torch.equal(y[:, c0:c1], full[:, c0:c1]), (m, b0, b1)
            assert y[:, :c0].isnan().all() and y[:, c1:].isnan().all()


@pytest.mark.parametrize("layout", LAYOUTS + K_LAYOUTS, ids=lambda f: f"{f[0]}_{f[1]}")
@pytest.mark.parametrize("out", [96, 40])
def test_an_int8_block_range_gives_the_whole_products_bits(layout, out):
    """tq_int8_prepare + tq_int8_range (the MoE experts' int layouts, each expert's rows quantized once):
    blocks [b0, b1) on one thread are the same bits as those columns of the whole qint8.c product, and
    nothing else is written."""
    w = to_int8(to_lanes(_weights(layout, out, 512)))
    lin = QLinear([w], None, int8_kernels())
    lib, blocks = kernels().lib, -(-out // 16)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(out))
    q, d, s16, ds = (torch.empty(40, 512, dtype=torch.int8), torch.empty(40, 16), torch.empty(40, 32, dtype=torch.int32),
                     torch.empty(40, 16))
    lib.tq_int8_prepare(x.data_ptr(), 512, 0, 40, q.data_ptr(), d.data_ptr(), s16.data_ptr(), ds.data_ptr())
    for m in (1, 3, 13, 40):
        full = lin(x[:m])
        for b0, b1 in ((0, blocks), (0, 1), (1, blocks), (blocks - 1, blocks), (1, 2)):
            y = torch.full((m, out), float("nan"))
            rc = lib.tq_int8_range(_CODES[w.fmt], _MODES[w.mode], q.data_ptr(), d.data_ptr(), s16.data_ptr(),
                                   ds.data_ptr(), m, 512, w.codes.data_ptr(), _ptr(w.high), w.scale.data_ptr(),
                                   _ptr(w.bias), _ptr(w.sup), out, b0, b1, y.data_ptr(), out)
            assert rc == 0
            c0, c1 = 16 * b0, min(16 * b1, out)
            assert torch.equal(y[:, c0:c1], full[:, c0:c1]), (m, b0, b1)
            assert y[:, :c0].isnan().all() and y[:, c1:].isnan().all()
    assert lib.tq_int8_range(_CODES["q8x16"], 0, q.data_ptr(), d.data_ptr(), s16.data_ptr(), ds.data_ptr(), 1, 512,
                             w.codes.data_ptr(), 0, w.scale.data_ptr(), 0, 0, out, 0, 1, y.data_ptr(), out) == -2


def _route(h: torch.Tensor, router: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    M, E = h.shape[0], router.shape[0]
    idx, w = torch.empty((M, k), dtype=torch.int64), torch.empty((M, k))
    assert kernels().lib.tq_moe_route(h.data_ptr(), M, h.shape[1], router.data_ptr(), E, k, int(norm),
                                      idx.data_ptr(), w.data_ptr(), 2) == 0
    return idx, w


@pytest.mark.parametrize("norm", [True, False])
def test_routing_in_c_is_the_reference_routing(norm):
    """tq_moe_route: softmax over the router logits, the k largest, renormalised or not, listed by ascending
    expert index: the experts of torch's computation (select_experts) and its weights to fp32 rounding;
    a row's result alone is its result in a batch; identical router rows tie, and the lower index wins."""
    g = torch.Generator().manual_seed(3)
    router = torch.randn(13, 64, generator=g)                     # E = 13: not a multiple of the lanes
    router[9] = router[4]                                         # 4 and 9 always tie
    h = torch.randn(50, 64, generator=g)
    idx, w = _route(h, router, 3, norm)
    probs = torch.softmax(h.double() @ router.double().T, dim=-1)
    ref_i, ref_v = select_experts(probs, 3)
    if norm:
        ref_v = ref_v / ref_v.sum(-1, keepdim=True)
    order = torch.argsort(ref_i, dim=-1)
    assert torch.equal(idx, torch.gather(ref_i, 1, order))
    torch.testing.assert_close(w.double(), torch.gather(ref_v, 1, order), rtol=2e-6, atol=1e-7)
    assert 9 not in idx.tolist() and 4 in idx.reshape(-1).tolist()
    for r in (0, 17, 49):
        i1, w1 = _route(h[r:r + 1].clone(), router, 3, norm)
        assert torch.equal(i1, idx[r:r + 1]) and torch.equal(w1, w[r:r + 1])


@pytest.fixture(scope="module")
def q8_moe(tmp_path_factory):
    hf = hf_model("qwen3moe", seed=5)
    path = tmp_path_factory.mktemp("native-moe") / "qwen3moe-q8.gguf"
    write_gguf(hf, path, "qwen3moe", quant=QT.Q8_0)
    return hf, path


def _load(path, budget):
    loaded = load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget)
    return _engine(loaded, True)


@pytest.mark.parametrize("in_use", [1, 3])
def test_streamed_experts_in_groups_give_the_resident_bits(q8_moe, in_use, monkeypatch):
    """A streamed store's experts run EXPERTS_IN_USE at a time (moe.py's contract), a resident store's all
    at once: the same bits (each expert writes only its rows' slots), whether the cache keeps nothing or
    everything; and the fused layers agree with transformers."""
    hf, path = q8_moe
    monkeypatch.setattr(moe, "EXPERTS_IN_USE", in_use)
    ids = ids_of(60, seed=4)
    resident = _load(path, None)
    assert all(isinstance(n, NativeMoELayer) for n in resident.model.native)
    whole = resident.logits(ids)
    ref = hf_logits(hf, ids)
    assert (whole - ref).abs().max() <= 2e-5 * ref.abs().max()
    for budget in (0, 1 << 30):
        streamed = _load(path, budget)
        assert streamed.model.experts.streamed and streamed.model.native is not None
        assert torch.equal(streamed.logits(ids), whole), budget
        assert streamed.model.experts.stats.misses > 0


def test_held_experts_first_gives_the_same_bits(q8_moe, monkeypatch):
    """[HELD-FIRST] a streamed layer runs the experts its store holds before the misses (groups then mixed,
    out of index order): the same bits as ascending order; the misses are hinted to the store first."""
    _, path = q8_moe
    monkeypatch.setattr(moe, "EXPERTS_IN_USE", 3)
    ids = ids_of(60, seed=5)
    plain = _load(path, 0).logits(ids)
    engine = _load(path, 0)
    store, hints = engine.model.experts, []
    store.holds = lambda layer, e: e % 3 == 1                     # as if 1, 4, 7 were held
    real, guess, guessed = store.read_ahead, store.prefetch, []
    store.read_ahead = lambda layer, experts: (hints.append(list(experts)), real(layer, experts))
    store.prefetch = lambda layer: (guessed.append(layer), guess(layer))
    assert torch.equal(engine.logits(ids), plain)
    assert hints and all(h == sorted(h, key=lambda e: (e % 3 != 1, e)) for h in hints)
    # [PREFETCH] 60 rows x 2 of 8 experts: every layer guesses the next, reads only (the same bits above)
    assert guessed == list(range(1, engine.config.num_layers + 1))
    assert any(h[0] % 3 == 1 and h != sorted(h) for h in hints)


def test_threads_do_not_change_the_bits(q8_moe):
    """Every expert's shares are handed out to whichever thread comes free: 1, 2 or 3 threads, the same bits."""
    _, path = q8_moe
    engine = _load(path, None)
    ids = ids_of(40, seed=6)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(engine.logits(ids))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_int8_experts_are_fused_thread_invariant_and_the_model(q8_moe):
    """--activations int8 on a resident MoE: the experts' int layouts run in layer.c (each expert's rows
    quantized once); 1, 2 or 3 threads give the same bits; the model is still the model (top-1 agreement
    with transformers on >= 90% of the positions, as the dense int8 test asks)."""
    hf, path = q8_moe
    engine = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), "int8")
    assert all(isinstance(n, NativeMoELayer) for n in engine.model.native)
    ex = engine.model.experts.get(0, 0)
    assert ex.gate_up.parts[0].int8 and ex.down.parts[0].int8
    ids = ids_of(60, seed=4)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(engine.logits(ids))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    same = int((outs[0].argmax(-1) == hf_logits(hf, ids).argmax(-1)).sum())
    print(f"int8 MoE: top-1 agreement with transformers {same}/{len(ids)}")
    assert same >= 0.9 * len(ids)


@pytest.mark.parametrize("budget", [0, 1 << 30])
def test_streamed_int8_experts_give_the_resident_int8_bits(q8_moe, budget):
    """Streamed experts read straight into the int layouts (load_gguf int8: convert.c's tq_convert_int) give
    the resident int8 model's bits, whether the cache keeps nothing or everything. A store read into lanes
    layouts keeps the model at fp32 activations and says so (activations_note, the KV namespace), with the
    fp32 engine's bits; an int store under fp32 activations is refused."""
    _, path = q8_moe
    ids = ids_of(30, seed=8)
    resident = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), "int8")
    streamed = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget,
                                 int8=True), "int8")
    assert streamed.model.experts.streamed and streamed.model.experts.int8
    assert torch.equal(streamed.logits(ids), resident.logits(ids))
    assert streamed.model.experts.stats.misses > 0
    lanes_store = load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget)
    asked = Engine(lanes_store, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="int8"),
                   kv_dtype="float32")
    assert asked.model.activations == "fp32" and "lanes layouts" in asked.model.activations_note
    assert "activations=fp32" in asked.kernel_fingerprint
    fp32 = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget), True)
    assert torch.equal(asked.logits(ids), fp32.logits(ids))
    with pytest.raises(ValueError, match="int8 activations"):
        _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget, int8=True), True)


_ISA_SCRIPT = textwrap.dedent("""
    import torch
    from gguf import GGMLQuantizationType as QT
    from hf_to_gguf import write_gguf
    from ternlm.models.gguf import load_gguf
    from test_moe import _engine, hf_logits, hf_model, ids_of
    import sys, tempfile, os
    for name, arch in (("mixtral", "llama"), ("olmoe", "olmoe"), ("qwen2moe", "qwen2moe")):   # whole q/k norms; a shared expert
        path = os.path.join(tempfile.mkdtemp(), "m.gguf")
        hf = hf_model(name, seed=5)
        write_gguf(hf, path, arch, quant=QT.Q8_0)
        ref = None
        for act in (True, "int8"):                 # fp32 activations (qlanes.c), int8 (qint8.c's path here)
            e = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), act)
            assert e.model.native is not None
            ids = ids_of(50, seed=2)
            whole = e.logits(ids)
            if ref is None:
                ref = hf_logits(hf, ids)
                assert (whole - ref).abs().max() <= 2e-5 * ref.abs().max()
            e.runner.chunk_size = 7
            last = e.runner.prefill(e.slots[0], ids[:-1])
            assert torch.equal(last, whole[-2]) and torch.equal(e.runner.decode(e.slots[0], ids[-1]), whole[-1])
    print(e.model.kernels.isa, "ok")
""")


@LESSER
def test_lesser_isa_builds(march, isa, tmp_path):
    """The fused MoE layers (Mixtral; olmoe's whole-projection q/k norms; qwen2moe's shared expert) as an
    AVX2-only (or baseline x86-64) CPU builds them, with fp32 and with int8 activations: agree with
    transformers (fp32), chunked prefill and decode give one pass's bits (both)."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]
