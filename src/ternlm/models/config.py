"""Model hyper-parameters, validated at construction (one dataclass, no dicts passed around)."""
from __future__ import annotations

from dataclasses import dataclass

from .families import FAMILIES
from .rope import Rope

# phi3 and mistral run the llama layout: the loaders split phi3's fused q/k/v and gate/up into it,
# and mistral files are llama files (GGUF says "llama"; config.json says "mistral"). Mixtral is the
# llama layout with a mixture-of-experts MLP (GGUF says "llama" with expert tensors: the num_experts
# fields below, not the name, make a layer MoE); qwen3moe is qwen3's attention with experts;
# qwen2moe is qwen2's (q/k/v bias) with experts plus a gated shared expert; olmoe is llama's with
# q/k RMSNorm over the whole projection width (qk_norm_full).
# gemma3 (text) is the llama layout plus per-layer kinds (the fields after norm_topk_prob below).
# qwen35 (Qwen3.5, issue 47) is hybrid: most layers are gated DeltaNet (a recurrent state, models/deltanet.py),
# every few a gated attention layer (qwen3's with an output gate and partial RoPE): layer_kinds below.
# qwen35moe (Qwen3.5-MoE) is qwen35's layer kinds with qwen2moe's MLP (experts + a gated shared expert) on
# every layer, whatever its kind: the two field groups together, no code of its own.
# qwen3next (Qwen3-Next) is qwen35moe's layers and MLP again: its fused DeltaNet projections are split into qwen35's
# at load (models/deltanet.fused_rows), its router renormalises per its config; no fields of its own.
# nemotron_h (Nemotron-H, issue 47): each layer ONE block behind its pre-norm: a Mamba-2 mixer
# (models/mamba2.py), attention without RoPE, or a relu^2 MLP: layer_kinds (mixer) + layer_ffns (feed-forward).
# lfm2 (LFM2, issue 47): gated short convolutions (models/shortconv.py) beside qwen3-like attention (q/k norms),
# a SwiGLU MLP on every layer (models/lfm2.py: names and config).
# Each family's file conventions are one entry of models/families.py's FAMILIES (issue 60); the architectures
# are its keys but the GGUF-only aliases (nemotron_h_moe: files that load as nemotron_h).
SUPPORTED_ARCHS = tuple(arch for arch, family in FAMILIES.items() if not family.alias_of)
LAYER_KINDS = ("attention", "deltanet", "mamba2", "shortconv", "none")   # a layer's token mixer; "none": none
RECURRENT_KINDS = ("deltanet", "mamba2", "shortconv")        # mixers with a recurrent state (kv/recurrent.py)
LAYER_FFNS = ("mlp", "none")       # a layer's feed-forward: the model's MLP (or its experts), or none
MLP_ACTS = ("silu", "gelu_tanh", "relu2")   # SwiGLU, GeGLU (gelu, tanh approximation); relu2: up -> relu(x)^2 -> down, no gate


class UnsupportedModelError(ValueError):
    """The file describes a model this engine cannot run (architecture, quant type, rope kind)."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str                     # one of SUPPORTED_ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False        # qwen2: bias on q/k/v projections
    qk_norm: bool = False         # qwen3: RMSNorm over head_dim on q and k
    qk_norm_full: bool = False    # olmoe: that RMSNorm over the whole q (H*D) / k (KV*D) projection instead
    rope: Rope | None = None      # scaled or partial RoPE (models/rope.py); None: plain, theta rope_theta
    # Mixture of experts (models/moe.py); num_experts 0: a dense SwiGLU MLP of intermediate_size.
    # Otherwise every layer's MLP is a router over num_experts SwiGLU experts of
    # expert_intermediate_size, experts_per_token of them per row, weights softmax-then-top-k
    # (renormalised over the k when norm_topk_prob: Mixtral always, qwen3moe per its config).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # qwen2moe, qwen35moe: one more SwiGLU expert of this width that every row uses, added after the routed sum
    # times sigmoid(shared gate . h) (models/moe.py [SUM-ORDER]); 0: none
    shared_expert_intermediate_size: int = 0
    # Per-layer kinds (issue 37; Gemma 3, and any sliding-window layout on the same mechanism).
    # layer_windows[i]: layer i's attention window W: a query at t reads keys (t - W, t], W keys
    # including its own (transformers' `kv_idx > q_idx - W`); 0: full causal. (): every layer full.
    # The KV keeps every position on every layer whatever the window (models/llama.py, [SWA-KV]).
    layer_windows: tuple[int, ...] = ()
    swa_rope: Rope | None = None  # RoPE of the windowed layers (Gemma 3: plain, base 10k); None: `rope_spec`
    post_norms: bool = False      # RMSNorm on the attention and the MLP outputs before each residual add
    mlp_act: str = "silu"         # one of MLP_ACTS
    embed_scale: float = 1.0      # token embeddings times this, cast to the compute dtype (Gemma: sqrt(hidden))
    query_scale: float = 0.0      # q scale in attention; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    final_logit_softcap: float = 0.0   # > 0: logits = c * tanh(logits / c) (Gemma 2 style)
    # Hybrid models (issue 47). layer_kinds[i]: "attention" or "deltanet" (a gated DeltaNet layer: short
    # causal conv of kernel linear_conv_kernel over q|k|v, then the gated delta rule with linear_key_heads
    # q/k heads of linear_key_dim and linear_value_heads value heads of linear_value_dim); (): all attention.
    layer_kinds: tuple[str, ...] = ()
    attn_output_gate: bool = False     # attention output * sigmoid(gate) before o (qwen35: gate rows in q_proj)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # value head h reads key head h % linear_key_heads (llama.cpp's converter's "tiled" order) instead of
    # h // (value heads / key heads) (transformers' grouped order): a GGUF's V heads, reordered by its converter
    linear_v_tiled: bool = False
    # nemotron_h (issue 47). layer_ffns[i]: "mlp" | "none" (() every layer has one: its MLP or experts);
    # no_rope: attention layers see no positions (q, k not rotated). A "mamba2" mixer: in_proj -> z (H P),
    # xBC (H P + 2 G N), dt (H); short causal conv (kernel mamba_conv_kernel, bias) + SiLU; the SSD recurrence
    # with mamba_heads H of mamba_head_dim P, state mamba_state N, B/C shared by mamba_groups G; dt =
    # max(softplus(dt + bias), mamba_dt_min) (transformers' prefill clamps at time_step_min; llama.cpp: 0).
    layer_ffns: tuple[str, ...] = ()
    no_rope: bool = False
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_conv_kernel: int = 0
    mamba_dt_min: float = 0.0
    # lfm2 (issue 47): a "shortconv" mixer: in_proj -> B | C | x (hidden each); C * causal depthwise conv(B * x)
    # (kernel shortconv_kernel, no bias) -> out_proj
    shortconv_kernel: int = 0

    def kind(self, layer: int) -> str:
        """Layer `layer`'s token mixer: "attention" | "deltanet" | "mamba2" | "shortconv" | "none"."""
        return self.layer_kinds[layer] if self.layer_kinds else "attention"

    def ffn(self, layer: int) -> str:
        """Layer `layer`'s feed-forward: "mlp" (the dense MLP, or experts when num_experts) | "none"."""
        return self.layer_ffns[layer] if self.layer_ffns else "mlp"

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state, in order (their index into a slot's RecurrentState)."""
        return tuple(i for i in range(self.num_layers) if self.kind(i) in RECURRENT_KINDS)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with attention, in order: their index here is their place in a slot's KV (kv/slots.py),
        so a hybrid model's KV holds no recurrent or feed-forward-only layer. Every layer when no layer_kinds."""
        return tuple(i for i in range(self.num_layers) if self.kind(i) == "attention")

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window; 0: full causal attention."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope(self, layer: int) -> Rope:
        """The RoPE layer `layer` runs: `swa_rope` on windowed layers when set, else `rope_spec`."""
        return self.swa_rope if self.swa_rope is not None and self.window(layer) else self.rope_spec

    @property
    def q_scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    @property
    def rope_spec(self) -> Rope:
        return self.rope if self.rope is not None else Rope(theta=self.rope_theta)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if min(self.num_experts, self.experts_per_token, self.expert_intermediate_size,
               self.shared_expert_intermediate_size) < 0:
            raise ValueError("ModelConfig: expert counts and sizes must not be negative")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token {self.experts_per_token} must be in [1, num_experts "
                                 f"{self.num_experts}]")
            if self.expert_intermediate_size <= 0:
                raise ValueError("a mixture-of-experts model needs expert_intermediate_size > 0")
        elif self.experts_per_token or self.expert_intermediate_size or self.shared_expert_intermediate_size:
            raise ValueError("experts_per_token / expert_intermediate_size / shared_expert_intermediate_size "
                             "given without num_experts")
        if self.qk_norm_full and not self.qk_norm:
            raise ValueError("qk_norm_full needs qk_norm")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows {self.layer_windows} must give each of {self.num_layers} layers "
                             f"a window >= 0")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"mlp_act {self.mlp_act!r} is not one of {', '.join(MLP_ACTS)}")
        if self.embed_scale <= 0 or self.query_scale < 0 or self.final_logit_softcap < 0:
            raise ValueError("embed_scale must be positive; query_scale and final_logit_softcap not negative")
        if self.swa_rope is not None and self.swa_rope.rotary_dim > self.head_dim:
            raise ValueError(f"swa_rope {self.swa_rope} does not fit head_dim {self.head_dim}")
        if self.layer_kinds and (len(self.layer_kinds) != self.num_layers
                                 or any(k not in LAYER_KINDS for k in self.layer_kinds)):
            raise ValueError(f"layer_kinds {self.layer_kinds} must give each of {self.num_layers} layers one of "
                             f"{', '.join(LAYER_KINDS)}")
        if self.layer_ffns and (len(self.layer_ffns) != self.num_layers or set(self.layer_ffns) - set(LAYER_FFNS)):
            raise ValueError(f"layer_ffns {self.layer_ffns} must give each of {self.num_layers} layers one of "
                             f"{', '.join(LAYER_FFNS)}")
        mamba = [i for i in range(self.num_layers) if self.kind(i) == "mamba2"]
        if len({self.kind(i) for i in self.recurrent_layers}) > 1:
            raise ValueError("a model's recurrent layers must be all one kind (one state shape)")
        conv = [i for i in range(self.num_layers) if self.kind(i) == "shortconv"]
        if conv and self.shortconv_kernel < 2:
            raise ValueError("shortconv layers need a kernel of at least 2")
        if mamba and (min(self.mamba_heads, self.mamba_head_dim, self.mamba_state, self.mamba_groups,
                          self.mamba_conv_kernel) <= 0 or self.mamba_heads % self.mamba_groups
                      or self.mamba_dt_min < 0):
            raise ValueError("mamba2 layers need positive mamba_* sizes, heads a multiple of groups")
        if self.mlp_act == "relu2" and self.num_experts:
            raise ValueError("relu2 (ungated) MLPs are dense only here: experts are SwiGLU")
        if self.recurrent_layers and not mamba and not conv and (min(self.linear_key_heads, self.linear_value_heads, self.linear_key_dim,
                                          self.linear_value_dim, self.linear_conv_kernel) <= 0
                                      or self.linear_value_heads % self.linear_key_heads):
            raise ValueError("deltanet layers need positive linear_* sizes, value heads a multiple of key heads")
        if self.rope is not None and (self.rope.theta != self.rope_theta or self.rope.rotary_dim > self.head_dim):
            raise ValueError(f"rope {self.rope} does not match rope_theta {self.rope_theta} / head_dim {self.head_dim}")
