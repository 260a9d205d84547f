"""qwen2moe's shared expert and olmoe, beyond the parity and bit tests they share with the other MoE
models in tests/test_moe.py (MODELS there: "qwen2moe", "olmoe").

Oracles we did not write: transformers' Qwen2MoeSparseMoeBlock (the shared expert's place in the sum)
and greedy decoding of the tiny random transformers models on the numbers the GGUF holds. The shared
expert is dense and every row uses it, so a streamed store must never hold or count it: it stays in
the layer, resident, whatever the expert cache's budget.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.engine.core import Engine
from ternlm.models.gguf import FastGGUFReader, config_from_gguf, load_gguf
from ternlm.models.moe import ExpertStore, MoE, SharedExpert, StreamedExperts
from ternlm.linear.dense import Linear
from ternlm.engine.weights import choose_weights
from hf_to_gguf import write_gguf
from test_model import hf_greedy
from test_moe import MODELS, hf_model, ids_of


def _moe_of_block(block, shared: bool) -> MoE:
    """Our MoE over a transformers Qwen2MoeSparseMoeBlock's own weights (dense fp32 projections)."""
    store = ExpertStore()
    gu, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    for e in range(gu.shape[0]):
        store.put(0, e, Linear(gu[e].contiguous()), Linear(down[e].contiguous()), 0)
    s = block.shared_expert
    sh = SharedExpert(Linear(torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach()),
                      Linear(s.down_proj.weight.detach().contiguous()), block.shared_expert_gate.weight.detach())
    return MoE(block.gate.weight.detach().clone(), block.gate.top_k, block.gate.norm_topk_prob, store, 0,
               shared=sh if shared else None)


def test_shared_expert_is_added_after_the_routed_sum():
    """[SUM-ORDER] out = (routed experts in ascending index) + sigmoid(g . h) * shared(h), as
    transformers' `expert_output + shared_expert_output`: the bits of the routed-only MoE plus the
    gated shared output, and close to transformers' block."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    for norm in (False, True):
        cfg = Qwen2MoeConfig(hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, norm_topk_prob=norm)
        torch.manual_seed(0)
        block = Qwen2MoeSparseMoeBlock(cfg).eval()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        h = torch.randn(200, 64)
        ours = _moe_of_block(block, shared=True)
        out = ours(h)
        routed = _moe_of_block(block, shared=False)(h)
        assert torch.equal(out, routed + ours._shared(h))
        with torch.no_grad():
            ref = block(h.unsqueeze(0))[0]
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for T in (1, 7):                                       # rows alone, in chunks of 7: the same bits
            for r in range(0, 200, T):                         # (torch.sigmoid on the gate column failed this)
                assert torch.equal(ours(h[r:r + T]), out[r:r + T])


def test_gguf_config_of_shared_and_full_width_norms(tmp_path):
    """What the loader reads from the files llama.cpp's layout gives: qwen2moe's shared expert width
    from ffn_gate_shexp, top-k weights not renormalised by default for qwen2moe and olmoe (llama.cpp
    runs norm_w = false for both), olmoe's q/k norms over the whole projection."""
    for name in ("qwen2moe", "olmoe"):
        hf = hf_model(name, seed=1)
        path = tmp_path / f"{name}.gguf"
        write_gguf(hf, path, MODELS[name][3])
        cfg = config_from_gguf(FastGGUFReader(path))
        assert cfg.arch == name and cfg.norm_topk_prob is False
        assert cfg.shared_expert_intermediate_size == (64 if name == "qwen2moe" else 0)
        assert cfg.qk_norm == cfg.qk_norm_full == (name == "olmoe")
        assert cfg.qkv_bias == (name == "qwen2moe")
        hf.config.norm_topk_prob = True                       # the file says so: the key wins
        write_gguf(hf, path, MODELS[name][3])
        assert config_from_gguf(FastGGUFReader(path)).norm_topk_prob is True


@pytest.mark.parametrize("name", ["qwen2moe", "olmoe"])
def test_greedy_tokens_match_transformers(name, tmp_path):
    """32 greedy tokens from a Q8_0 GGUF through the native kernels == transformers' greedy decoding of
    the same (dequantized) numbers."""
    hf = hf_model(name, seed=13)
    path = tmp_path / f"{name}.gguf"
    write_gguf(hf, path, MODELS[name][3], quant=QT.Q8_0)
    loaded = load_gguf(path, torch.float32, keep_quantized=True, lanes=True)
    engine = Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="fp32"), kv_dtype="float32")
    ids = ids_of(40, seed=9)
    ours = engine.generate(ids, max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = hf_greedy(hf, ids, 32)
    print(f"{name}: greedy agreement {sum(a == b for a, b in zip(ours.token_ids, ref))}/32")
    assert ours.token_ids == ref


@pytest.fixture(scope="module")
def qwen2moe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2moe") / "qwen2moe-q8.gguf"
    write_gguf(hf_model("qwen2moe", seed=5), path, "qwen2moe", quant=QT.Q8_0)
    return path


def test_streamed_shared_expert_stays_resident(qwen2moe_file):
    """An expert cache of 0 bytes: every routed expert is read on use, the shared expert never is (it
    is no slab of the store, it is built at load in each layer) and the logits are the resident bits."""
    def engine(budget):
        loaded = load_gguf(qwen2moe_file, torch.float32, keep_quantized=True, lanes=True, expert_budget=budget)
        return Engine(loaded, dtype="float32", weights=choose_weights("gguf", "auto", True, activations="fp32"), kv_dtype="float32")

    resident, streamed = engine(None), engine(0)
    store, cfg = streamed.model.experts, streamed.config
    assert isinstance(store, StreamedExperts) and store.total_experts == cfg.num_layers * cfg.num_experts
    reader = FastGGUFReader(qwen2moe_file)
    exps = sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight"))
    assert store.file_bytes == exps, "the store maps the routed experts only"
    for layer in streamed.model.layers:
        assert layer.moe.shared is not None and layer.moe.shared.gate_up.out_features == 2 * 64
    ids = ids_of(40, seed=4)
    assert torch.equal(streamed.logits(ids), resident.logits(ids))
    s = store.stats
    assert len(store) == 0 and s.hits == 0
    assert s.rows == 40 * cfg.experts_per_token * cfg.num_layers, "the shared expert's rows are not counted"
    slab = sum(x.length for x in store._slabs[(0, 0)])
    assert s.bytes_read == s.misses * slab
