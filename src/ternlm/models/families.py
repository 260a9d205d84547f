"""Model families as data (issue 60): each supported architecture's file conventions, one table entry each.

"Model families are data, layers are kinds": what a layer computes is ModelConfig's fields and layer kinds
(models/config.py); what differs between families is how their files spell it: names, fused tensors, row
orders, which config.json keys mean what, defaults a converter or a config class leaves implicit. Those
conventions are the fields of `Family` below; the loaders (models/gguf.py, models/hf.py) read
`FAMILIES[arch]` instead of branching on the architecture's name, so a new family is mostly one entry here
plus a parity test against transformers on a tiny random model (tests/test_arch_parity.py).

Imports nothing from ternlm (models/config.py builds SUPPORTED_ARCHS from this table).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    # The loader module that owns the family's tensor names, config reader and parameter check:
    # "llama" (gguf.py / hf.py themselves: the llama layout and its variants), "nemotron_h"
    # (models/nemotron_h.py: one block a layer) or "lfm2" (models/lfm2.py: short convs beside attention).
    # Why: those two families' layers are not the llama layout's (names by block / mixer), so a whole
    # different reader runs them.
    layout: str = "llama"
    # Per-layer kinds beyond the llama layout, and so the config reader: "" (none), "gemma3" (sliding-window
    # layers, GeGLU, post-norms, embedding scale...: hf._gemma3_config, gguf._layer_kinds_from_gguf) or
    # "deltanet" (gated DeltaNet layers among gated attention: hf._qwen35_config; a GGUF file says so itself
    # by its ssm.* keys). Why: config.json and GGUF metadata spell those kinds per family.
    kinds: str = ""
    # A GGUF-only name for another family's files (nemotron_h_moe: llama.cpp's converter names transformers 5's
    # Nemotron-H configs so, experts or not); it loads as that family, whose name config.arch then carries.
    # Why: not an architecture of its own, so not in SUPPORTED_ARCHS (config.arch is never it).
    alias_of: str = ""
    # config.json's model_type spellings other than the family's key (e.g. "qwen3_moe" for qwen3moe).
    hf_model_types: tuple[str, ...] = ()
    # config.json `architectures` classes that name the family when model_type is absent or unfamiliar.
    hf_classes: tuple[str, ...] = ()
    # config.json's sliding_window windows every layer (Mistral 7B v0.1, Phi-3-mini-4k): the context is
    # capped to it (windowed attention past it: issue 37). Why: qwen2/qwen3 configs write a sliding_window
    # too, which their use_sliding_window leaves off, so the key alone does not say.
    hf_window_caps_context: bool = False
    # The checkpoint stores each RMSNorm weight as an offset from 1 (run as x * (1 + w)); the engine runs
    # x * w (as llama.cpp's converter stores them), so 1 is added at load (but hf._NORMS_AS_THEY_ARE).
    hf_norms_from_one: bool = False
    # config.json's num_experts / num_local_experts make the MLP a mixture of experts (models/moe.py).
    # Why: other families' configs may carry such keys without running experts.
    hf_experts: bool = False
    # The config.json key of an expert's width: "moe_intermediate_size" (the qwen MoE families) or
    # "intermediate_size" (Mixtral, OLMoE: their experts are the dense MLP's width).
    hf_expert_width: str = "intermediate_size"
    # config.json's shared_expert_intermediate_size is read: one more, gated, expert every row uses
    # (qwen2moe, qwen35moe, qwen3next); a shared expert in another family is refused.
    hf_shared_expert: bool = False
    # norm_topk_prob when config.json does not say: the config class's default (transformers: False;
    # Qwen3NextConfig: True).
    hf_norm_topk_default: bool = False
    # The router renormalises its top-k weights whatever config.json says (Mixtral; qwen35moe, whose
    # config has no such key).
    hf_topk_renormed: bool = False
    # GGUF q/k rows are in the converter's rotate-every-two order (llama-named files, Mixtral's included;
    # undone by gguf.unpermute_rows). Why: llama.cpp's converter permutes them for llama only (not for
    # mistral-named files nor the other families).
    gguf_rotated_qk: bool = False
    # norm_topk_prob when the GGUF file has no expert_weights_norm: llama.cpp builds qwen2moe and olmoe
    # with norm_w = false (unnormalised top-k weights), llama / qwen3moe / qwen35moe renormalised.
    gguf_topk_normed: bool = True
    # GGUF DeltaNet V heads are in the converter's tiled order (its _LinearAttentionVReorderBase: qwen35,
    # qwen35moe); qwen3next's converter leaves them grouped as transformers has them. The file does not say.
    gguf_v_tiled: bool = False
    # GGUF q/k/v fused in attn_qkv and gate/up in ffn_up (gate rows first): split into the llama layout at
    # load (phi3). (A checkpoint's fused qkv_proj / gate_up_proj are split by their names in any family.)
    fused_qkv_gate_up: bool = False
    # The q/k RMSNorm runs over the whole q (H*D) / k (KV*D) projection, not per head (OLMoE):
    # ModelConfig.qk_norm_full when the model has q/k norms. Why: the norm weights' names are qwen3's.
    qk_norm_full: bool = False


# One entry per architecture, keyed by the name config.arch carries (GGUF general.architecture, or
# config.json's model_type as ours); the order is SUPPORTED_ARCHS' (error messages list it).
FAMILIES: dict[str, Family] = {
    "llama": Family(hf_classes=("LlamaForCausalLM",), gguf_rotated_qk=True),
    "qwen2": Family(hf_classes=("Qwen2ForCausalLM",)),
    "qwen3": Family(hf_classes=("Qwen3ForCausalLM",)),
    "phi3": Family(hf_classes=("Phi3ForCausalLM",), hf_window_caps_context=True, fused_qkv_gate_up=True),
    "mistral": Family(hf_classes=("MistralForCausalLM",), hf_window_caps_context=True),
    "qwen3moe": Family(hf_model_types=("qwen3_moe",), hf_classes=("Qwen3MoeForCausalLM",), hf_experts=True,
                       hf_expert_width="moe_intermediate_size"),
    "mixtral": Family(hf_classes=("MixtralForCausalLM",), hf_window_caps_context=True, hf_experts=True,
                      hf_topk_renormed=True),
    "gemma3": Family(kinds="gemma3", hf_model_types=("gemma3_text",), hf_classes=("Gemma3ForCausalLM",),
                     hf_norms_from_one=True),
    "qwen2moe": Family(hf_model_types=("qwen2_moe",), hf_classes=("Qwen2MoeForCausalLM",), hf_experts=True,
                       hf_expert_width="moe_intermediate_size", hf_shared_expert=True, gguf_topk_normed=False),
    "olmoe": Family(hf_classes=("OlmoeForCausalLM",), hf_experts=True, gguf_topk_normed=False, qk_norm_full=True),
    "qwen35": Family(kinds="deltanet", hf_model_types=("qwen3_5_text",), hf_classes=("Qwen3_5ForCausalLM",),
                     hf_norms_from_one=True, gguf_v_tiled=True),
    "qwen35moe": Family(kinds="deltanet", hf_model_types=("qwen3_5_moe_text",), hf_classes=("Qwen3_5MoeForCausalLM",),
                        hf_norms_from_one=True, hf_experts=True, hf_expert_width="moe_intermediate_size",
                        hf_shared_expert=True, hf_topk_renormed=True, gguf_v_tiled=True),
    "qwen3next": Family(kinds="deltanet", hf_model_types=("qwen3_next",), hf_classes=("Qwen3NextForCausalLM",),
                        hf_norms_from_one=True, hf_experts=True, hf_expert_width="moe_intermediate_size",
                        hf_shared_expert=True, hf_norm_topk_default=True),
    "nemotron_h": Family(layout="nemotron_h", hf_classes=("NemotronHForCausalLM",)),
    "lfm2": Family(layout="lfm2", hf_classes=("Lfm2ForCausalLM",)),
    "nemotron_h_moe": Family(layout="nemotron_h", alias_of="nemotron_h"),
}
