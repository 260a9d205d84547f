"""Dense decoder-only transformer for the llama, qwen2 and qwen3 architectures.

A pure nn.Module: `forward(ids, start, k_cache, v_cache) -> logits`. It writes K/V for positions
[start, start + T) into the caches it is given and knows nothing about slots, records or HTTP;
recording what was written is the runner's job (runner.py).

Differences between the three architectures are two flags on ModelConfig:
  qwen2: bias on the q/k/v projections (qkv_bias)      qwen3: RMSNorm over head_dim on q and k (qk_norm)
Weights arrive with Hugging Face names and layouts; q/k/v and gate/up are fused here at load so a
layer is two matmuls for attention and two for the MLP.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 and cast back, as the reference implementation does: bf16 variance is too coarse.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_pos, head_dim) fp32, in the rotate-half (NeoX / Hugging Face) layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # (max_pos, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (heads, T, head_dim); cos/sin: (T, head_dim) already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.post_norm = nn.Parameter(torch.empty(h), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h), requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size), requires_grad=False)
                         if cfg.qkv_bias else None)
        self.q_norm = nn.Parameter(torch.empty(d), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(d), requires_grad=False) if cfg.qk_norm else None
        self.o = nn.Parameter(torch.empty(h, self.q_size), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x: (T, hidden). k_cache/v_cache: (kv_heads, capacity, head_dim) for this layer.
        Side effect: writes K/V of positions [start, start + T) into the caches."""
        cfg, T = self.cfg, x.shape[0]
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        hn = rms_norm(x, self.input_norm, eps)
        qkv = F.linear(hn, self.qkv, self.qkv_bias)                              # (T, q + 2 kv)
        q = qkv[:, : self.q_size].view(T, cfg.num_heads, d).transpose(0, 1)     # (H, T, D)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, cfg.num_kv_heads, d).transpose(0, 1)
        v = qkv[:, self.q_size + self.kv_size:].view(T, cfg.num_kv_heads, d).transpose(0, 1)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        end = start + T
        k_cache[:, start:end] = k
        v_cache[:, start:end] = v
        # [0, start) earlier positions | [start, end) this call. The mask is explicit because SDPA's
        # is_causal aligns top-left, which is wrong when there are fewer queries than keys.
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(0), k_cache[:, :end].unsqueeze(0), v_cache[:, :end].unsqueeze(0),
            attn_mask=mask, enable_gqa=True,
        )                                                                        # (1, H, T, D)
        x = x + F.linear(attn[0].transpose(0, 1).reshape(T, self.q_size), self.o)
        hn = rms_norm(x, self.post_norm, eps)
        gu = F.linear(hn, self.gate_up)                                         # (T, 2 I)
        g, u = gu.chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, self.down)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.register_buffer("cos", cos.to(dtype), persistent=False)   # (max_pos, head_dim)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self.to(dtype)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype) -> "Transformer":
        """Build from Hugging Face-named tensors. Fuses q/k/v and gate/up. Does not modify `weights`."""
        model = cls(cfg, dtype)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"missing weight {name!r}")
            return weights[name].to(dtype)

        with torch.no_grad():
            model.embed.copy_(w("model.embed_tokens.weight"))
            model.norm.copy_(w("model.norm.weight"))
            if not cfg.tie_word_embeddings:
                model.lm_head.copy_(w("lm_head.weight"))
            for i, layer in enumerate(model.layers):
                p = f"model.layers.{i}."
                layer.input_norm.copy_(w(p + "input_layernorm.weight"))
                layer.post_norm.copy_(w(p + "post_attention_layernorm.weight"))
                layer.qkv.copy_(torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                if layer.q_norm is not None:
                    layer.q_norm.copy_(w(p + "self_attn.q_norm.weight"))
                    layer.k_norm.copy_(w(p + "self_attn.k_norm.weight"))
                layer.o.copy_(w(p + "self_attn.o_proj.weight"))
                layer.gate_up.copy_(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]))
                layer.down.copy_(w(p + "mlp.down_proj.weight"))
        return model.eval()

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (T,) int64 -> (T, hidden) in the compute dtype."""
        return F.embedding(ids, self.embed)

    def forward(self, x: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """x: (T, hidden) input embeddings of positions [start, start + T).
        k_cache/v_cache: (layers, kv_heads, capacity >= start + T, head_dim).
        Returns fp32 logits (T, vocab) when all_logits, else (1, vocab) for the last position only
        (a 1024-token prefill would otherwise spend more on the LM head than on attention).
        Side effect: writes K/V of positions [start, start + T) into the caches; nothing else."""
        T = x.shape[0]
        end = start + T
        if end > self.cfg.max_position_embeddings:
            raise ValueError(f"position {end} beyond the model's context {self.cfg.max_position_embeddings}")
        cos, sin = self.cos[start:end], self.sin[start:end]
        mask = None
        if T > 1:
            # query i (absolute start + i) sees keys j <= start + i
            mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)  # (T, end)
        for i, layer in enumerate(self.layers):
            x = layer(x, start, cos, sin, k_cache[i], v_cache[i], mask)
        if not all_logits:
            x = x[-1:]
        return F.linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.lm_head).float()
