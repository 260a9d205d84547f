"""--weights gguf: quantized GGUF blocks kept in memory and multiplied by the native kernel.

Oracles: the gguf package's own dequantizer (weights), a float64 matmul of those weights (kernel),
transformers' fp32 forward on the same GGUF (model), a cold prefill (reuse)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from ternlm.kernels.build import Kernels, Unavailable, load
from ternlm.models.gguf import hf_name
from ternlm.linear.qlinear import QLinear
from ternlm.linear import qweight
from ternlm.linear.qweight import QUANTIZED_TYPES, Q4, Q5, Q8, Q8W, QWeight, _CONVERT, from_gguf, to_lanes
from ternlm.engine.weights import WeightsUnavailable, choose_weights
from test_model import CHATS, LOGIT_ATOL, TEXTS, hf_greedy, hf_logits
from lesser_isa import LESSER, run_built_for

# byte offsets of each type's fp16 fields (random bytes there would give inf/nan scales)
_F16_AT = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2], QT.Q8_0: [0], QT.Q5_0: [0], QT.Q5_1: [0, 2],
           QT.Q5_K: [0, 2], QT.Q6_K: [208]}


_LAYOUT_OF = {QT.Q4_0: Q4, QT.Q4_1: Q4, QT.Q4_K: Q4, QT.Q5_0: Q5, QT.Q5_1: Q5, QT.Q5_K: Q5, QT.Q6_K: Q8,
              QT.Q8_0: Q8W}
_MODE_OF = {QT.Q4_0: "f16s", QT.Q4_1: "f16", QT.Q5_0: "f16s", QT.Q5_1: "f16", QT.Q8_0: "f16s", QT.Q4_K: "k",
            QT.Q5_K: "k", QT.Q6_K: "k6"}


def random_blocks(qtype: QT, out: int, inp: int, seed: int = 0) -> np.ndarray:
    """Valid random GGML blocks of an (out, inp) tensor, flat uint8."""
    _, block, size, _ = _CONVERT[qtype]
    rng = np.random.default_rng(seed)
    nb = out * inp // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    for off in _F16_AT[qtype]:
        raw[:, off:off + 2] = (rng.standard_normal(nb) * 0.05).astype(np.float16).view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def kernels() -> Kernels:
    k = load()
    if isinstance(k, Unavailable):
        pytest.fail(f"the native kernel is part of the product and must build here: {k.reason}")
    return k


@pytest.mark.parametrize("qtype", sorted(QUANTIZED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_layouts_equal_gguf_dequantization(qtype):
    raw = random_blocks(qtype, 8, 512)
    ref = torch.from_numpy(quants.dequantize(raw, qtype).reshape(8, 512).astype(np.float32))
    q = from_gguf(torch.from_numpy(raw), qtype, 8, 512)
    assert q.fmt == _LAYOUT_OF[qtype]
    assert q.mode == _MODE_OF[qtype]  # GGML's own fp16 d and m kept as fp16; K-quants keep their sub-scales
    assert torch.equal(q.dequantize(), ref)          # equal values (an exact zero's sign aside)
    rows = torch.tensor([5, 0, 7])
    assert torch.equal(q.dequantize(rows), ref[rows])


def _same_bits(a: QWeight, b: QWeight) -> bool:
    fields = ("codes", "scale", "bias", "high", "sup")
    return a.fmt == b.fmt and all(
        (x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in ((getattr(a, f), getattr(b, f)) for f in fields))


@pytest.mark.parametrize("qtype", sorted(QUANTIZED_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
@pytest.mark.parametrize("inf_late", [False, True], ids=["finite", "inf-in-last-chunk"])
def test_chunked_conversion_equals_the_whole_matrix(qtype, inf_late, monkeypatch):
    """from_gguf and to_lanes convert CHUNK_ROWS rows at a time into tensors allocated once: the same
    bits as the whole matrix at once, in the row and the lanes layouts. With an fp16 inf scale in the
    last chunk only, the mode is still decided on the whole matrix (f32 for every chunk)."""
    out, inp = 160, 512                                   # chunks of 48: 48, 48, 48, 16 rows
    raw = random_blocks(qtype, out, inp, seed=7)
    if inf_late and qtype not in (QT.Q4_K, QT.Q5_K, QT.Q6_K):       # (the K-quants' modes never change)
        size = _CONVERT[qtype][2]
        raw.reshape(-1, size)[-1, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    raw = torch.from_numpy(raw)
    monkeypatch.setattr(qweight, "CHUNK_ROWS", 1 << 30)   # whole: one chunk
    whole = from_gguf(raw, qtype, out, inp)
    whole_lanes = to_lanes(whole)
    if qtype == QT.Q8_0:                                  # the byte trick is q + 128
        q = raw.view(-1, 34)[:, 2:].view(torch.int8).to(torch.int16) + 128
        assert torch.equal(whole.codes, q.to(torch.uint8).reshape(out, -1))
    if inf_late and qtype not in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        assert whole.mode == "f32"
    monkeypatch.setattr(qweight, "CHUNK_ROWS", 48)
    assert _same_bits(from_gguf(raw, qtype, out, inp), whole)
    lanes = from_gguf(raw, qtype, out, inp, lanes=True)
    assert _same_bits(lanes, whole_lanes or whole)
    if whole_lanes is not None:
        assert lanes.lanes and _same_bits(to_lanes(whole), whole_lanes)


def test_model_tensors_equal_gguf_dequantization(smollm2_gguf):
    reader = GGUFReader(smollm2_gguf)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type not in QUANTIZED_TYPES or len(t.shape) != 2:
            continue
        seen.add(t.tensor_type.name)
        k, n = (int(d) for d in t.shape.tolist())
        raw = torch.from_numpy(np.array(t.data).reshape(-1).view(np.uint8))
        q = from_gguf(raw, t.tensor_type, n, k)
        rows = slice(0, 64)          # a slice of every tensor keeps this fast; the layout is per row
        ref = quants.dequantize(np.ascontiguousarray(t.data).reshape(n, -1)[rows], t.tensor_type)
        assert torch.equal(q.dequantize(rows), torch.from_numpy(ref.astype(np.float32))), t.name
    assert seen, "the default model has quantized matrices"


# smollm2 q+k+v, o, gate+up, down; qwen down; an output count not a multiple of 16 (the lanes layout pads
# its last block: qlanes.c writes only the real columns)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (256, 4864), (40, 576)]


# Every (layout, scale mode) GGML's types make (the kernels' variants: qlanes.c's tq_<lanes layout>_<mode>_mm,
# QLinear converts each to its lanes layout). The f32/f16 variants are built from Q4_1 / Q5_0 / Q8_0
# blocks by re-expressing their (exact) scales, so any input size works; the K-quant modes come from
# Q4_K / Q5_K / Q6_K blocks (inputs a multiple of 256: K_SHAPES).
LAYOUTS = [(Q4, "f16"), (Q4, "f32"), (Q5, "f16"), (Q5, "f32"), (Q8W, "f16"), (Q8W, "f32")]
K_LAYOUTS = [(Q4, "k"), (Q5, "k"), (Q8, "k6"), (Q4, "f16s"), (Q5, "f16s"), (Q8W, "f16s")]   # straight from GGML types
K_SHAPES = [(960, 512), (3072, 1536), (256, 4864), (200, 512)]
CASES = [(lay, shape) for lay in LAYOUTS for shape in SHAPES] + [(lay, shape) for lay in K_LAYOUTS for shape in K_SHAPES]
CASE_IDS = [f"{f}_{m}-{o}x{i}" for (f, m), (o, i) in CASES]


def _weights(layout: tuple[str, str], out: int, inp: int) -> QWeight:
    fmt, mode = layout
    if mode in ("k", "k6", "f16s"):
        qtype = ({Q4: QT.Q4_K, Q5: QT.Q5_K, Q8: QT.Q6_K} if mode != "f16s" else
                 {Q4: QT.Q4_0, Q5: QT.Q5_0, Q8W: QT.Q8_0})[fmt]
        q = from_gguf(torch.from_numpy(random_blocks(qtype, out, inp, seed=out + inp)), qtype, out, inp)
        assert (q.fmt, q.mode) == layout
        return q
    qtype = {Q4: QT.Q4_1, Q5: QT.Q5_1, Q8W: QT.Q8_0}[fmt]
    q = from_gguf(torch.from_numpy(random_blocks(qtype, out, inp, seed=out + inp)), qtype, out, inp)
    scale, bias = q.scale_bias()     # exact values; re-expressed below in the variant's dtype
    scale, bias = scale.float(), bias.float()
    dtype = torch.float16 if mode == "f16" else torch.float32
    return QWeight(fmt, q.codes, scale.to(dtype), bias.to(dtype), q.high)


@pytest.mark.parametrize("layout,shape", CASES, ids=CASE_IDS)
def test_kernel_equals_float64_matmul(layout, shape):
    q = _weights(layout, *shape)
    x = torch.randn(37, shape[1])
    y = QLinear([q], None, kernels())(x)
    ref = (x.double() @ q.dequantize().double().T)
    tol = 1e-5 * ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("layout,shape", CASES, ids=CASE_IDS)
def test_kernel_rows_are_batch_invariant(layout, shape):
    """[BATCH-INVARIANT] a row's bits do not depend on the rows beside it (M = 1..512) nor on threads."""
    lin = QLinear([_weights(layout, *shape)], None, kernels())
    x = torch.randn(512, shape[1])
    full = lin(x)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 63, 300):   # across the GEMV and GEMM paths and their tiles
        for start in (0, 5):
            assert torch.equal(lin(x[start:start + m]), full[start:start + m]), (m, start)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):       # 3: chunks of the blocks handed out unevenly, whichever thread is free
            torch.set_num_threads(n)
            assert torch.equal(lin(x[:40]), full[:40]) and torch.equal(lin(x[:1]), full[:1]), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q5_0, QT.Q8_0], ids=lambda t: t.name)
def test_kernel_f16s_with_another_constant(qtype):
    """GGML's own offset (-8, -16, -128 d) takes qlanes.c's integer codes (LM_F16I); any other constant
    the general mode (LM_F16S). Both: equal to the float64 product and batch-invariant."""
    q = from_gguf(torch.from_numpy(random_blocks(qtype, 96, 512, seed=3)), qtype, 96, 512)
    x = torch.randn(11, 512)
    for c in (q.bias.item(), -5.0, 3.0):
        w = QWeight(q.fmt, q.codes, q.scale, torch.tensor([c]), q.high)
        assert w.mode == "f16s"
        lin = QLinear([w], None, kernels())
        full = lin(x)
        ref = x.double() @ w.dequantize().double().T
        assert (full.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), c
        for m in (1, 3, 9):
            assert torch.equal(lin(x[2:2 + m]), full[2:2 + m]), (c, m)


@pytest.mark.parametrize("M", [5, 40])             # the GEMV and the GEMM path
def test_mixed_layouts_in_one_projection(M):
    """A fused q/k/v whose parts use different layouts (Q4_K_M keeps some v in Q6_K) = its parts side by
    side; output counts not multiples of 16 (padded lanes blocks) write only their own columns."""
    parts = [_weights((Q4, "k"), 40, 512), _weights((Q8, "k6"), 24, 512), _weights((Q4, "f16"), 8, 512)]
    bias = torch.randn(72)
    x = torch.randn(M, 512)
    k = kernels()
    y = QLinear(parts, bias, k)(x)
    off = 0
    for p in parts:
        n = p.shape[0]
        assert torch.equal(y[:, off:off + n], QLinear([p], None, k)(x) + bias[off:off + n])
        off += n


_ISA_SCRIPT = textwrap.dedent("""
    import torch
    from ternlm.kernels.build import load
    from ternlm.linear.qlinear import QLinear
    from test_qweight import _weights, LAYOUTS, K_LAYOUTS
    k = load()
    print(k.isa)
    for fmt in LAYOUTS + K_LAYOUTS:
        for out in (576, 40):        # 40: a padded last block of 16 rows
            lin = QLinear([_weights(fmt, out, 1536)], None, k)
            x = torch.randn(40, 1536)
            full = lin(x)
            ref = x.double() @ lin.parts[0].dequantize().double().T
            assert (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
            for m in (1, 2, 3, 9):
                assert torch.equal(lin(x[3:3 + m]), full[3:3 + m]), (fmt, out, m)
    print("ok")
""")


@LESSER
def test_lesser_isa_paths(march, isa, tmp_path):
    """The AVX2 and scalar paths, built on this host by capping -march: exact and batch-invariant too
    (an AVX2-only CPU runs the first; this is how it is tested where the host has more)."""
    assert run_built_for(march, _ISA_SCRIPT, tmp_path) == [isa, "ok"]


# The opt-in AMX path (kernels/qamx.c, TERNLM_AMX=1): a process-wide choice made when the kernels
# load, so it runs in a child. Every layout and scale mode against float64, batch invariance across
# the narrow (M <= 4) and wide (M >= 5) paths, a partial last tile of weight rows (200 = 3 x 64 + 8),
# threads; then the engine: decoded KV equals one prefill's, bit for bit.
_AMX_SCRIPT = textwrap.dedent("""
    import torch
    from ternlm.kernels.build import load
    k = load()
    print(k.isa)
    if k.isa == "amx":
        from ternlm.linear.qlinear import QLinear
        from test_qweight import _weights, LAYOUTS, K_LAYOUTS
        cases = [(f, s) for f in LAYOUTS for s in ((200, 576), (576, 1536))]
        cases += [(f, s) for f in K_LAYOUTS for s in ((200, 512), (256, 4864))]
        for fmt, (out, inp) in cases:
            lin = QLinear([_weights(fmt, out, inp)], None, k)
            x = torch.randn(300, inp)
            full = lin(x)
            ref = x.double() @ lin.parts[0].dequantize().double().T
            assert (full.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), fmt
            for m in (1, 2, 3, 4, 5, 16, 17, 37):
                assert torch.equal(lin(x[5:5 + m]), full[5:5 + m]), (fmt, out, inp, m)
            torch.set_num_threads(1)
            assert torch.equal(lin(x[:20]), full[:20]), (fmt, "1 thread")
            torch.set_num_threads(2)
        from ternlm import Engine
        from ternlm.kv.slots import Slot
        e = Engine.load("smollm2-135m", weights="gguf", activations="fp32")   # AMX bf16 tiles: fp32 activations
        assert "weights=gguf:amx:" in e.kernel_fingerprint
        ids = e.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}])
        got = e.generate(ids, max_tokens=24, ignore_eos=True)
        slot = e.slots[got.slot]
        fresh = Slot(99, slot.shape, initial_capacity=len(slot.record.fed))
        e.runner.prefill(fresh, slot.record.fed)
        n = len(slot.record.fed)
        assert torch.equal(slot.k[:, :, :n], fresh.k[:, :, :n]) and torch.equal(slot.v[:, :, :n], fresh.v[:, :, :n])
    print("ok")
""")


def test_amx_path_is_exact_and_batch_invariant():
    env = dict(os.environ, TERNLM_AMX="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _AMX_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    isa, ok = r.stdout.split()
    assert ok == "ok"
    if isa != "amx":
        pytest.skip(f"no AMX tiles here (the kernels run {isa}): the path is compiled for AMX hosts only")


def test_weights_choice():
    class Failed:
        reason = "no C compiler (cc) on PATH"
    with pytest.raises(ValueError, match="unknown --weights"):
        choose_weights("int3", "auto", True)
    with pytest.raises(ValueError, match="computes in float32"):
        choose_weights("gguf", "bfloat16", True)
    with pytest.raises(ValueError, match="computes in bfloat16"):
        choose_weights("bf16", "float32", True)
    with pytest.raises(WeightsUnavailable, match="needs a .gguf model"):
        choose_weights("gguf", "auto", False)
    with pytest.raises(WeightsUnavailable, match="no C compiler"):
        choose_weights("gguf", "auto", True, build=lambda: Unavailable(Failed.reason))
    assert choose_weights("fp32", "auto", True).dtype == "float32"
    assert choose_weights("auto", "bfloat16", True).mode == "dense"
    # auto: the file's own precision where the kernel runs and no compute dtype was asked for
    built = choose_weights("auto", "auto", True)
    assert (built.mode, built.dtype, built.requested) == ("gguf", "float32", "auto")
    assert "weights=gguf:" in built.fingerprint
    # --activations: int8 is auto's choice for quantized blocks, fp32 on request; int8 needs gguf weights
    assert built.activations == "int8" and "int8 activations" in built.reason
    assert choose_weights("auto", "auto", True, activations="fp32").activations == "fp32"
    assert choose_weights("fp32", "auto", True).activations == "fp32"
    # [SMALL-FP32]: auto multiplies fp32 activations below 200M parameters, int8 from there; explicit choices stand
    assert choose_weights("auto", "auto", True, params=134_515_008).activations == "fp32"
    assert "135M parameters, under 200M" in choose_weights("auto", "auto", True, params=134_515_008).reason
    assert choose_weights("auto", "auto", True, params=200_000_000).activations == "int8"
    assert choose_weights("gguf", "auto", True, activations="int8", params=10**6).activations == "int8"
    with pytest.raises(ValueError, match="--activations int8 needs quantized weights"):
        choose_weights("bf16", "auto", True, activations="int8")
    with pytest.raises(ValueError, match="unknown --activations"):
        choose_weights("auto", "auto", True, activations="int4")
    for dtype, is_gguf, build, why in (("float32", True, None, "--dtype float32 asked for"),
                                       ("auto", False, None, "not a GGUF model"),
                                       ("auto", True, lambda: Unavailable(Failed.reason), "no C compiler")):
        dense = choose_weights("auto", dtype, is_gguf, build=build)
        assert (dense.mode, dense.dtype) == ("dense", dtype) and why in dense.reason


def test_engine_holds_quantized_weights(smollm2_q, smollm2_qf, smollm2_f32, smollm2_gguf):
    m = smollm2_q.model
    assert isinstance(m.layers[0].qkv, QLinear) and isinstance(m.lm_head, QLinear)
    # --activations is in the cache namespace: int8-product KV never meets fp32-product KV
    assert (smollm2_q.model.activations, smollm2_qf.model.activations) == ("int8", "fp32")
    assert smollm2_q.namespace() != smollm2_qf.namespace()
    assert all(p.int8 for p in m.layers[0].qkv.parts) and not any(p.int8 for p in smollm2_qf.model.layers[0].qkv.parts)
    assert isinstance(m.embed, QWeight)
    assert smollm2_q.dtype == torch.float32
    # the choice is in the cache namespace: gguf KV never mixes with dense KV
    assert "weights=gguf:" in smollm2_q.kernel_fingerprint
    assert smollm2_q.namespace() != smollm2_f32.namespace()
    held = m.embed.nbytes + sum(lin.nbytes for layer in m.layers
                                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    size = smollm2_gguf.stat().st_size
    print(f"quantized matrices hold {held / 2**20:.1f} MiB; the GGUF file is {size / 2**20:.1f} MiB")
    assert held <= 1.3 * size     # fp32 scale+bias per group: 0.75 bytes a weight against Q4_1's 0.625


# With the fp16 KV cache (the default for --weights gguf) every K/V element keeps 11 significant bits:
# logits move by a few 1e-2 against transformers' fp32 cache (measured max printed by the test; 3.3e-2
# on TEXTS[0]), where the fp32 cache stays within LOGIT_ATOL. llama.cpp's default cache is f16 too.
F16_KV_ATOL = 0.08
ENGINES = {"float32": "smollm2_q32", "float16": "smollm2_qf"}   # fp32 activations: the parity path


@pytest.mark.parametrize("kv", list(ENGINES))
@pytest.mark.parametrize("text", TEXTS[:2])
def test_logits_match_transformers(request, hf_smollm2, text, kv):
    e = request.getfixturevalue(ENGINES[kv])
    assert e.kv_dtype == kv
    ids = e.tokenizer.encode(text)
    ours, ref = e.logits(ids), hf_logits(hf_smollm2, ids)
    diff = (ours - ref).abs().max().item()
    print(f"max |logit diff| --weights gguf --kv-dtype {kv} vs transformers fp32 over {len(ids)} positions: {diff:.2e}")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert diff <= (LOGIT_ATOL if kv == "float32" else F16_KV_ATOL)


@pytest.mark.parametrize("kv", list(ENGINES))
@pytest.mark.parametrize("question", CHATS[:2])
def test_greedy_matches_transformers(request, hf_smollm2, question, kv):
    e = request.getfixturevalue(ENGINES[kv])
    ids = list(e.apply_chat_template([{"role": "user", "content": question}]))
    ours = e.generate(ids, max_tokens=32, temperature=0.0, ignore_eos=True)
    assert ours.token_ids == hf_greedy(hf_smollm2, ids, 32)


def test_decoded_kv_is_bit_identical_to_prefilled_kv(smollm2_q):
    """Reuse never changes an answer with quantized weights either: KV written one decode step at a
    time equals a single prefill's, bit for bit, and so do the next logits."""
    from ternlm.kv.slots import Slot
    e = smollm2_q
    ids = e.apply_chat_template([{"role": "user", "content": CHATS[2]}])
    out = e.generate(ids, max_tokens=40, ignore_eos=True)
    slot = e.slots[out.slot]
    fed = slot.record.fed
    fresh = Slot(99, slot.shape, initial_capacity=len(fed))
    logits = e.runner.prefill(fresh, fed)
    n = len(fed)
    assert torch.equal(slot.k[:, :, :n], fresh.k[:, :, :n])
    assert torch.equal(slot.v[:, :, :n], fresh.v[:, :, :n])
    assert torch.equal(e.runner.decode(slot, out.token_ids[-1]), e.runner.decode(fresh, out.token_ids[-1]))


def test_turn2_reuse_gives_the_cold_answer(smollm2_q):
    e = smollm2_q
    msgs = [{"role": "user", "content": CHATS[3]}]
    a1 = e.generate(e.apply_chat_template(msgs), max_tokens=24)
    msgs += [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "And two more?"}]
    ids = e.apply_chat_template(msgs)
    warm = e.generate(ids, max_tokens=24)
    e.prefix_reuse = False
    try:
        cold = e.generate(ids, max_tokens=24)
    finally:
        e.prefix_reuse = True
    assert warm.cached_tokens > 0 and cold.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_fp16_cache_round_trips_through_ram_and_disk_tiers(smollm2_q, tmp_path):
    """Blocks of the fp16 cache (the --weights gguf default) go to the RAM and disk tiers and come back
    bit for bit: a restored turn answers with the cold prefill's logits, also after a restart."""
    import random

    from ternlm import Engine
    from ternlm.kv.store import CacheConfig

    def warm() -> Engine:
        return Engine.load("smollm2-135m", weights="gguf", activations="int8", slots=1, min_reuse=1,
                           cache=CacheConfig(1 << 30, tmp_path, 1 << 30))

    def cold(ids):
        smollm2_q.prefix_reuse = False
        try:
            return smollm2_q.generate(ids, max_tokens=4, keep_logits=True, ignore_eos=True)
        finally:
            smollm2_q.prefix_reuse = True

    r = random.Random(5)
    a, b = [r.randrange(1000, 40000) for _ in range(300)], [r.randrange(1000, 40000) for _ in range(200)]
    e = warm()
    assert e.kv_dtype == "float16" and "kv=float16" in e.kernel_fingerprint
    e.generate(a, max_tokens=4, ignore_eos=True)
    e.generate(b, max_tokens=4, ignore_eos=True)            # b takes the only slot: a's blocks stay in RAM
    a += [r.randrange(1000, 40000) for _ in range(20)]
    out, ref = e.generate(a, max_tokens=4, keep_logits=True, ignore_eos=True), cold(a)
    assert out.restored.tier == "ram" and out.cached_tokens >= 256
    assert out.token_ids == ref.token_ids and torch.equal(out.logits, ref.logits)
    assert e.store.flush(30)
    e.persist_cache()
    a += [r.randrange(1000, 40000) for _ in range(20)]
    again = warm()
    out, ref = again.generate(a, max_tokens=4, keep_logits=True, ignore_eos=True), cold(a)
    assert out.restored.tier == "disk" and out.cached_tokens >= 256
    assert out.token_ids == ref.token_ids and torch.equal(out.logits, ref.logits)


def test_server_with_gguf_weights_reuses_and_answers_like_a_cold_one():
    """`ternlm serve --weights gguf` through the official client: turn 2 reuses turn 1's KV and the
    greedy answers equal a server with prefix reuse off (same weights)."""
    from openai import OpenAI

    from server_proc import ServerProc
    common = ("-m", "smollm2-135m", "--weights", "gguf", "--threads", "1", "--slots", "1")
    with ServerProc(*common) as warm, ServerProc(*common, "--no-prefix-kv") as cold:
        msgs = [{"role": "user", "content": "Name three rivers in Europe."}]
        for follow_up in ("Which is the longest?", None):
            answers, usage = [], None
            for s in (warm, cold):
                r = OpenAI(base_url=s.v1, api_key="x").chat.completions.create(
                    model="smollm2-135m", messages=msgs, max_tokens=24, temperature=0)
                answers.append(r.choices[0].message.content)
                usage = usage or r.usage
            assert answers[0] == answers[1]
            if follow_up is None:
                assert usage.prompt_tokens_details.cached_tokens > 0
                break
            msgs += [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": follow_up}]
