"""The checks every hybrid-model test file runs on its own model: test_hybrid.py (qwen35), test_hybrid_moe.py
(qwen35moe), test_hybrid_nemotron.py (nemotron_h), test_hybrid_qwen3next.py (qwen3next).

Each file builds its model (fixtures, converters, engines); these functions only judge an engine against an
oracle: transformers on the same numbers, or our own cold run (a fresh slot, one pass) bit for bit. The sizes,
seeds and divergence points stay in the tests, so a test still reads as what it checks.

The parity bound [FP64-BOUND]: our logits' distance from a float64 run of the same model at most PARITY x
transformers' own fp32 distance from it. Both sum the same products in other orders (transformers' chunked scan,
ours one token at a time), so the right tolerance is whatever fp32 rounding costs transformers itself; a fixed
fraction of the logits' scale would have to be widened per model and weight type (Q4_K's random blocks make wide
weights). Judged on the mean distance (PARITY x) and on the largest one (PARITY_MAX x): the largest is one logit's
rounding luck, and which side gets lucky depends on the host's BLAS (qwen35's Q4_K file, four seeds, a Sapphire
Rapids host: largest x0.97-7.9 of transformers', mean x0.69-1.05; on a Zen 4 EPYC seed 3 passed at PARITY x the
largest, here it was x4.24). A real error (a wrong scale, a position computed wrongly) is orders of magnitude
past either bound.
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from ternlm.engine.core import Engine
from ternlm.kv.record import lcp
from ternlm.models.hf import load_hf_folder
from test_batching import alone, together
from test_loaders import _save_tokenizer
from test_moe import ids_of

PARITY = 4          # [FP64-BOUND] mean distance
PARITY_MAX = 16     # [FP64-BOUND] largest distance

# around the 32-grid's snapshots (31, 32, 33, 64, 65), a prefill's end (200), and spread between
DIVERGENCES_200 = sorted({0, 1, 2, 5, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 150, 199, 200})


def save_folder(hf, folder) -> None:
    """Write a transformers model and the tests' tokenizer into `folder`, as a checkpoint folder is laid out."""
    hf.save_pretrained(folder)
    _save_tokenizer(folder)


def folder_engine(folder, dtype: str = "float32", **kw) -> Engine:
    """Our engine on a saved folder (fp32 weights), reusing a prefix from one token on (min_reuse=1)."""
    return Engine(load_hf_folder(folder, torch.float32), dtype=dtype, min_reuse=1, **kw)


def assert_fp64_parity(hf, ours: torch.Tensor, ids: list[int], label: str, eager_experts: bool = False) -> None:
    """[FP64-BOUND] `ours` (len(ids), vocab) is within PARITY x transformers' fp32 mean distance from its float64
    run (and that distance is not 0, or the bound would ask for float64 bits) and PARITY_MAX x its largest one, and its argmax equals transformers'
    fp32 one at every position. Runs a float64 copy; `hf` is not changed. eager_experts: the copy loops over
    experts (transformers' grouped_mm takes no float64)."""
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        hf64 = copy.deepcopy(hf).double()
        if eager_experts:
            hf64.set_experts_implementation("eager")
        ref64 = hf64(torch.tensor([ids])).logits[0]
    ours_d, hf_d = (ours.double() - ref64).abs(), (ref.double() - ref64).abs()
    print(f"{label}: ours {ours_d.max():.3g} (mean {ours_d.mean():.3g}), transformers fp32 {hf_d.max():.3g} "
          f"(mean {hf_d.mean():.3g}) from float64 (scale {ref64.abs().max():.3g})")
    assert 0 < hf_d.mean() and ours_d.mean() <= PARITY * hf_d.mean()
    assert ours_d.max() <= PARITY_MAX * hf_d.max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def assert_greedy_text_matches(engine: Engine, hf, prompt: list[int], max_tokens: int) -> None:
    """Greedy decoding of `prompt` gives transformers' greedy tokens, all `max_tokens` of them (eos ignored): the
    logits' parity carries through decode steps, not only one pass. Uses one of the engine's slots."""
    out = engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True)
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                           min_new_tokens=max_tokens)[0, len(prompt):]
    assert out.token_ids == want.tolist()


def assert_chunks_match_one_pass(engine: Engine, ids: list[int], whole: torch.Tensor, chunk_size: int,
                                 tail: int) -> None:
    """[RESUME-EXACT] the scan takes the same per-token steps on every path: ids[:-tail] prefilled in chunks of
    `chunk_size`, then the last `tail` decoded token by token, give `whole` (one pass over all of ids, possibly by
    another engine on the same numbers) bit for bit; slot 0 ends with its recurrent state and record at len(ids).
    Sets engine.runner.chunk_size and leaves slot 0 holding ids."""
    engine.runner.chunk_size = chunk_size
    slot = engine.slots[0]
    assert torch.equal(engine.runner.prefill(slot, ids[:-tail]), whole[-tail - 1])
    for i, t in enumerate(ids[-tail:]):
        assert torch.equal(engine.runner.decode(slot, t), whole[len(ids) - tail + i]), i
    assert slot.state.pos == len(slot.record) == len(ids)


def assert_reuse_gives_cold_bits(warm: Engine, cold: Engine, base: list[int], other: list[int], points,
                                 max_tokens: int, extend: int = 20) -> None:
    """A conversation `base` in warm's slot 0, then a prompt that leaves it at each d in `points`
    (base[:d] + other[d:]; at d == len(base), base + other[:extend]: 0 resends base itself): the reused run
    (resumed at the latest recurrent snapshot <= what attention alone would keep, kept KV, the rest prefilled)
    gives cold.logits' bits for its first token and the `max_tokens - 1` decoded after it, and reports exactly that
    snapshot as cached_tokens. `cold` may be warm itself: Engine.logits touches no slot. Leaves warm's slot 0
    holding the last prompt."""
    for d in points:
        warm.generate(base, max_tokens=1, ignore_eos=True, slot=0)      # the slot holds base (+ snapshots)
        snaps = set(warm.slots[0].state.snaps) | {warm.slots[0].state.pos}
        prompt = base[:d] + other[d:] if d < len(base) else base + other[:extend]
        k = min(lcp(warm.slots[0].record.fed, prompt), len(prompt) - 1)      # what attention alone would keep
        expect = max([s for s in snaps if s <= k], default=0)
        got = warm.generate(prompt, max_tokens=max_tokens, ignore_eos=True, keep_logits=True, slot=0)
        assert got.cached_tokens == (expect if expect >= 1 else 0), d
        ref = cold.logits(prompt + got.token_ids[:-1])[len(prompt) - 1:]
        assert torch.equal(got.logits, ref), d


def assert_batched_equals_alone(engine: Engine, reqs: list[tuple[list[int], int]], join_at: list[int],
                                budget: int) -> None:
    """Requests (prompt, max_tokens) joining one batch at steps `join_at` (prefill chunks beside decodes, each slot
    its own recurrent state) give each one's tokens and logits alone (slot 0, a batch of one), bit for bit.
    Needs len(reqs) + 1 slots; resets them all."""
    solo = [alone(engine, p, m)[0] for p, m in reqs]
    for i, (b, a) in enumerate(zip(together(engine, reqs, join_at, budget=budget), solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i


def assert_threads_do_not_change_bits(engine: Engine, ids: list[int]) -> None:
    """One pass over ids on 1, 2 and 3 torch threads gives the same bits (no reduction split by thread count).
    Restores torch's thread count."""
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(engine.logits(ids))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def assert_int8_exact_on_every_path(hf, engine: Engine, batch_engine: Engine) -> None:
    """int8 activations (the default for quantized files), `hf` holding the file's numbers: still the model (top-1
    agreement with transformers on >= 90 of 100 positions: int8 rounding may flip near-ties, not the model), and
    exact on every path, bit for bit: chunks of 9 + decode == one pass, reuse at every 13th divergence point of a
    130-token conversation == the cold run (with the snapshot's cached count), and on `batch_engine` (4 slots,
    chunks of 16) batched == alone."""
    ids = ids_of(100, seed=4)
    whole = engine.logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert int((whole.argmax(-1) == ref.argmax(-1)).sum()) >= 90
    assert_chunks_match_one_pass(engine, ids, whole, chunk_size=9, tail=5)
    assert_reuse_gives_cold_bits(engine, engine, ids_of(130, seed=5), ids_of(130, seed=6), range(0, 131, 13),
                                 max_tokens=2, extend=0)
    assert_batched_equals_alone(batch_engine, [(ids_of(n, seed=n), 4) for n in (30, 70, 11)], [0, 1, 2], budget=32)


def assert_streamed_experts_give_resident_bits(resident: Engine, streamed_with: Callable[[int], Engine]) -> None:
    """--expert-cache: `streamed_with(budget)` (the same file, experts read on demand into a cache of two and a half
    experts' bytes) converts nothing at load, misses and evicts, and gives the resident engine's logits bit for bit,
    one pass and chunks of 5 + decode."""
    from ternlm.models.moe import ExpertStore, StreamedExperts
    assert isinstance(resident.model.experts, ExpertStore)
    one = resident.model.experts.get(0, 0).nbytes
    streamed = streamed_with(2 * one + one // 2)
    store = streamed.model.experts
    assert isinstance(store, StreamedExperts) and len(store) == 0, "nothing converted at load"
    ids = ids_of(70, seed=3)
    whole = resident.logits(ids)
    assert torch.equal(streamed.logits(ids), whole)
    assert store.stats.misses > 0 and store.stats.evictions > 0
    assert_chunks_match_one_pass(streamed, ids, whole, chunk_size=5, tail=1)


def assert_q4_k_file_matches(hf, tmp_path, to_f32: Callable, reference_weights: Callable[..., int],
                             eager_experts: bool = False) -> None:
    """A Q4_K file through our kernels, for a family whose converter writes no K-quants: `hf` saved, `to_f32(folder,
    path)` (llama.cpp's converter) writes it as f32, its 256-wide matrices become random valid Q4_K blocks
    (tests/ggml_requant.py) and `reference_weights(hf, path)` copies them, dequantized, into `hf` (returns how many).
    fp32 activations: [FP64-BOUND] parity and greedy text equal; int8 activations exact on every path."""
    from ggml_requant import requantize
    from ternlm.models.gguf import load_gguf
    from ternlm.engine.weights import choose_weights

    def engine(act: str, **kw) -> Engine:
        return Engine(load_gguf(q4k, torch.float32, keep_quantized=True, lanes=True), dtype="float32",
                      weights=choose_weights("gguf", "auto", True, activations=act), kv_dtype="float32", min_reuse=1,
                      **kw)
    save_folder(hf, tmp_path / "m")
    to_f32(tmp_path / "m", tmp_path / "f32.gguf")
    q4k = tmp_path / "q4_k.gguf"
    replaced = requantize(tmp_path / "f32.gguf", q4k)
    assert reference_weights(hf, q4k) == len(replaced) >= 10
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine("fp32").logits(ids), ids, "q4_k", eager_experts=eager_experts)
    assert_greedy_text_matches(engine("fp32"), hf, ids[:30], max_tokens=16)
    assert_int8_exact_on_every_path(hf, engine("int8"), engine("int8", slots=4, chunk_size=16))
