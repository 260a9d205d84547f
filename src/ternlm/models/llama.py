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
from .linear import Linear

# The KV cache and attention run in fp32 whatever the compute dtype: exact, and on this CPU faster than
# bf16 (PyTorch's bf16 SDPA took 1.9 ms per layer for one decode query over 2,000 keys, fp32 0.3 ms).
KV_DTYPE = torch.float32
ATTN_BLOCK = 256   # KV capacity and attended key count are multiples of this (see `attention`)


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


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              bias: torch.Tensor) -> torch.Tensor:
    """Batch-invariant causal attention [BATCH-INVARIANT].

    q: (H, T, D) queries of positions [start, start + T); k_cache/v_cache: (KV, capacity, D) fp32,
    capacity a multiple of ATTN_BLOCK; bias: (T, S) additive mask from `causal_bias`. -> (H, T, D) fp32.

    Why not SDPA: reuse must never change an answer, so the K/V a position gets must not depend on
    how the tokens were batched (one decode step, a 37-token tail, a 512-token chunk). PyTorch's CPU
    flash attention sums in an order that depends on the query count and offset, and in bf16 those
    last-bit differences flip near-tied greedy tokens (measured: 7 of 12 turns differed). Here every
    row is computed the same way whatever T and start are: keys are padded to a multiple of
    ATTN_BLOCK (masked keys add exact zeros), p @ V is reduced block by block, and a single query is
    doubled so the GEMMs never take their one-row path (bit-exact checks: tests/test_model.py,
    tests/test_reuse.py).
    """
    H, T, D = q.shape
    KV, S = k_cache.shape[0], bias.shape[1]
    G = H // KV
    qf = (q.to(k_cache.dtype) * D ** -0.5).view(KV, G, T, D)   # scale the T x D queries, not T x S scores
    Tq = max(T, 2)
    if T == 1:
        qf = qf.expand(KV, G, 2, D)
    scores = torch.matmul(qf.reshape(KV, G * Tq, D), k_cache[:, :S].transpose(1, 2))  # (KV, G Tq, S)
    scores = scores.view(KV, G, Tq, S).add_(bias if T > 1 else bias.expand(2, S))
    p = torch.softmax(scores, dim=-1)               # row-wise: masked keys give exact zeros
    # p @ V as per-block products summed over blocks: a GEMM over the whole key range would block
    # its reduction by S, so padding 256 -> 512 keys changed the bits; a fixed BLOCK-long reduction
    # per block plus a sum over blocks (trailing all-zero blocks add exact zeros) does not.
    nb = S // ATTN_BLOCK
    pb = p.view(KV, G * Tq, nb, ATTN_BLOCK).transpose(1, 2)                              # (KV, nb, G Tq, B)
    vb = v_cache[:, :S].view(KV, nb, ATTN_BLOCK, D)                                      # (KV, nb, B, D)
    out = torch.matmul(pb, vb).sum(1).view(KV, G, Tq, D)                                 # (KV, G, Tq, D)
    return out[:, :, :T].reshape(H, T, D)


def causal_bias(start: int, T: int, capacity: int) -> torch.Tensor:
    """(T, S) fp32 additive mask: 0 where key j <= start + i, -inf elsewhere; S = end rounded up to
    ATTN_BLOCK (never past capacity, which is itself a multiple of ATTN_BLOCK)."""
    end = start + T
    S = min(capacity, -(-end // ATTN_BLOCK) * ATTN_BLOCK)
    allowed = torch.arange(S).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    return torch.zeros(T, S).masked_fill_(~allowed, float("-inf"))


class Layer(nn.Module):
    """One decoder block. Holds fused, frozen projections (see linear.py) and its norms."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], pack: bool):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = w["input_layernorm.weight"]                          # (hidden,)
        self.post_norm = w["post_attention_layernorm.weight"]                  # (hidden,)
        self.qkv = Linear(torch.cat([w[f"self_attn.{n}_proj.weight"] for n in "qkv"]),  # (q + 2 kv, hidden)
                          torch.cat([w[f"self_attn.{n}_proj.bias"] for n in "qkv"]) if cfg.qkv_bias else None,
                          pack)
        self.q_norm = w["self_attn.q_norm.weight"] if cfg.qk_norm else None   # (head_dim,)
        self.k_norm = w["self_attn.k_norm.weight"] if cfg.qk_norm else None
        self.o = Linear(w["self_attn.o_proj.weight"], pack=pack)              # (hidden, q)
        self.gate_up = Linear(torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]), pack=pack)  # (2 I, hidden)
        self.down = Linear(w["mlp.down_proj.weight"], pack=pack)              # (hidden, I)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden). k_cache/v_cache: (kv_heads, capacity, head_dim) for this layer.
        Side effect: writes K/V of positions [start, start + T) into the caches."""
        cfg, T = self.cfg, x.shape[0]
        eps, d, H, KV = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv(rms_norm(x, self.input_norm, eps))                      # (T, q + 2 kv)
        qk = qkv[:, : self.q_size + self.kv_size].view(T, H + KV, d).transpose(0, 1)  # (H + KV, T, D)
        v = qkv[:, self.q_size + self.kv_size:].view(T, KV, d).transpose(0, 1)        # (KV, T, D)
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:H], self.q_norm, eps), rms_norm(qk[H:], self.k_norm, eps)])
        qk = apply_rope(qk, cos, sin)                                            # q and k in one pass
        end = start + T
        k_cache[:, start:end] = qk[H:]
        v_cache[:, start:end] = v
        # [0, start) earlier positions | [start, end) this call | [end, S) padding, masked
        attn = attention(qk[:H], k_cache, v_cache, start, bias)                   # (H, T, D) in KV_DTYPE
        x = x + self.o(attn.transpose(0, 1).reshape(T, self.q_size).to(x.dtype))
        g, u = self.gate_up(rms_norm(x, self.post_norm, eps)).chunk(2, dim=-1)  # (T, I) each
        return x + self.down(F.silu(g) * u)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16,
                 pack: bool = True):
        """Build from Hugging Face-named tensors (fused and cast here). Does not modify `weights`."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"missing weight {name!r}")
            return weights[name].to(dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")                              # (vocab, hidden)
        self.layers = [
            Layer(cfg, {k[len(p):]: w(k) for k in weights if k.startswith(p)}, pack)
            for p in (f"model.layers.{i}." for i in range(cfg.num_layers))
        ]
        self.norm = w("model.norm.weight")
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else w("lm_head.weight"), pack=pack)
        cos, sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)                        # (max_pos, head_dim)

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     pack: bool = True) -> "Transformer":
        return cls(cfg, weights, dtype, pack)

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
        if k_cache.shape[2] % ATTN_BLOCK:
            raise ValueError(f"KV capacity {k_cache.shape[2]} is not a multiple of {ATTN_BLOCK}")
        bias = causal_bias(start, T, k_cache.shape[2])
        for i, layer in enumerate(self.layers):
            x = layer(x, start, cos, sin, k_cache[i], v_cache[i], bias)
        if not all_logits:
            x = x[-1:]
        return self.lm_head(rms_norm(x, self.norm, self.cfg.rms_norm_eps)).float()
