"""Hybrid mixture of experts (issue 47): Qwen3.5-MoE (qwen35moe), qwen35's gated DeltaNet and gated attention
layers with a router over experts plus a sigmoid-gated shared expert on every layer.

Oracles: transformers' Qwen3_5MoeForCausalLM (its pure-torch chunked scan and conv, its own routing) on a tiny
random model, run again in float64 for the parity bound; the same model written as llama.cpp's converter writes
it (tests/hybrid_to_gguf.py, checked against that converter's output tensor by tensor by tests/converter_check.py:
f32, Q8_0; Q4_K as random valid blocks, which the converter does not write); our own cold run (a fresh slot, one
pass) for every reuse, bit for bit.

The parity bound [FP64-BOUND] and the checks themselves: tests/hybrid_checks.py.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.engine.weights import choose_weights
from hybrid_checks import (DIVERGENCES_200, assert_batched_equals_alone, assert_chunks_match_one_pass,
                           assert_fp64_parity, assert_greedy_text_matches, assert_int8_exact_on_every_path,
                           assert_reuse_gives_cold_bits, assert_streamed_experts_give_resident_bits,
                           assert_threads_do_not_change_bits, folder_engine, save_folder)
from hybrid_to_gguf import write_qwen35_gguf
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
    save_folder(hf, folder)
    return hf, folder


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
    engine = folder_engine(folder)
    ids = ids_of(150, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, "hf folder", eager_experts=True)
    assert_greedy_text_matches(engine, hf, ids[:40], max_tokens=24)


@pytest.mark.parametrize("dtype", ["float32", "auto"])        # auto: bfloat16 where the CPU has it
def test_chunks_and_decode_give_one_pass_bits(qwen35moe, dtype):
    """[RESUME-EXACT] with experts: a prompt in chunks of 7 (experts seeing 1..7 rows), then decoded token by
    token (the lone-row expert path), gives the bits of one pass over all of it."""
    _, folder = qwen35moe
    engine = folder_engine(folder, dtype)
    ids = ids_of(90, seed=5)
    assert_chunks_match_one_pass(engine, ids, engine.logits(ids), chunk_size=7, tail=10)


def test_reuse_at_divergence_points_gives_the_cold_bits(qwen35moe):
    """A 200-token conversation, then a prompt that leaves it at d (and one that extends it): the reused run
    (resumed at the latest snapshot <= d, kept KV, the rest prefilled) gives the cold run's logits bit for bit,
    the first token's and the decoded ones'; it reuses exactly that snapshot."""
    _, folder = qwen35moe
    warm, cold = folder_engine(folder, state_interval=32), folder_engine(folder, prefix_reuse=False)
    assert_reuse_gives_cold_bits(warm, cold, ids_of(200, seed=7), ids_of(200, seed=8), DIVERGENCES_200, max_tokens=3)


def test_batched_equals_alone(qwen35moe):
    """Four requests joining a batch at different steps (prefill chunks beside decodes: experts over rows of
    several sequences, each slot its own recurrent state) give each one's tokens and logits alone, bit for bit."""
    _, folder = qwen35moe
    engine = folder_engine(folder, slots=5, chunk_size=16)
    assert_batched_equals_alone(engine, [(ids_of(n, seed=n), 6) for n in (40, 75, 9, 120)], [0, 0, 2, 3], budget=40)


def test_threads_do_not_change_the_bits(qwen35moe):
    _, folder = qwen35moe
    assert_threads_do_not_change_bits(folder_engine(folder), ids_of(70, seed=9))


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
    assert_fp64_parity(hf, engine.logits(ids), ids, getattr(quant, "name", "f32"), eager_experts=True)


@pytest.mark.parametrize("quant", [QT.Q8_0, QT.Q4_K], ids=["q8_0", "q4_k"])
def test_gguf_int8_is_exact_on_every_path(quant, tmp_path):
    """int8 activations (the default for quantized files): still the model (top-1 agreement with transformers
    >= 90%), and chunks + decode == one pass, reuse at divergence points == the cold run, batched == alone,
    bit for bit."""
    hf, engine, path = _gguf(tmp_path, quant, "int8")
    assert_int8_exact_on_every_path(hf, engine, _gguf_engine(path, True, "int8", slots=4, chunk_size=16))


def test_streamed_experts_give_the_resident_bits(tmp_path):
    """--expert-cache on a hybrid file: experts read from the file into a cache of two of them (24 in the
    file) give the resident run's logits bit for bit, one pass and chunks + decode."""
    _, resident, path = _gguf(tmp_path, QT.Q8_0, "int8")
    assert_streamed_experts_give_resident_bits(resident, lambda budget: _gguf_engine(path, True, "int8", budget))
