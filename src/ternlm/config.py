"""Model hyper-parameters, validated at construction (one dataclass, no dicts passed around)."""
from __future__ import annotations

from dataclasses import dataclass

from .models.rope import Rope

# phi3 and mistral run the llama layout: the loaders split phi3's fused q/k/v and gate/up into it,
# and mistral files are llama files (GGUF says "llama"; config.json says "mistral"). Mixtral is the
# llama layout with a mixture-of-experts MLP (GGUF says "llama" with expert tensors: the num_experts
# fields below, not the name, make a layer MoE); qwen3moe is qwen3's attention with experts.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "mistral", "qwen3moe", "mixtral")


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
    rope: Rope | None = None      # scaled or partial RoPE (models/rope.py); None: plain, theta rope_theta
    # Mixture of experts (models/moe.py); num_experts 0: a dense SwiGLU MLP of intermediate_size.
    # Otherwise every layer's MLP is a router over num_experts SwiGLU experts of
    # expert_intermediate_size, experts_per_token of them per row, weights softmax-then-top-k
    # (renormalised over the k when norm_topk_prob: Mixtral always, qwen3moe per its config).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

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
        if self.num_experts < 0 or self.experts_per_token < 0 or self.expert_intermediate_size < 0:
            raise ValueError("ModelConfig: expert counts and sizes must not be negative")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token {self.experts_per_token} must be in [1, num_experts "
                                 f"{self.num_experts}]")
            if self.expert_intermediate_size <= 0:
                raise ValueError("a mixture-of-experts model needs expert_intermediate_size > 0")
        elif self.experts_per_token or self.expert_intermediate_size:
            raise ValueError("experts_per_token / expert_intermediate_size given without num_experts")
        if self.rope is not None and (self.rope.theta != self.rope_theta or self.rope.rotary_dim > self.head_dim):
            raise ValueError(f"rope {self.rope} does not match rope_theta {self.rope_theta} / head_dim {self.head_dim}")
