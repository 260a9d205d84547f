"""Model hyper-parameters, validated at construction (one dataclass, no dicts passed around)."""
from __future__ import annotations

from dataclasses import dataclass

from .models.rope import Rope

# phi3 and mistral run the llama layout: the loaders split phi3's fused q/k/v and gate/up into it,
# and mistral files are llama files (GGUF says "llama"; config.json says "mistral").
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "mistral")


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
        if self.rope is not None and (self.rope.theta != self.rope_theta or self.rope.rotary_dim > self.head_dim):
            raise ValueError(f"rope {self.rope} does not match rope_theta {self.rope_theta} / head_dim {self.head_dim}")
