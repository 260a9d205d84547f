"""Hybrid mixture of experts (issue 47): Qwen3.5-MoE (qwen35moe), qwen35's gated DeltaNet and gated attention
layers with a router over experts plus a sigmoid-gated shared expert on every layer.

Oracles: transformers' Qwen3_5MoeForCausalLM (its pure-torch chunked scan and conv, its own routing) on a tiny
random model, run again in float64 for the parity bound; the same model written as llama.cpp's converter writes
it (tests/hybrid_to_gguf.py, checked against that converter's output tensor by tensor by tests/converter_check.py:
f32, Q8_0; Q4_K as random valid blocks, which the converter does not write); our own cold run (a fresh slot, one
pass) for every reuse, bit for bit.

The parity bound [FP64-BOUND]: our logits' distance from the float64 run at most 4x transformers' own fp32
distance from it (test_hybrid.py's rule: both sum the same products in other orders, transformers' chunked scan
and ours one token at a time; a fixed fraction of the logits' scale would have to be widened per model and type).
"""
from __future__ import annotations

import copy

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine import Engine
from ternlm.kv.record import lcp
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.models.moe import ExpertStore, StreamedExperts
from ternlm.weights import choose_weights
from hybrid_to_gguf import write_qwen35_gguf
from test_batching import alone, together
from test_loaders import _save_tokenizer
from test_moe import ids_of

# deltanet, attention, deltanet, deltanet: a recurrent layer after an attention one; fewer key heads than value
# heads (the converter's tiled V order); 6 experts, 2 a token, and a shared expert
KINDS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False, layer_types=KINDS,
            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Q4_K needs 256-wide inputs: the same model, wider (every matrix's input 256)
WIDE = dict(hidden_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
            moe_intermediate_size=256, shared_expert_intermediate_size=256)
PARITY = 4          # [FP64-BOUND]


def hf_qwen35moe(seed: int = 0, **kw):
    import transformers as tf
    cfg = tf.Qwen3_5MoeTextConfig(**{**TINY, **kw})
    torch.manual_seed(seed)
    model = tf.Qwen3_5MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") and "linear_attn" not in n:   # x * (1 + w): the +1 at load matters
                p.normal_(0, 0.3)
            elif n.endswith("linear_attn.norm.weight"):
                p.normal_(1, 0.3)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.3)     # decisive routing and a gate away from 1/2: a wrong expert or gate shows
    return model


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
    hf = hf_qwen35moe(seed=3)
    folder = tmp_path_factory.mktemp("qwen35moe")
    hf.save_pretrained(folder)
    _save_tokenizer(folder)
    return hf, folder


def _engine(folder, dtype: str = "float32", **kw) -> Engine:
    return Engine(load_hf_folder(folder, torch.float32), dtype=dtype, min_reuse=1, **kw)


def _parity(hf, ours: torch.Tensor, ids: list[int], label: str) -> None:
    """[FP64-BOUND] and the same argmax at every position as transformers' fp32 run."""
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        hf64 = copy.deepcopy(hf).double()
        hf64.set_experts_implementation("eager")     # its loop over experts: grouped_mm takes no float64
        ref64 = hf64(torch.tensor([ids])).logits[0]
    ours_err, hf_err = (ours.double() - ref64).abs().max(), (ref.double() - ref64).abs().max()
    print(f"{label}: ours {ours_err:.3g}, transformers fp32 {hf_err:.3g} from float64 (scale {ref.abs().max():.3g})")
    assert 0 < hf_err and ours_err <= PARITY * hf_err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_config_and_layers_from_the_folder(qwen35moe):
    _, folder = qwen35moe
    cfg = load_hf_folder(folder, torch.float32).config
    assert cfg.arch == "qwen35moe" and cfg.layer_kinds == ("deltanet", "attention", "deltanet", "deltanet")
    assert cfg.recurrent_layers == (0, 2, 3) and cfg.attn_output_gate and cfg.rope_spec.rotary_dim == 4
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (6, 2, 32)
    assert cfg.shared_expert_intermediate_size == 64 and cfg.norm_topk_prob       # its router always renormalises
    assert cfg.intermediate_size == 32 and not cfg.linear_v_tiled                  # no dense width: the experts'


def test_logits_and_greedy_text_match_transformers(qwen35moe):
    """The HF folder: logits within [FP64-BOUND], argmax equal everywhere; greedy decoding gives the same tokens."""
    hf, folder = qwen35moe
    engine = _engine(folder)
    ids = ids_of(150, seed=2)
    _parity(hf, engine.logits(ids), ids, "hf folder")
    out = engine.generate(ids[:40], max_tokens=24, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:40]]), max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 40:]
    assert out.token_ids == want.tolist()


@pytest.mark.parametrize("dtype", ["float32", "auto"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(qwen35moe, dtype):
    """[RESUME-EXACT] with experts: a prompt in chunks of 7 (experts seeing 1..7 rows), then decoded token by
    token (the lone-row expert path), gives the bits of one pass over all of it."""
    _, folder = qwen35moe
    engine = _engine(folder, dtype)
    ids = ids_of(90, seed=5)
    whole = engine.logits(ids)
    engine.runner.chunk_size = 7
    slot = engine.slots[0]
    assert torch.equal(engine.runner.prefill(slot, ids[:-10]), whole[-11])
    for i, t in enumerate(ids[-10:]):
        assert torch.equal(engine.runner.decode(slot, t), whole[len(ids) - 10 + i]), i
    assert slot.state.pos == len(slot.record) == len(ids)


# around the 32-grid's snapshots (31, 32, 33, 64, 65), a prefill's end (200), and spread between
DIVERGENCES = sorted({0, 1, 2, 5, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 150, 199, 200})


def test_reuse_at_divergence_points_gives_the_cold_bits(qwen35moe):
    """A 200-token conversation, then a prompt that leaves it at d (and one that extends it): the reused run
    (resumed at the latest snapshot <= d, kept KV, the rest prefilled) gives the cold run's logits bit for bit,
    the first token's and the decoded ones'; it reuses exactly that snapshot."""
    _, folder = qwen35moe
    warm, cold = _engine(folder, state_interval=32), _engine(folder, prefix_reuse=False)
    base, other = ids_of(200, seed=7), ids_of(200, seed=8)
    for d in DIVERGENCES:
        warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)      # the slot holds base (+ snapshots)
        snaps = set(warm.slots[0].state.snaps) | {warm.slots[0].state.pos}
        prompt = base[:d] + other[d:] if d < 200 else base + other[:20]
        k = min(lcp(warm.slots[0].record.fed, prompt), len(prompt) - 1)      # what attention alone would keep
        expect = max([s for s in snaps if s <= k], default=0)
        got = warm.generate(prompt, max_tokens=3, ignore_eos=True, keep_logits=True, slot=0)
        assert got.cached_tokens == (expect if expect >= 1 else 0), d
        ref = cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]
        assert torch.equal(got.logits, ref), d


def test_batched_equals_alone(qwen35moe):
    """Four requests joining a batch at different steps (prefill chunks beside decodes: experts over rows of
    several sequences, each slot its own recurrent state) give each one's tokens and logits alone, bit for bit."""
    _, folder = qwen35moe
    engine = _engine(folder, slots=5, chunk_size=16)
    reqs = [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)]
    solo = [alone(engine, p, m)[0] for p, m in reqs]
    batched = together(engine, reqs, [0, 0, 2, 3], budget=40)
    for i, (b, a) in enumerate(zip(batched, solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i


def test_threads_do_not_change_the_bits(qwen35moe):
    _, folder = qwen35moe
    engine = _engine(folder)
    ids = ids_of(70, seed=9)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(engine.logits(ids))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _gguf(tmp_path, quant, act: str | None, seed: int = 3, budget: int | None = None):
    """(transformers model holding the file's numbers, our engine on the file, its path) for quant None (f32) /
    Q8_0 / Q4_K and activations fp32 | int8 (the GGUF's blocks kept: --weights gguf); budget: streamed experts."""
    hf = hf_qwen35moe(seed=seed, **(WIDE if quant == QT.Q4_K else {}))
    path = tmp_path / f"qwen35moe-{getattr(quant, 'name', 'f32')}.gguf"
    write_qwen35_gguf(hf, path, quant)
    return hf, _gguf_engine(path, quant is not None, act, budget), path


def _gguf_engine(path, keep: bool, act: str | None, budget: int | None = None, **kw) -> Engine:
    loaded = load_gguf(path, torch.float32, keep_quantized=keep, lanes=keep, expert_budget=budget,
                       int8=act == "int8")            # streamed experts read into the int layouts int8 multiplies
    cfg = loaded.config
    assert cfg.arch == "qwen35moe" and cfg.linear_v_tiled and cfg.num_experts == 6 and cfg.norm_topk_prob
    assert cfg.layer_kinds == ("deltanet", "attention", "deltanet", "deltanet")
    weights = choose_weights("gguf", "auto", True, activations=act) if keep else None
    engine = Engine(loaded, dtype="float32", weights=weights, kv_dtype="float32", min_reuse=1, **kw)
    assert engine.model.activations == (act or "fp32")
    return engine


@pytest.mark.parametrize("quant", [None, QT.Q8_0, QT.Q4_K], ids=["f32", "q8_0", "q4_k"])
def test_gguf_matches_transformers(quant, tmp_path):
    """A converter-laid GGUF through our loader and kernels (fp32 activations) against transformers on the file's
    numbers: [FP64-BOUND], argmax equal everywhere."""
    hf, engine, _ = _gguf(tmp_path, quant, "fp32" if quant is not None else None)
    ids = ids_of(120, seed=2)
    _parity(hf, engine.logits(ids), ids, getattr(quant, "name", "f32"))


@pytest.mark.parametrize("quant", [QT.Q8_0, QT.Q4_K], ids=["q8_0", "q4_k"])
def test_gguf_int8_is_exact_on_every_path(quant, tmp_path):
    """int8 activations (the default for quantized files): still the model (top-1 agreement with transformers
    >= 90%), and chunks + decode == one pass, reuse at divergence points == the cold run, batched == alone,
    bit for bit."""
    hf, engine, path = _gguf(tmp_path, quant, "int8")
    ids = ids_of(100, seed=4)
    whole = engine.logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert int((whole.argmax(-1) == ref.argmax(-1)).sum()) >= 90
    engine.runner.chunk_size = 9
    slot = engine.slots[0]
    assert torch.equal(engine.runner.prefill(slot, ids[:-5]), whole[-6])
    for i, t in enumerate(ids[-5:]):
        assert torch.equal(engine.runner.decode(slot, t), whole[len(ids) - 5 + i])
    base, other = ids_of(130, seed=5), ids_of(130, seed=6)
    for d in range(0, 131, 13):
        engine.generate(base, max_tokens=1, ignore_eos=True, slot=0)
        prompt = base[:d] + other[d:]
        got = engine.generate(prompt, max_tokens=2, ignore_eos=True, keep_logits=True, slot=0)
        cold = engine.runner.full_logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]
        assert torch.equal(got.logits, cold), d
    engine2 = _gguf_engine(path, True, "int8", slots=4, chunk_size=16)
    reqs = [(ids_of(n, seed=n), 4) for n in (30, 70, 11)]
    solo = [alone(engine2, p, m)[0] for p, m in reqs]
    for i, (b, a) in enumerate(zip(together(engine2, reqs, [0, 1, 2], budget=32), solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i


def test_streamed_experts_give_the_resident_bits(tmp_path):
    """--expert-cache on a hybrid file: experts read from the file into a cache of two of them (24 in the
    file) give the resident run's logits bit for bit, one pass and chunks + decode."""
    _, resident, path = _gguf(tmp_path, QT.Q8_0, "int8")
    assert isinstance(resident.model.experts, ExpertStore)
    one = resident.model.experts.get(0, 0).nbytes
    streamed = _gguf_engine(path, True, "int8", budget=2 * one + one // 2)
    store = streamed.model.experts
    assert isinstance(store, StreamedExperts) and len(store) == 0, "nothing converted at load"
    ids = ids_of(70, seed=3)
    whole = resident.logits(ids)
    assert torch.equal(streamed.logits(ids), whole)
    assert store.stats.misses > 0 and store.stats.evictions > 0
    streamed.runner.chunk_size = 5
    assert torch.equal(streamed.runner.prefill(streamed.slots[0], ids[:-1]), whole[-2])
    assert torch.equal(streamed.runner.decode(streamed.slots[0], ids[-1]), whole[-1])
