"""Gemma 3 (text) and sliding-window attention: exact against transformers and bit-exact under reuse.

Oracles we did not write: tiny random transformers Gemma3ForCausalLM (sliding window 8, the 5:1
local:global layer pattern, local RoPE base 10k and global 1e6, q/k norms, 4 norms a layer, GeGLU,
embeddings times sqrt(hidden)) and MistralForCausalLM with a window on every layer, run on exactly
the numbers our loaders read: a save_pretrained folder, and a GGUF laid out as llama.cpp's converter
does (tests/hf_to_gguf.py: norms stored as 1 + w, ffn_norm = pre-feedforward), dense f32 and Q8_0.
60 tokens span more than 7 windows, so every windowed layer masks real keys.

Bits [BATCH-INVARIANT][SWA-KV]: a prompt in chunks of 7 (straddling the window edges) then decoded
equals one pass; a sequence alone equals the same sequence batched with another; the native windowed
attention gives a row the same bits whatever T / start / batch. With quantized weights every layer runs
fused in kernels/layer.c (GeGLU, the 4 norms, the window, each layer's RoPE as data), with an fp32 or
an fp16 cache; the fused layers agree with the torch layers on the same weights and with transformers.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.models.llama import ATTN_BLOCK, Segment, Transformer, attention, causal_bias
from ternlm.models.templates import GEMMA_TEMPLATE, with_builtin_template
from ternlm.engine.weights import choose_weights
from hf_to_gguf import write_gguf
from test_loaders import _save_tokenizer

WINDOW = 8
GEMMA = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
             sliding_window=WINDOW, query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def gemma(seed: int = 0, **over):
    import transformers as tf
    cfg = tf.Gemma3TextConfig(**{**GEMMA, **over})
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).float().eval()
    with torch.no_grad():       # norms off their 1 (stored as offsets) and sharper weights
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if n.endswith("norm.weight") else p.mul_(4.0)
    return model


def mistral_swa(seed: int = 0):
    import transformers as tf
    cfg = tf.MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           rms_norm_eps=1e-6, sliding_window=WINDOW, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = tf.MistralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1) if n.endswith("norm.weight") else p.mul_(4.0)
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def ids_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(loaded, quantized: bool, kv_dtype: str = "float32") -> Engine:
    if quantized:
        return Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="fp32"), kv_dtype=kv_dtype)
    return Engine(loaded, dtype=torch.float32)


def torch_logits(loaded, ids: list[int]) -> torch.Tensor:
    """One pass through the torch attention (no native kernels): the window as a mask."""
    cfg = loaded.config
    model = Transformer(cfg, dict(loaded.weights), torch.float32)
    cap = -(-len(ids) // ATTN_BLOCK) * ATTN_BLOCK
    k = torch.zeros(cfg.num_layers, cfg.num_kv_heads, cap, cfg.head_dim)
    return model(model.embed_ids(torch.tensor(ids)), 0, k, torch.zeros_like(k), all_logits=True)


def close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |Δ| relative to the largest reference logit; the argmax must agree everywhere."""
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return (ours - ref).abs().max().item() / ref.abs().max().item()


# ---- config --------------------------------------------------------------------------------------

def test_hf_config_is_data(tmp_path):
    hf = gemma(query_pre_attn_scalar=48)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    cfg = load_hf_folder(tmp_path, torch.float32).config
    assert cfg.arch == "gemma3" and cfg.head_dim == 32
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,)
    assert cfg.layer_rope(0).theta == 10000.0 and cfg.layer_rope(5).theta == 1e6
    assert cfg.post_norms and cfg.qk_norm and cfg.mlp_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.embed_scale == 64 ** 0.5 and cfg.q_scale == 48 ** -0.5 and cfg.final_logit_softcap == 0


def test_gguf_config_is_data(tmp_path):
    hf = gemma(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    write_gguf(hf, tmp_path / "g.gguf", "gemma3")
    cfg = load_gguf(tmp_path / "g.gguf", torch.float32).config
    assert cfg.layer_windows == (WINDOW,) * 5 + (0,)
    assert cfg.max_position_embeddings == 512, "a window is not a context limit"
    assert cfg.rope_spec.kind == "linear" and cfg.rope_spec.factor == 8.0 and cfg.rope_spec.theta == 1e6
    assert cfg.swa_rope.kind == "default" and cfg.swa_rope.theta == 10000.0, "local layers: base 10k, unscaled"
    assert cfg.q_scale == 32 ** -0.5


def test_builtin_template_when_the_file_has_none(caplog):
    assert with_builtin_template("gemma3", "{{ x }}") == "{{ x }}"
    assert with_builtin_template("llama", None) is None
    with caplog.at_level(logging.INFO, logger="ternlm"):
        assert with_builtin_template("gemma3", None) == GEMMA_TEMPLATE
        with_builtin_template("gemma3", None)
    from ternlm.text.chat import render_chat
    text = render_chat(GEMMA_TEMPLATE, [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello"},
                                        {"role": "user", "content": "Bye"}],
                       add_generation_prompt=True, bos_token="<bos>", eos_token="<eos>")
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


# ---- the masks -----------------------------------------------------------------------------------

def test_window_mask_is_transformers_boundary():
    """A window of W: the query at t reads keys (t - W, t], W keys including its own."""
    bias = causal_bias(3, 10, 256, window=4)
    for i in range(10):
        t = 3 + i
        allowed = (bias[i] == 0).nonzero().flatten().tolist()
        assert allowed == list(range(max(0, t - 3), t + 1))


# ---- whole models vs transformers ----------------------------------------------------------------

def test_hf_folder_matches_transformers(tmp_path):
    hf = gemma(seed=3, query_pre_attn_scalar=48)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    ids = ids_of(60)
    ref = hf_logits(hf, ids)
    assert close(torch_logits(load_hf_folder(tmp_path, torch.float32), ids), ref) <= 2e-5   # torch mask
    engine = _engine(load_hf_folder(tmp_path, torch.float32), quantized=False)
    assert close(engine.logits(ids), ref) <= 2e-5                                           # native window


def test_vision_language_folder_runs_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (Gemma 3 >= 4B on the Hub: language_model.model.*, a SigLIP
    vision_tower.* and multi_modal_projector.* beside it, text_config inside config.json) loads as its language
    model, text only, and matches transformers' vision-language model on text input."""
    import transformers as tf
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=16, patch_size=4)
    cfg = tf.Gemma3Config(text_config=tf.Gemma3TextConfig(**GEMMA).to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(5)
    hf = tf.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():       # as gemma() does, the language model's weights only
        for n, p in hf.named_parameters():
            if "language_model" in n:
                p.add_(torch.randn_like(p) * 0.1) if n.endswith("norm.weight") else p.mul_(4.0)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    loaded = load_hf_folder(tmp_path, torch.float32)
    assert loaded.config.arch == "gemma3" and loaded.config.num_layers == GEMMA["num_hidden_layers"]
    ids = ids_of(60)
    assert close(_engine(loaded, quantized=False).logits(ids), hf_logits(hf, ids)) <= 2e-5


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_gguf_matches_transformers(quantized, tmp_path):
    hf = gemma(seed=5)
    path = tmp_path / "g.gguf"
    write_gguf(hf, path, "gemma3", quant=QT.Q8_0 if quantized else None)
    ids = ids_of(60, seed=4)
    ref = hf_logits(hf, ids)
    assert close(torch_logits(load_gguf(path, torch.float32), ids), ref) <= 2e-5
    engine = _engine(load_gguf(path, torch.float32, keep_quantized=quantized, lanes=quantized), quantized)
    assert (engine.model.native is not None) == quantized, "quantized: every layer fused in layer.c"
    assert close(engine.logits(ids), ref) <= 2e-5


def test_mistral_window_on_every_layer_matches_transformers(tmp_path):
    """A second SWA layout on the same mechanism: every layer windowed, one RoPE (Mistral 7B v0.1)."""
    hf = mistral_swa(seed=2)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    loaded = load_hf_folder(tmp_path, torch.float32)
    # today's mistral loader caps the context at the window; the mechanism takes the window instead
    loaded.config = dataclasses.replace(loaded.config, layer_windows=(WINDOW,) * 2, max_position_embeddings=512)
    ids = ids_of(60, seed=6)
    ref = hf_logits(hf, ids)
    assert close(torch_logits(loaded, ids), ref) <= 2e-5
    assert close(_engine(loaded, quantized=False).logits(ids), ref) <= 2e-5


# ---- bits ----------------------------------------------------------------------------------------

def _q8_engine(tmp_path, seed: int = 7, kv_dtype: str = "float32") -> Engine:
    path = tmp_path / "g.gguf"
    write_gguf(gemma(seed=seed), path, "gemma3", quant=QT.Q8_0)
    engine = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), True, kv_dtype)
    assert engine.model.native is not None, "every gemma3 layer fused in layer.c"
    return engine


# q8_0: int8 codes + fp16 scales written by layer.c (head_dim 32); each case compares q8_0 runs with q8_0 runs
KV_DTYPES = pytest.mark.parametrize("kv_dtype", ["float32", "float16", "q8_0"])


def test_fused_layers_match_the_torch_layers_and_transformers(tmp_path):
    """layer.c's gemma3 layers (fp32 cache) against the torch layers on the same quantized weights, to
    fp32 rounding as the other architectures' fused layers; and both against transformers. The fp16
    cache (what `auto` picks for fused layers) stays within fp16's precision of transformers."""
    hf = gemma(seed=10)
    path = tmp_path / "g.gguf"
    write_gguf(hf, path, "gemma3", quant=QT.Q8_0)
    engine = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), True)
    model = engine.model
    ids = ids_of(90, seed=9)
    ref = hf_logits(hf, ids)

    def run() -> torch.Tensor:
        k = torch.zeros(model.cfg.num_layers, model.cfg.num_kv_heads, ATTN_BLOCK, model.cfg.head_dim)
        return model(model.embed_ids(torch.tensor(ids)), 0, k, torch.zeros_like(k), all_logits=True)
    fused = run()
    native, model.native = model.native, None
    try:
        in_torch = run()
    finally:
        model.native = native
    assert (fused - in_torch).abs().max().item() <= 1e-4 * in_torch.abs().max().item()
    assert close(fused, ref) <= 2e-5 and close(in_torch, ref) <= 2e-5
    auto = _engine(load_gguf(path, torch.float32, keep_quantized=True, lanes=True), True, "auto")
    assert auto.model.kv_dtype == torch.float16 and auto.model.native is not None
    assert close(auto.logits(ids), ref) <= 1e-2


@KV_DTYPES
def test_chunked_prefill_and_decode_are_bit_exact(tmp_path, kv_dtype):
    """[SWA-KV] chunks of 7 straddle the window edges (8); then decode: the bits of one pass."""
    engine = _q8_engine(tmp_path, kv_dtype=kv_dtype)
    ids = ids_of(90, seed=2)
    whole = engine.logits(ids)
    engine.runner.chunk_size = 7
    slot = engine.slots[0]
    assert torch.equal(engine.runner.prefill(slot, ids[:-1]), whole[-2])
    assert torch.equal(engine.runner.decode(slot, ids[-1]), whole[-1])


@KV_DTYPES
def test_reuse_at_any_divergence_is_bit_exact(tmp_path, kv_dtype):
    """Truncating to a divergence before, inside and after the last window, then prefilling the new
    tail, gives the bits of a cold pass: every position's K/V was kept on the windowed layers too."""
    engine = _q8_engine(tmp_path, seed=8, kv_dtype=kv_dtype)
    ids = ids_of(70, seed=3)
    engine.runner.chunk_size = 5
    for keep in (20, 62, 66):
        other = ids[:keep] + ids_of(70 - keep, seed=keep)
        cold = engine.logits(other)
        slot = engine.slots[0]
        slot.reset()
        engine.runner.prefill(slot, ids)
        slot.record.truncate(keep)              # the reuse decision's truncate: [0, keep) kept
        assert torch.equal(engine.runner.prefill(slot, other[keep:]), cold[-1]), f"kept {keep}"


@KV_DTYPES
def test_batched_with_another_sequence_gives_the_same_bits(tmp_path, kv_dtype):
    """A prompt alone = batched after another prompt; a decode row alone = the same row batched with
    another sequence's decode row (bits of logits and KV)."""
    engine = _q8_engine(tmp_path, seed=9, kv_dtype=kv_dtype)
    model, cfg = engine.model, engine.config
    a, b = ids_of(37, seed=11), ids_of(53, seed=12)

    def caches():
        k = torch.zeros(cfg.num_layers, cfg.num_kv_heads, ATTN_BLOCK, model.kv_type.width(cfg.head_dim),
                        dtype=model.kv_dtype)
        return k, torch.zeros_like(k)
    assert engine.kv_dtype == kv_dtype
    ka, va = caches()
    alone = model.forward_batch(model.embed_ids(torch.tensor(a)), [Segment(0, len(a), ka, va, "all")])[0]
    step = model.forward_batch(model.embed_ids(torch.tensor(b[:1])), [Segment(len(a), 1, ka, va)])[0]
    x = model.embed_ids(torch.tensor(b + a))
    kb, vb, kc, vc = *caches(), *caches()
    both = model.forward_batch(x, [Segment(0, len(b), kb, vb, "all"), Segment(0, len(a), kc, vc, "all")])
    assert torch.equal(both[1], alone)
    rows = model.forward_batch(model.embed_ids(torch.tensor([a[0], b[0]])),
                               [Segment(len(b), 1, kb, vb), Segment(len(a), 1, kc, vc)])
    assert torch.equal(rows[1], step) and torch.equal(kc, ka) and torch.equal(vc, va)


def test_native_window_rows_do_not_depend_on_the_call(tmp_path):
    """attention.c with a window: a row's bits depend on its position only (T, start and the blocks it
    shares a pass with do not matter), and equal the torch masked attention to fp32 rounding; a row
    past 300 keys with window 8 reads from its window's block on."""
    from ternlm.kernels.build import load
    from ternlm.models.llama import segment_table
    kernels = load()
    H, KV, D, W, n = 4, 1, 32, 8, 300
    g = torch.Generator().manual_seed(0)
    q = torch.randn(H, n, D, generator=g)
    k = torch.randn(1, KV, 512, D, generator=g)
    v = torch.randn(1, KV, 512, D, generator=g)

    @dataclasses.dataclass
    class Seg:
        start: int
        length: int
        k_cache: torch.Tensor
        v_cache: torch.Tensor

    cfg = dataclasses.make_dataclass("C", [("num_layers", int), ("attention_layers", tuple), ("num_kv_heads", int),
                                           ("head_dim", int)])(1, (0,), KV, D)

    def run(start: int, T: int) -> torch.Tensor:
        table = segment_table([Seg(start, T, k, v)], cfg)
        qs = (q[:, start:start + T] * D ** -0.5).contiguous()
        out = torch.empty(T, H * D)
        kernels.attention_segments(table.data_ptr(), 1, 0, qs.data_ptr(), T, H, KV, D, out.data_ptr(), 2, window=W)
        return out

    whole = run(0, n)
    for start, T in ((299, 1), (250, 50), (256, 9), (7, 2)):
        assert torch.equal(run(start, T), whole[start:start + T]), (start, T)
    ref = attention(q, k[0], v[0], 0, causal_bias(0, n, 512, W)).transpose(0, 1).reshape(n, H * D)
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
