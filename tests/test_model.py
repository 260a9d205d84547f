"""The network against oracles we did not write: transformers on the same weights.

smollm2-135m: transformers dequantizes the same GGUF with its own loader; we compare logits on
prompts of >= 128 positions and 64-token greedy continuations of chat prompts.
Tiny random llama / qwen2 / qwen3 models (built by transformers) cover the architecture flags.
"""
from __future__ import annotations

import pytest
import torch

from ternlm.linear.dense import Linear
from conftest import BF16, FP32
from tiny import tiny_engine

TEXTS = [
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall "
    "of Constantinople. " * 8,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n" * 5,
    "Photosynthesis converts light energy into chemical energy stored in glucose. Plants, algae "
    "and some bacteria do it in chloroplasts, using water and carbon dioxide and releasing oxygen. " * 5,
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 20.",
    "How do I reverse a list in Python?",
]
LOGIT_ATOL = 2e-3   # measured max |diff| on these prompts is printed by the test


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("text", TEXTS)
def test_fp32_logits_match_transformers(smollm2_f32, hf_smollm2, text):
    ids = smollm2_f32.tokenizer.encode(text)
    assert len(ids) >= 128
    ours, ref = smollm2_f32.logits(ids), hf_logits(hf_smollm2, ids)
    diff = (ours - ref).abs().max().item()
    print(f"max |logit diff| fp32 over {len(ids)} positions: {diff:.2e}")
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert diff <= LOGIT_ATOL


def test_bf16_argmax_agreement(smollm2_bf16, hf_smollm2):
    agree = total = 0
    for text in TEXTS:
        ids = smollm2_bf16.tokenizer.encode(text)
        a, b = smollm2_bf16.logits(ids).argmax(-1), hf_logits(hf_smollm2, ids).argmax(-1)
        agree += int((a == b).sum())
        total += len(ids)
    print(f"bf16 argmax agreement with transformers fp32: {agree}/{total}")
    assert agree / total >= 0.99


@pytest.mark.parametrize("question", CHATS)
def test_greedy_64_tokens_match_transformers(smollm2_f32, hf_smollm2, question):
    ids = list(smollm2_f32.apply_chat_template([{"role": "user", "content": question}]))
    ours = smollm2_f32.generate(ids, max_tokens=64, temperature=0.0, ignore_eos=True)
    assert ours.token_ids == hf_greedy(hf_smollm2, ids, 64)


def hf_greedy(hf, ids, n):
    """transformers' forward with its own KV cache, argmax each step, EOS not special-cased
    (generate(min_new_tokens=...) would mask EOS and change the sequence)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = hf(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            tok = int(r.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_logits_parity(arch):
    hf, engine = tiny_engine(arch, seed=3)
    ids = torch.randint(0, 256, (160,)).tolist()
    ref = hf_logits(hf, ids)
    ours = engine.logits(ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # chunked prefill + decode through a slot gives the same last-position logits
    engine.runner.chunk_size = 7
    last = engine.runner.prefill(engine.slots[0], ids[:-1])
    torch.testing.assert_close(last, ref[-2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.runner.decode(engine.slots[0], ids[-1]), ref[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_packed_linear_equals_plain(dtype, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(rows, 64, dtype=dtype)
    packed, plain = Linear(w, b), Linear(w, b, pack=False)
    if dtype == torch.bfloat16:
        assert torch.equal(packed(x), plain(x))      # same kernel family, same bits
    else:
        torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)  # fp32 GEMV sums in another order


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("shape", [(192, 96), (576, 1536), (896, 4864)],
                         ids=["small", "smollm2-down", "qwen-down"])
def test_linear_rows_are_batch_invariant(dtype, shape):
    """[BATCH-INVARIANT] a row's result does not depend on how many rows came with it (the real
    models' down projections included: a long reduction is where one-row kernels split differently)."""
    torch.manual_seed(1)
    out_f, in_f = shape
    lin = Linear(torch.randn(out_f, in_f, dtype=dtype) * 0.1, torch.randn(out_f, dtype=dtype))
    x = torch.randn(300, in_f, dtype=dtype)
    full = lin(x)
    for m in (1, 2, 3, 5, 37, 128):
        assert torch.equal(lin(x[:m]), full[:m]), m
    for r in range(0, 300, 3):
        assert torch.equal(lin(x[r:r + 1]), full[r:r + 1]), r


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_attention_rows_are_batch_invariant(dtype):
    """[BATCH-INVARIANT] a position's K/V and logits are the same bits whether it came from one
    full prefill, a tail after a chunk, or a decode step (the basis of exact reuse)."""
    _, engine = tiny_engine("qwen3", seed=5, dtype=dtype)
    ids = torch.randint(0, 256, (300,)).tolist()
    ref = engine.logits(ids)                               # one pass, positions 0..299
    slot = engine.slots[0]
    engine.runner.chunk_size = 64
    engine.runner.prefill(slot, ids[:250])
    for i in range(250, 299):
        engine.runner.decode(slot, ids[i])
    last = engine.runner.decode(slot, ids[299])
    assert torch.equal(last, ref[299])
