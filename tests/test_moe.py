"""Mixture-of-experts models (qwen3moe; Mixtral, a llama GGUF with expert tensors; qwen2moe with its
shared expert; olmoe with full-width q/k norms): exact against transformers and batch-invariant.

Oracles we did not write: tiny random transformers Qwen3MoeForCausalLM / MixtralForCausalLM, run on
exactly the numbers our loaders read: a save_pretrained folder, and a GGUF laid out as llama.cpp's
converter does (tests/hf_to_gguf.py: router ffn_gate_inp, stacked ffn_{gate,up,down}_exps), dense
fp32 and Q8_0 (per-expert QWeights in the lanes layout, the native kernels). Bits: a prompt in chunks
of 7 then decoded equals one pass; a sequence alone equals the same sequence batched with another;
top-k ties go to the lower expert index.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.models.config import ModelConfig
from ternlm.engine.core import Engine
from ternlm.models.gguf import load_gguf
from ternlm.models.hf import load_hf_folder
from ternlm.models.llama import Segment
from ternlm.models.moe import ExpertStore, MoE, select_experts
from ternlm.linear.qlinear import QLinear
from ternlm.engine.weights import choose_weights
from hf_to_gguf import write_gguf
from test_loaders import _save_tokenizer

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              num_experts_per_tok=2)

# name -> (transformers config / model class, config kwargs, GGUF architecture)
MODELS = {
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
        tie_word_embeddings=False), "qwen3moe"),
    "qwen3moe-unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=64, intermediate_size=96, norm_topk_prob=False,
        tie_word_embeddings=True), "qwen3moe"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, intermediate_size=64, sliding_window=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "llama"),
    # a shared expert wider than the routed ones, q/k/v biases, top-k weights not renormalised (as the real ones)
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=64, intermediate_size=96,
        norm_topk_prob=False, tie_word_embeddings=False), "qwen2moe"),
    # q_norm over all 4 x 16 q features, k_norm over 2 x 16; norm_topk_prob false (transformers' default)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_experts=8, intermediate_size=32, norm_topk_prob=False, tie_word_embeddings=False), "olmoe"),
}


def hf_model(name: str, seed: int = 0, **over):
    """`over`: config fields other than COMMON's (hidden_size=128: head_dim 32, what --kv-dtype q8_0 needs)."""
    import transformers as tf
    cfg_cls, model_cls, kw, _ = MODELS[name]
    cfg = getattr(tf, cfg_cls)(**{**COMMON, **kw, **over})
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(cfg).float().eval()
    with torch.no_grad():       # norms off 1 and sharper weights: routing and greedy choices matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)                 # a spread router: many experts in use, no near-ties
            else:
                p.mul_(4.0) if p.abs().max() > 0 else p.normal_(0, 0.08)   # stacked experts start at 0
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def ids_of(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(loaded, quantized: "bool | str") -> Engine:
    if quantized == "bf16":
        return Engine(loaded, dtype=torch.bfloat16)
    if quantized is True or quantized in ("int8", "q8_0-kv"):   # the GGUF's blocks: fp32 or int8 activations
        act = "int8" if quantized == "int8" else "fp32"
        kv = "q8_0" if quantized == "q8_0-kv" else "float32"      # q8_0-kv: the KV as int8 codes + fp16 scales
        e = Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations=act), kv_dtype=kv)
        assert e.model.activations == act and e.kv_dtype == kv
        return e
    return Engine(loaded, dtype=torch.float32)


def _gguf_engine(name: str, quantized: bool, tmp_path, seed: int):
    # "q8_0-kv": the q8_0-native engine with a q8_0 KV cache, on a model of head_dim 32 (its rows need a multiple)
    hf = hf_model(name, seed=seed, **({"hidden_size": 128} if quantized == "q8_0-kv" else {}))
    path = tmp_path / f"{name}.gguf"
    keep = quantized is True or quantized in ("int8", "q8_0-kv")   # "q8_0-dense": the same file, dequantized at load
    write_gguf(hf, path, MODELS[name][3], quant=QT.Q8_0 if keep or quantized == "q8_0-dense" else None)
    loaded = load_gguf(path, torch.bfloat16 if quantized == "bf16" else torch.float32, keep_quantized=keep, lanes=keep)
    return hf, _engine(loaded, quantized)


def _compare(ours: torch.Tensor, ref: torch.Tensor, rel: float) -> float:
    delta = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"max |dlogit| {delta:.3g} (scale {scale:.3g}, ratio {delta / scale:.3g})")
    assert delta <= rel * scale
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    return delta


# ---- routing ----------------------------------------------------------------------------------------

def test_top_k_ties_go_to_the_lower_expert_index():
    probs = torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.2],      # tie for first: 1 before 3
                          [0.2, 0.2, 0.2, 0.2, 0.2],      # all tied: 0, 1
                          [0.05, 0.1, 0.35, 0.15, 0.35]])  # tie for first: 2 before 4
    idx, val = select_experts(probs, 2)
    assert idx.tolist() == [[1, 3], [0, 1], [2, 4]]
    assert torch.equal(val, torch.gather(probs, 1, idx))
    # the same rows in another batch, alone, reversed: the same choice per row
    for r in range(3):
        assert torch.equal(select_experts(probs[r:r + 1], 2)[0], idx[r:r + 1])
    assert torch.equal(select_experts(probs.flip(0), 2)[0], idx.flip(0))


def _router_weights_f64(w: torch.Tensor, h: torch.Tensor, k: int, norm: bool, experts: torch.Tensor):
    """The router weights of `experts` (M, k) in float64, and a per-weight bound on an fp32 computation's
    error, derived from fp32's unit roundoff u = 2^-24 (Higham's gamma_n):
      logits: |dz| <= gamma_n * sum_i |w_i h_i| (any order) = D per row (the max over experts);
      softmax: relative error <= exp(2D) - 1 from the logits, + (E + 4) u for max/exp/sum/divide;
      renormalising over k: twice the softmax's relative error + (k + 2) u.
    -> (exact (M, k) float64, bound (M, k) float64)."""
    u = 2.0 ** -24
    n, E = w.shape[1], w.shape[0]
    gamma = n * u / (1 - n * u)
    w64, h64 = w.double(), h.double()
    probs = torch.softmax(h64 @ w64.T, dim=-1)                                  # (M, E)
    D = gamma * (h64.abs() @ w64.abs().T).max(dim=-1, keepdim=True).values       # (M, 1)
    rel = torch.expm1(2 * D) + (E + 4) * u
    val = torch.gather(probs, 1, experts)
    if norm:
        val = val / val.sum(dim=-1, keepdim=True)
        rel = 2 * rel + (k + 2) * u
    return val, val * rel


def test_routing_matches_transformers_and_orders_by_expert_index():
    """Router weights as the reference computes them (softmax, top-k, renormalise), listed by
    ascending expert index [SUM-ORDER]; a tie between identical router rows goes to the lower one."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
        ref = Qwen3MoeTopKRouter(cfg)
        torch.manual_seed(0)
        with torch.no_grad():
            ref.weight.normal_()
        moe = MoE(ref.weight.detach().clone(), 3, norm, ExpertStore(), 0)
        h = torch.randn(40, 64)
        _, ref_w, ref_i = ref(h)
        r = moe.route(h)
        assert torch.all(r.experts[:, :-1] < r.experts[:, 1:])
        order = torch.argsort(ref_i, dim=-1)
        assert torch.equal(r.experts, torch.gather(ref_i, 1, order))
        # Weights against a float64 reference, within what fp32 rounding allows (any summation order,
        # any vector width: an AVX-512 host's router differs from transformers' by ~1e-6).
        exact, bound = _router_weights_f64(ref.weight.detach(), h, 3, norm, r.experts)
        assert torch.all((r.weights.double() - exact).abs() <= bound)
        assert torch.all((torch.gather(ref_w, 1, order).double() - exact).abs() <= bound)   # the oracle too
    w = torch.randn(4, 64)
    w[3] = w[1]                                       # experts 1 and 3 always tie
    r = MoE(w, 1, True, ExpertStore(), 0).route(torch.randn(200, 64))
    chosen = r.experts.reshape(-1).tolist()
    assert 3 not in chosen and 1 in chosen


def test_config_validates_expert_fields():
    base = dict(arch="qwen3moe", vocab_size=10, hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=64,
                tie_word_embeddings=True)
    ModelConfig(**base, num_experts=4, experts_per_token=2, expert_intermediate_size=16)
    ModelConfig(**base)                               # 0 experts: dense
    for bad in (dict(num_experts=4, experts_per_token=5, expert_intermediate_size=16),
                dict(num_experts=4, experts_per_token=0, expert_intermediate_size=16),
                dict(num_experts=4, experts_per_token=2),
                dict(experts_per_token=2, expert_intermediate_size=16),
                dict(num_experts=-1)):
        with pytest.raises(ValueError):
            ModelConfig(**base, **bad)


# ---- whole models vs transformers -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_hf_folder_matches_transformers(name, tmp_path):
    hf = hf_model(name, seed=3)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    loaded = load_hf_folder(tmp_path, torch.float32)
    assert loaded.config.num_experts == 8 and loaded.config.experts_per_token == 2
    assert loaded.config.norm_topk_prob == getattr(hf.config, "norm_topk_prob", True)       # Mixtral: always
    engine = _engine(loaded, quantized=False)
    ids = ids_of(60)
    _compare(engine.logits(ids), hf_logits(hf, ids), 2e-5)


@pytest.mark.parametrize("quantized", [False, True, "q8_0-dense"], ids=["f32", "q8_0-native", "q8_0-dense"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gguf_matches_transformers(name, quantized, tmp_path):
    hf, engine = _gguf_engine(name, quantized, tmp_path, seed=5)
    cfg = engine.config
    assert cfg.num_experts == 8 and cfg.experts_per_token == 2
    assert cfg.expert_intermediate_size == hf.config.__dict__.get("moe_intermediate_size", hf.config.intermediate_size)
    model = engine.model
    # fused in layer.c (kernels/moe_layer.py) where every projection is quantized
    assert (model.native is not None) == (quantized is True)
    expert = model.experts.get(0, 3)
    assert isinstance(expert.gate_up, QLinear) == (quantized is True)
    if quantized is True:
        assert all(p.lanes for p in expert.gate_up.parts + expert.down.parts), "experts in the lanes layout"
    ids = ids_of(150)
    before = model.experts.stats.hits
    _compare(engine.logits(ids), hf_logits(hf, ids), 2e-5)
    stats = model.experts.stats
    assert stats.misses == 0 and stats.bytes_read == 0 and stats.hits > before    # resident: all hits
    assert stats.rows >= 150 * 2 * cfg.num_layers
    h = torch.randn(150, cfg.hidden_size)
    used = set(model.layers[0].moe.route(h).experts.reshape(-1).tolist())
    assert len(used) >= 6, "the router spreads rows over the experts (a test of 2 experts proves little)"


# ---- bits: chunks, batches ----------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True, "int8", "bf16", "q8_0-kv"],
                         ids=["f32", "q8_0-native", "q8_0-int8", "bf16", "q8_0-native-kv_q8_0"])
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "qwen2moe", "olmoe"])
def test_chunked_prefill_and_decode_are_bit_exact(name, quantized, tmp_path):
    """[BATCH-INVARIANT] chunks of 7 (each routing its own rows, experts seeing 1..7 rows), then decode,
    give the bits of one pass over 90 rows."""
    _, engine = _gguf_engine(name, quantized, tmp_path, seed=7)
    ids = ids_of(90, seed=2)
    whole = engine.logits(ids)
    engine.runner.chunk_size = 7
    last = engine.runner.prefill(engine.slots[0], ids[:-1])
    assert torch.equal(last, whole[-2])
    assert torch.equal(engine.runner.decode(engine.slots[0], ids[-1]), whole[-1])


@pytest.mark.parametrize("quantized", [False, True, "int8", "bf16", "q8_0-kv"],
                         ids=["f32", "q8_0-native", "q8_0-int8", "bf16", "q8_0-native-kv_q8_0"])
@pytest.mark.parametrize("name", ["qwen3moe", "mixtral", "qwen2moe", "olmoe"])
def test_alone_and_batched_are_bit_exact(name, quantized, tmp_path):
    """A sequence's logits alone == the same sequence in one forward_batch with another sequence's
    prefill (its rows sharing experts with ours), and a decode step in company == alone."""
    _, engine = _gguf_engine(name, quantized, tmp_path, seed=11)
    m, cfg = engine.model, engine.config

    def caches():
        k = torch.zeros(cfg.num_layers, cfg.num_kv_heads, 256, m.kv_type.width(cfg.head_dim), dtype=m.kv_dtype)
        return k, torch.zeros_like(k)

    def embed(ids):
        return m.embed_ids(torch.tensor(ids, dtype=torch.long))

    a, b = ids_of(33, seed=3), ids_of(21, seed=4)
    ka, va = caches()
    alone = m.forward_batch(embed(a), [Segment(0, len(a), ka, va, "all")])[0]
    kb, vb = caches()
    kc, vc = caches()
    both = m.forward_batch(embed(b + a), [Segment(0, len(b), kb, vb, "all"), Segment(0, len(a), kc, vc, "all")])
    assert torch.equal(both[1], alone)
    assert torch.equal(kc, ka) and torch.equal(vc, va)
    # decode: a's next token alone vs beside b's next token
    step_alone = m.forward_batch(embed([7]), [Segment(len(a), 1, ka, va, "last")])[0]
    step = m.forward_batch(embed([9, 7]), [Segment(len(b), 1, kb, vb, "last"), Segment(len(a), 1, kc, vc, "last")])
    assert torch.equal(step[1], step_alone)


def test_hf_stacked_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers 5 holds experts stacked (experts.gate_up_proj (E, 2 I, hidden), gate rows first;
    experts.down_proj (E, hidden, I)); save_pretrained writes them per expert. Both give our names."""
    import json
    from ternlm.models.hf import config_from_hf, to_llama_layout
    hf = hf_model("qwen3moe", seed=2)
    hf.save_pretrained(tmp_path)
    _save_tokenizer(tmp_path)
    per_expert = load_hf_folder(tmp_path, torch.float32)
    sd = {n: t.detach() for n, t in hf.state_dict().items()}
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()), set(sd))
    stacked = to_llama_layout(sd, cfg)
    assert cfg == per_expert.config and set(stacked) == set(per_expert.weights)
    assert all(torch.equal(stacked[n], per_expert.weights[n]) for n in stacked)


# ---- what `ternlm bench engine` reports ----------------------------------------------------------------

def test_bench_engine_reports_expert_traffic_per_prefill_and_per_decoded_token(tmp_path):
    """bench/engine.py's counters: the prefill's expert traffic and the decode steps' alone (the decode
    context's own prefill excluded), from the store's ExpertStats: every row routed to k experts a layer."""
    from ternlm.bench.engine import _expert_traffic, _ternlm
    hf = hf_model("qwen3moe", seed=5)
    path = tmp_path / "q8.gguf"
    write_gguf(hf, path, "qwen3moe", quant=QT.Q8_0)
    for budget in (None, 0):             # resident; streamed through a cache that keeps nothing
        loaded = load_gguf(path, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget)
        engine = _engine(loaded, True)
        cfg, traffic = engine.config, []
        _ternlm(engine, ids_of(30, seed=1), 5, ids_of(20, seed=2), traffic)
        e = _expert_traffic(traffic, 30)
        p, d = e["per_prefill"], e["per_decode_token"]
        per_row = cfg.experts_per_token * cfg.num_layers
        assert p["rows"] == 30 * per_row and d["rows"] == per_row
        assert traffic[0]["decode_tokens"] == 5
        if budget is None:
            assert p["misses"] == d["misses"] == p["bytes_read"] == d["bytes_read"] == 0 and p["hits"] > 0
        else:
            slab = sum(s.length for s in engine.model.experts._slabs[(0, 0)])
            assert p["hits"] == d["hits"] == 0 and d["misses"] == per_row     # one row: k distinct experts a layer
            assert p["bytes_read"] == p["misses"] * slab and d["bytes_read"] == d["misses"] * slab
            # the misses' time on the step's path, within the prefill's
            assert 0 < p["read_wait_us"] + p["convert_us"] <= e["prefill_s"] * 1e6
