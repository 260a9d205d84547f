"""Dense decoder-only transformer for the llama, qwen2 and qwen3 architectures.

A pure nn.Module: `forward(ids, start, k_cache, v_cache) -> logits`, and `forward_batch(x, segments)`
for the rows of many sequences at once (continuous batching: each segment is one sequence's rows and
its own KV). It writes K/V for positions [start, start + T) into the caches it is given and knows
nothing about slots, records or HTTP; recording what was written is the runner's job (runner.py).

Batching without changing bits [BATCH-INVARIANT]: the projections, norms, RoPE and the MLP are
row-wise (linear.py: a row's result does not depend on the other rows), so they run once over all
rows concatenated (elementwise ops and last-dim reductions give each row the same bits whatever the
row count); the KV write and attention run per segment, and attention copies its inputs into the
layouts a lone sequence's would have, so a sequence's logits and KV are the same alone or in company.

Differences between the architectures are fields on ModelConfig, not branches on the name:
  qwen2: bias on the q/k/v projections (qkv_bias)      qwen3: RMSNorm over head_dim on q and k (qk_norm)
  per layer: attention window (layer_windows, 0 = full) and RoPE (swa_rope on windowed layers)
  post_norms: RMSNorm on the attention and MLP outputs before the residual adds (Gemma's 4 norms)
  mlp_act: SwiGLU or GeGLU; embed_scale, query_scale, final_logit_softcap (Gemma 3 sets them)
The MLP is one of two kinds: a dense gated MLP, or mixture of experts (num_experts > 0: qwen3moe,
Mixtral, qwen2moe with its shared expert, olmoe; models/moe.py, batch-invariant by its fixed top-k
ties and sum order). olmoe's q/k norms span the whole projection (qk_norm_full), not each head.
The token mixer is a kind (layer_kinds): attention, a gated DeltaNet (models/deltanet.py: qwen35), Mamba-2
(models/mamba2.py: nemotron_h) or LFM2's gated short conv (models/shortconv.py: lfm2); the MLP kind is
independent of it (qwen35moe: both kinds with experts on every layer).

Sliding-window layers [SWA-KV]: the KV keeps EVERY position on every layer, windowed or not; a windowed
layer only reads fewer keys (torch: the mask; native: attention.c starts at the window's first block).
So truncating to any reuse point k stays exact exactly as for full layers (position < k never depends
on a later token), with no ring buffer, snapshots or "cache too short" miss. The cost: a windowed
layer's KV is as large as a global one's, 2 * kv_heads * head_dim * 4 bytes a position a layer in fp32
(gemma3-270m: 18 layers * 2 KiB = 36 KiB a token; 18 KiB in the fp16 cache its fused layers get with
--kv-dtype auto). A ring of the window plus snapshots at turn boundaries would cut the 15 local layers' share (W * 2 KiB each) and is future work (issue 37).
Weights arrive with Hugging Face names and layouts; q/k/v and gate/up are fused here at load so a
layer is two matmuls for attention and two for the MLP.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from ..invariants import check
from ..malloc import release_freed
from ..kernels.build import Kernels
from ..kv.kvtype import KV_TYPES, KVType, kv_type
from .moe import ExpertStore, MoE, SharedExpert, silu_mul
from ..linear.qlinear import projection
from .recurrent.deltanet import DeltaNet
from .recurrent.mamba2 import Mamba2
from .recurrent.shortconv import ShortConv
from ..linear.qweight import QWeight, to_int8, to_lanes

if TYPE_CHECKING:
    from .native_layer import NativeLayer

log = logging.getLogger("ternlm")

# Attention computes in fp32 whatever the compute dtype: exact, and on this CPU faster than bf16
# (PyTorch's bf16 SDPA took 1.9 ms per layer for one decode query over 2,000 keys, fp32 0.3 ms). The
# cache is fp32 too, except fp16 where every layer runs fused in C, or what --kv-dtype names
# (`Transformer.kv_type`, kv/kvtype.py: float16 and q8_0 where attention runs in C).
KV_DTYPE = torch.float32          # the torch attention's dtype, and the caches' default
ATTN_BLOCK = 256   # KV capacity and attended key count are multiples of this (see `attention`)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in fp32 and cast back, as the reference implementation does: bf16 variance is too coarse.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (heads, T, head_dim); cos/sin: (T, head_dim) already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              bias: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Batch-invariant causal attention [BATCH-INVARIANT].

    q: (H, T, D) queries of positions [start, start + T); k_cache/v_cache: (KV, capacity, D) fp32,
    capacity a multiple of ATTN_BLOCK; bias: (T, S) additive mask from `causal_bias` (a window's too);
    scale: on q (None: D ** -0.5). -> (H, T, D) fp32.

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
    qf = (q.to(k_cache.dtype) * (D ** -0.5 if scale is None else scale)).view(KV, G, T, D)   # scale the T x D queries, not T x S scores
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


def native_attention(kernels: Kernels, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     start: int) -> torch.Tensor:
    """The same causal attention by kernels/attention.c: q (H, T, D) of positions [start, start + T);
    k_cache/v_cache (KV, capacity, D) fp32 contiguous. -> (T, H * D) fp32, the o projection's layout.
    Batch-invariant by construction: every query row reads exactly its keys [0, position], in fixed
    256-key blocks with an online softmax, so nothing depends on T, start or the neighbours; the
    masked triangle is never computed and no (T x S) buffer exists (see attention.c)."""
    H, T, D = q.shape
    # raw pointers go to C: shapes, dtype and layout are checked here, not trusted
    check(k_cache.dtype == v_cache.dtype == KV_DTYPE and k_cache.is_contiguous() and v_cache.is_contiguous()
          and k_cache.shape == v_cache.shape and k_cache.shape[2] == D and start + T <= k_cache.shape[1]
          and H % k_cache.shape[0] == 0, "native attention: caches do not match the queries")
    qs = (q.to(KV_DTYPE) * D ** -0.5).contiguous()    # (H, T, D): the same scaling as `attention`
    out = torch.empty(T, H * D, dtype=KV_DTYPE)
    kernels.attention(qs.data_ptr(), T, H, k_cache.shape[0], D, k_cache.data_ptr(), v_cache.data_ptr(),
                      k_cache.shape[1], start, out.data_ptr(), H * D, torch.get_num_threads())
    return out


def segment_table(segments: list["Segment"], cfg: ModelConfig, kv: KVType = KV_TYPES["float32"]) -> torch.Tensor:
    """(n, 6) int64 for kernels/attention.c's tq_attention_segments: per segment its first row, rows,
    start position, cache capacity and the addresses of its K and V caches (attention layers, KV, cap,
    kv.width(D)) in kv's format. Raw addresses go to C, so the caches' dtype and layout are checked here, not
    trusted."""
    rows, r0 = [], 0
    for s in segments:
        shape = (len(cfg.attention_layers), cfg.num_kv_heads, s.k_cache.shape[2], kv.width(cfg.head_dim))
        check(s.k_cache.dtype == s.v_cache.dtype == kv.storage and s.k_cache.is_contiguous()
              and s.v_cache.is_contiguous() and tuple(s.k_cache.shape) == tuple(s.v_cache.shape) == shape
              and s.start + s.length <= shape[2], "native attention: a segment's caches do not fit")
        rows.append((r0, s.length, s.start, s.k_cache.shape[2], s.k_cache.data_ptr(), s.v_cache.data_ptr()))
        r0 += s.length
    return torch.tensor(rows, dtype=torch.int64)


def causal_bias(start: int, T: int, capacity: int, window: int = 0) -> torch.Tensor:
    """(T, S) fp32 additive mask: 0 where key j <= start + i (and, with a window W > 0, j > start + i - W:
    the W keys ending at the query's own, as transformers' sliding mask), -inf elsewhere; S = end
    rounded up to ATTN_BLOCK (never past capacity, which is itself a multiple of ATTN_BLOCK)."""
    end = start + T
    S = min(capacity, -(-end // ATTN_BLOCK) * ATTN_BLOCK)
    keys, pos = torch.arange(S).unsqueeze(0), torch.arange(start, end).unsqueeze(1)
    allowed = keys <= pos
    if window:
        allowed &= keys > pos - window
    return torch.zeros(T, S).masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a batched forward: positions [start, start + length) of its own KV.
    logits: which of its rows need logits: "last" (sampling) | "all" (scoring) | "none" (a prefill
    chunk that does not end the prompt: the LM head is skipped)."""
    start: int
    length: int
    k_cache: torch.Tensor     # (attention layers, kv_heads, capacity, head_dim), capacity >= start + length
    v_cache: torch.Tensor
    logits: str = "last"
    # hybrid models (deltanet.py): the sequence's kv/recurrent.RecurrentState at `start`, advanced by the
    # forward; captures: {position: (conv, ssm)} tensors shaped as the state's, filled with the state there
    state: object = None
    captures: dict | None = None


@dataclass(frozen=True)
class _Part:
    """A segment as one layer sees it: rows [r0, r1) of the batch and that layer's KV."""
    r0: int
    r1: int
    start: int
    bias: torch.Tensor | None  # (T, S) from causal_bias; None with the native attention
    k_cache: torch.Tensor | None    # (kv_heads, capacity, head_dim); None: a layer without attention
    v_cache: torch.Tensor | None
    state: object = None      # Segment.state, Segment.captures (recurrent layers)
    captures: dict | None = None


class Layer(nn.Module):
    """One decoder block. Holds fused, frozen projections (see linear.py) and its norms."""

    def __init__(self, cfg: ModelConfig, w: dict[str, "torch.Tensor | QWeight"], pack: bool,
                 kernels: Kernels | None = None, keep_quantized: bool = False, index: int = 0,
                 experts: ExpertStore | None = None):
        """w: this layer's weights (tensors in the compute dtype, or QWeights: see qlinear.projection).
        kernels: the native kernels (kernels/): attention.c when given, qlanes.c (qamx.c with TERNLM_AMX=1) for QWeights when
        also keep_quantized; None: torch attention, QWeights dequantized.
        experts: where a mixture-of-experts layer puts its experts (models/moe.py; the model's one
        store); None: a store of its own."""
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.index = index              # this layer's place in the model (the expert store's key)
        # its place in the slots' caches, which hold attention layers only (config.attention_layers); None:
        # a recurrent or feed-forward-only layer, no KV
        self.kv_index = cfg.attention_layers.index(index) if cfg.kind(index) == "attention" else None
        self.window = cfg.window(index)  # attention window, 0: full [SWA-KV]
        self.kv_type = KV_TYPES["float32"]   # the caches' format: Transformer sets the model's
        self.q_scale = cfg.q_scale
        self.rope = 0                   # which of the model's RoPE tables (Transformer.ropes) this layer reads
        d = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        # nemotron_h: a layer may be a mixer alone (no MLP norm) or a feed-forward alone (no input norm)
        dtype = w.get("input_layernorm.weight", w.get("post_attention_layernorm.weight")).dtype
        ffn = cfg.ffn(index) != "none"

        def build(parts: list, bias: torch.Tensor | None = None):   # holds no weights (streamed experts keep it)
            return projection(parts, bias, dtype, pack, kernels if keep_quantized else None)

        def proj(names: list[str], bias: torch.Tensor | None = None):
            return build([w[n] for n in names], bias)

        self.input_norm = w.get("input_layernorm.weight")                      # (hidden,); None: no mixer
        # silu(gate) * up of the MLP or its experts. [ROW-EXACT] hybrid models: per element (recurrent.c, fp32,
        # cast back): a recurrent state keeps any bit a row's neighbours changed, and torch's SiLU gives a
        # buffer's tail other bits (deltanet.py)
        self.silu_mul = functools.partial(_row_exact_silu_mul, kernels) if cfg.layer_kinds else silu_mul
        self.mixer: DeltaNet | Mamba2 | ShortConv | None = None
        if cfg.kind(index) == "deltanet":     # a recurrent token mixer in place of attention (deltanet.py)
            self.mixer = DeltaNet(cfg, w, build, cfg.recurrent_layers.index(index), kernels)
        elif cfg.kind(index) == "mamba2":     # Nemotron-H's recurrent mixer (mamba2.py)
            self.mixer = Mamba2(cfg, w, build, cfg.recurrent_layers.index(index), kernels)
        elif cfg.kind(index) == "shortconv":  # LFM2's gated short convolution (shortconv.py)
            self.mixer = ShortConv(cfg, w, build, cfg.recurrent_layers.index(index))
        # post_norm: the MLP's input norm (llama's post_attention_layernorm; Gemma's
        # pre_feedforward_layernorm, whose post_attention_layernorm normalises the attention output)
        self.attn_out_norm = w["post_attention_layernorm.weight"] if cfg.post_norms else None   # (hidden,)
        self.mlp_out_norm = w["post_feedforward_layernorm.weight"] if cfg.post_norms else None
        self.post_norm = w["pre_feedforward_layernorm.weight" if cfg.post_norms else
                           "post_attention_layernorm.weight"] if ffn else None  # (hidden,)
        attn = cfg.kind(index) == "attention"
        # q | k | v (| qwen35's output gate, q's size): (q + 2 kv (+ q), hidden)
        names = [f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "gate")[:4 if cfg.attn_output_gate else 3]]
        self.qkv = proj(names, torch.cat([w[f"self_attn.{n}_proj.bias"] for n in "qkv"])
                        if cfg.qkv_bias and not cfg.attn_output_gate else None) if attn else None
        self.q_norm = w["self_attn.q_norm.weight"] if cfg.qk_norm and attn else None   # (head_dim,)
        self.k_norm = w["self_attn.k_norm.weight"] if cfg.qk_norm and attn else None
        self.o = proj(["self_attn.o_proj.weight"]) if attn else None          # (hidden, q)
        self.moe: MoE | None = None
        self.up = None                  # relu2's ungated up projection (nemotron_h)
        if not ffn:                     # a mixer-only layer (nemotron_h)
            self.gate_up = self.down = None
            return
        if cfg.mlp_act == "relu2":      # up -> relu(x)^2 -> down, no gate
            self.gate_up = None
            self.up = proj(["mlp.up_proj.weight"])                            # (I, hidden)
            self.down = proj(["mlp.down_proj.weight"])                        # (hidden, I)
            return
        if cfg.num_experts:             # the MLP kind: experts behind a router (moe.py), no dense MLP
            self.gate_up = self.down = None
            self.moe = self._experts(w, build, pack, ExpertStore() if experts is None else experts)
            return
        self.gate_up = proj(["mlp.gate_proj.weight", "mlp.up_proj.weight"])   # (2 I, hidden)
        self.down = proj(["mlp.down_proj.weight"])                            # (hidden, I)

    def _experts(self, w: dict, build, pack: bool, store: ExpertStore) -> MoE:
        """Each expert's gate|up (2 I, hidden) and down (hidden, I) into `store`; the router stays here.
        A streamed store (moe.StreamedExperts) reads experts later and builds them with this `build`."""
        if store.streamed:
            store.bind(self.index, build)
        for e in range(0 if store.streamed else self.cfg.num_experts):
            parts = [w[f"mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down")]
            nbytes = sum(p.nbytes if isinstance(p, QWeight) else p.numel() * p.element_size() for p in parts)
            store.put(self.index, e, build(parts[:2]), build(parts[2:]), nbytes)
        shared = None
        if self.cfg.shared_expert_intermediate_size:     # qwen2moe, qwen35moe: dense, every row: held here, not in the store
            shared = SharedExpert(build([w["mlp.shared_expert.gate_proj.weight"], w["mlp.shared_expert.up_proj.weight"]]),
                                  build([w["mlp.shared_expert.down_proj.weight"]]), w["mlp.shared_expert_gate.weight"])
        return MoE(w["mlp.gate.weight"], self.cfg.experts_per_token, self.cfg.norm_topk_prob, store,
                   self.index, pack, shared, self.silu_mul)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[_Part],
                table: torch.Tensor | None = None) -> torch.Tensor:
        """x: (M, hidden), the rows of every part in order; cos/sin: (M, head_dim), each row's
        position; table: `segment_table` of the parts (native attention only). Side effect: writes
        K/V of each part's positions into that part's caches. Everything row-wise (projections,
        norms, RoPE, MLP) runs once over all M rows; the KV write runs per part, attention per part
        (torch) or for all parts in one native call (each row computed exactly as alone)."""
        cfg, M = self.cfg, x.shape[0]
        eps, d, H, KV = cfg.rms_norm_eps, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if self.mixer is not None:      # a recurrent layer: each part's state instead of its KV
            x = x + self.mixer(rms_norm(x, self.input_norm, eps), parts)
            return self._ffn(x)
        if self.qkv is None:            # no token mixer: a feed-forward-only layer (nemotron_h)
            return self._ffn(x)
        qkv = self.qkv(rms_norm(x, self.input_norm, eps))                      # (M, q + 2 kv (+ q))
        if cfg.qk_norm_full:            # olmoe: one RMSNorm over all of q, one over all of k, before the heads split
            qs, ks = self.q_size, self.kv_size
            qkv = torch.cat([rms_norm(qkv[:, :qs], self.q_norm, eps), rms_norm(qkv[:, qs:qs + ks], self.k_norm, eps),
                             qkv[:, qs + ks:]], dim=1)
        qk = qkv[:, : self.q_size + self.kv_size].view(M, H + KV, d).transpose(0, 1)  # (H + KV, M, D)
        v = qkv[:, self.q_size + self.kv_size:self.q_size + 2 * self.kv_size].view(M, KV, d).transpose(0, 1)  # (KV, M, D)
        if self.q_norm is not None and not cfg.qk_norm_full:
            qk = torch.cat([rms_norm(qk[:H], self.q_norm, eps), rms_norm(qk[H:], self.k_norm, eps)])
        if not cfg.no_rope:             # nemotron_h's attention sees no positions
            qk = apply_rope(qk, cos, sin)                                        # q and k in one pass
        if table is not None:
            for p in parts:                                                      # the KV write, per slot
                p.k_cache[:, p.start:p.start + p.r1 - p.r0] = self._kv_rows(qk[H:, p.r0:p.r1], keys=True)
                p.v_cache[:, p.start:p.start + p.r1 - p.r0] = self._kv_rows(v[:, p.r0:p.r1], keys=False)
            attn = self._attend_all(qk[:H], table)                              # (M, q)
        else:
            outs = [self._attend(qk[:, p.r0:p.r1], v[:, p.r0:p.r1], p) for p in parts]   # (T_i, q) each
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)              # (M, q)
        attn = attn.to(x.dtype)
        if cfg.attn_output_gate:        # qwen35: each output times sigmoid of its gate row [ROW-EXACT]
            attn = attn * self.kernels.pointwise("sigmoid", qkv[:, self.q_size + 2 * self.kv_size:]).to(attn.dtype)
        a = self.o(attn)
        x = x + (a if self.attn_out_norm is None else rms_norm(a, self.attn_out_norm, eps))
        return self._ffn(x)

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        """x plus the feed-forward half's output, or x itself where the layer has none (nemotron_h)."""
        return x if self.down is None and self.moe is None else x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP half's output (before the residual add): experts or the gated MLP."""
        eps = self.cfg.rms_norm_eps
        if self.up is not None:         # relu^2, per element: exact IEEE ops, so row-exact as it stands [ROW-EXACT]
            return self.down(torch.relu(self.up(rms_norm(x, self.post_norm, eps))).square())
        if self.moe is not None:        # rows grouped by expert, a fixed sum order [BATCH-INVARIANT]
            return self.moe(rms_norm(x, self.post_norm, eps))
        g, u = self.gate_up(rms_norm(x, self.post_norm, eps)).chunk(2, dim=-1)  # (M, I) each
        y = self.down(self.silu_mul(g, u) if self.cfg.mlp_act == "silu" else F.gelu(g, approximate="tanh") * u)
        return y if self.mlp_out_norm is None else rms_norm(y, self.mlp_out_norm, eps)

    def _kv_rows(self, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """(KV, T, D) fp32 K or V rows -> the cache's rows (KV, T, kv_type.width(D)): q8_0 by the kernel that
        layer.c's writes use (the same bytes, keys rotated [KV-ROTATE]); float formats as they are (the cache's
        dtype casts them)."""
        if self.kv_type.name != "q8_0":
            return x
        KV, T, D = x.shape
        return self.kernels.kv_q8_rows(x.reshape(KV * T, D), keys).view(KV, T, -1)

    def _attend_all(self, q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Every part's attention in one native call. q: (H, M, D) after norm and RoPE -> (M, q) fp32.
        A windowed layer's rows read only their window's keys (attention.c), so decode on it costs the
        same at any context length."""
        H, M, D = q.shape
        qs = (q.to(KV_DTYPE) * self.q_scale).contiguous()    # the same scaling as `attention`
        out = torch.empty(M, H * D, dtype=KV_DTYPE)
        self.kernels.attention_segments(table.data_ptr(), table.shape[0], self.kv_index, qs.data_ptr(), M, H,
                                        self.cfg.num_kv_heads, D, out.data_ptr(), torch.get_num_threads(),
                                        kv_mode=self.kv_type.mode, window=self.window)
        return out

    def _attend(self, qk: torch.Tensor, v: torch.Tensor, p: _Part) -> torch.Tensor:
        """One sequence's KV write and attention. qk: (H + KV, T, D) after norm and RoPE, v: (KV, T, D):
        its rows only. -> (T, q) in KV_DTYPE. Side effect: writes K/V of positions [start, start + T)
        into p's caches. `attention` makes its own contiguous copies, so its GEMMs see the same
        layouts whether this sequence ran alone or in company."""
        H, T, start = self.cfg.num_heads, qk.shape[1], p.start
        end = start + T
        p.k_cache[:, start:end] = qk[H:]
        p.v_cache[:, start:end] = v
        # [0, start) earlier positions | [start, end) this call | [end, S) padding, masked
        attn = attention(qk[:H], p.k_cache, p.v_cache, start, p.bias, self.q_scale)   # (H, T, D) in KV_DTYPE
        return attn.transpose(0, 1).reshape(T, self.q_size)


def _row_exact_silu_mul(kernels: Kernels, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u by recurrent.c's tq_pointwise (fp32, every element's bits its own), in g's dtype [ROW-EXACT]."""
    return kernels.pointwise("silu_mul", g, u).to(g.dtype)


EMBED_LOOKUP_MAX = 16      # ids a lookup serves from Transformer._embed_rows (more: a prefill chunk)
EMBED_ROWS_KEPT = 4096     # rows kept there: 9.4 MB for smollm2's 576 fp32, 14.7 for qwen2.5-0.5b's 896


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: dict[str, "torch.Tensor | QWeight"],
                 dtype: torch.dtype = torch.bfloat16, pack: bool = True, kernels: Kernels | None = None,
                 keep_quantized: bool = False, kv_dtype: str = "float32", experts: ExpertStore | None = None,
                 consume: bool = False):
        """Build from Hugging Face-named tensors (fused and cast here). Does not modify `weights`, unless
        `consume`: then each tensor leaves `weights` once the module holds what it is built into (a layer's
        fused, converted copies; the embedding; the head), so a load's peak is the model plus one layer, not
        the loader's layouts and the model's side by side (issue 61: an 8B's int layouts doubled its RSS).
        experts: a mixture of experts' store when it is not every expert in `weights` (moe.StreamedExperts).
        kernels: the native kernels (attention, and with keep_quantized the quantized matmul: QWeights
        among the weights, from `--weights gguf`, stay quantized); without them QWeights are
        dequantized exactly and cast like the rest, and attention is `attention` below.
        kv_dtype: the caches' format (`self.kv_type`, kv/kvtype.py; `self.kv_dtype` its storage dtype):
        float32, float16 or q8_0 (these two where attention runs in C: the native kernels built; raises
        ValueError elsewhere), or auto (float16 where the layers run fused, as llama.cpp's default f16
        cache: half the bytes a decode step reads from the KV; else float32)."""
        super().__init__()
        self.cfg, self.dtype, self.kernels = cfg, dtype, kernels
        quantized = kernels is not None and keep_quantized
        # [INT8] --activations int8: every quantized projection multiplies int8 activations (kernels/qint8.c)
        # in an int layout, experts included (layer.c's expert shares take either kind). Streamed experts
        # are in the layout their store reads them into (load_gguf's int8): the model follows it, one
        # setting a model, so a store of lanes layouts keeps the whole model at fp32 activations.
        streamed_int8 = getattr(experts, "int8", None) if cfg.num_experts and experts is not None else None
        if streamed_int8 and not (quantized and kernels.int8):
            raise ValueError("streamed experts in int layouts need int8 activations (--activations int8)")
        int8 = quantized and kernels.int8 and streamed_int8 is not False
        self.activations = "int8" if int8 else "fp32"
        self.activations_note = ("streamed experts read into lanes layouts: fp32 activations"
                                 if quantized and kernels.int8 and not int8 else "")

        def w(name: str) -> "torch.Tensor | QWeight":
            if name not in weights:
                raise KeyError(f"missing weight {name!r}")
            t = weights[name]
            if isinstance(t, QWeight) and quantized and (kernels.lanes or int8):
                t = to_lanes(t) or t         # here, once: a tied embedding and lm_head share one copy
                return to_int8(t) if int8 and t.lanes else t
            return t if isinstance(t, QWeight) else t.to(dtype).contiguous()

        embed = w("model.embed_tokens.weight")                                   # (vocab, hidden)
        # A quantized embedding stays so: a lookup dequantizes only the rows it reads (embed_ids).
        self.embed = embed if isinstance(embed, QWeight) and quantized else (
            embed.dequantize().to(dtype) if isinstance(embed, QWeight) else embed)
        self._embed_rows: dict[int, torch.Tensor] = {}   # token id -> (hidden,): embed_ids' decode lookups
        # every layer's experts, fetched through one interface; its counters: self.experts.stats
        self.experts: ExpertStore | None = (ExpertStore() if experts is None else experts) if cfg.num_experts else None
        if consume:              # self.embed holds it (the tied head too)
            del weights["model.embed_tokens.weight"]
            release_freed()
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names = [k for k in weights if k.startswith(p)]
            self.layers.append(Layer(cfg, {k[len(p):]: w(k) for k in names}, pack, kernels, quantized, i,
                                     self.experts))
            if consume:          # the layer holds its own (fused, converted) copies: the loader's go now
                for k in names:
                    del weights[k]
                release_freed()  # and their pages, before the next layer's copies fault in others
        self.norm = w("model.norm.weight")
        head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight")
        self.lm_head = projection([head], None, dtype, pack, kernels if quantized else None)
        if consume:
            weights.clear()
            release_freed()
        # RoPE variants (scaling, partial rotary) are only different tables (models/rope.py); a model
        # whose layers differ (Gemma 3: local base 10k on windowed layers) has one table per distinct rope
        ropes = [cfg.layer_rope(i) for i in range(cfg.num_layers)]
        distinct = list(dict.fromkeys([cfg.rope_spec, *ropes]))           # [0]: the model's own rope
        self.ropes: list[tuple[torch.Tensor, torch.Tensor]] = []          # (max_pos, head_dim) cos, sin each
        # no_rope (nemotron_h): the layers never read the tables, so one row (its context may be 2^20: SSM files)
        positions = 1 if cfg.no_rope else cfg.max_position_embeddings
        for rope in distinct:
            cos, sin = rope.tables(cfg.head_dim, positions)
            self.ropes.append((cos.to(dtype).contiguous(), sin.to(dtype).contiguous()))
        for layer, rope in zip(self.layers, ropes):
            layer.rope = distinct.index(rope)
        self.cos, self.sin = self.ropes[0]                                # (max_pos, head_dim)
        # HF multiplies by the scale cast to the embedding's dtype (sqrt(640) in bf16 is 25.25, not 25.30)
        self.embed_scale = None if cfg.embed_scale == 1.0 else torch.tensor(cfg.embed_scale, dtype=dtype)
        self.native = self._native_layers() if quantized else None
        self.kv_type = self._choose_kv_type(kv_dtype)       # needs self.native (auto's choice)
        self.kv_dtype = self.kv_type.storage
        for layer in self.layers:                           # the torch layers' KV write and attention call
            layer.kv_type = self.kv_type
        for native in self.native or []:                    # layer.c writes and attention.c reads this format
            native.spec.kv_mode = self.kv_type.mode

    def _choose_kv_type(self, requested: str) -> KVType:
        if requested == "auto":
            return KV_TYPES["float16" if self.native is not None else "float32"]
        kv = kv_type(requested)
        if kv.needs_kernels and self.kernels is None:
            raise ValueError(f"--kv-dtype {requested} needs the native kernels (attention in C: a C compiler, "
                             "TERNLM_NATIVE not 0); use float32 or auto")
        if kv.fits(self.cfg.head_dim) is not None:
            raise ValueError(kv.fits(self.cfg.head_dim))
        return kv

    def _native_layers(self) -> "list[NativeLayer] | None":
        """Every layer as one kernels/layer.c call, when all of them fit it (fp32 activations, every
        projection quantized, shapes it takes; gemma3's kinds are data there: window, GeGLU, output
        norms, query scale, each layer's own RoPE tables); else None and the torch layers run.
        Deterministic in the model, --weights and dtype, which the KV namespace holds, with the kernels' digest."""
        from .native_layer import NativeLayer
        from .native_moe import NativeMoELayer
        built = [(NativeLayer if layer.moe is None else NativeMoELayer).build(self.kernels, layer, *self.ropes[layer.rope])
                 for layer in self.layers]
        why = next((b for b in built if isinstance(b, str)), None)
        if why is not None:
            log.info("layers run in torch, not fused: %s", why)
            return None
        return built

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     pack: bool = True, kernels: Kernels | None = None,
                     keep_quantized: bool = False, kv_dtype: str = "float32",
                     experts: ExpertStore | None = None, consume: bool = False) -> "Transformer":
        return cls(cfg, weights, dtype, pack, kernels, keep_quantized, kv_dtype, experts, consume)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (T,) int64 -> (T, hidden) in the compute dtype, a new tensor (callers write into it).
        A quantized embedding's rows for a few ids (decode steps) come from a bounded dict of rows
        already dequantized: QWeight.dequantize's ~25 small torch ops took ~0.24 ms of a smollm2
        decode step's 11 (the step's largest serial Python cost, cProfile), and a chat's output repeats
        its tokens (75% of 300 generated). The same rows either way: dequantize is exact and
        deterministic. Side effect: fills that dict (at most EMBED_ROWS_KEPT rows; emptied when full)."""
        rows = self._embed_lookup(ids)
        return rows if self.embed_scale is None else rows * self.embed_scale    # Gemma: times sqrt(hidden)

    def _embed_lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.embed, QWeight):
            return F.embedding(ids, self.embed)
        if ids.numel() > EMBED_LOOKUP_MAX:               # a prefill chunk: one dequantize for all
            return self.embed.dequantize(ids).to(self.dtype)
        keys = ids.tolist()
        kept = self._embed_rows
        miss = [t for t in dict.fromkeys(keys) if t not in kept]
        if miss:
            if len(kept) + len(miss) > EMBED_ROWS_KEPT:
                kept.clear()
                miss = list(dict.fromkeys(keys))             # this lookup's hits went with the rest
            kept.update(zip(miss, self.embed.dequantize(torch.tensor(miss, dtype=torch.long)).to(self.dtype)))
        return torch.stack([kept[t] for t in keys])

    def forward(self, x: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                all_logits: bool = False, state=None) -> torch.Tensor:
        """x: (T, hidden) input embeddings of positions [start, start + T).
        k_cache/v_cache: (attention layers, kv_heads, capacity >= start + T, head_dim): config.attention_layers.
        Returns fp32 logits (T, vocab) when all_logits, else (1, vocab) for the last position only
        (a 1024-token prefill would otherwise spend more on the LM head than on attention).
        Side effect: writes K/V of positions [start, start + T) into the caches; nothing else.
        A batch of one: the same code path as `forward_batch`. state: a hybrid model's recurrent state at
        `start` (kv/recurrent.RecurrentState; advanced here, its `pos` left to the caller)."""
        seg = Segment(start, x.shape[0], k_cache, v_cache, "all" if all_logits else "last", state)
        return self.forward_batch(x, [seg])[0]

    def forward_batch(self, x: torch.Tensor, segments: list[Segment]) -> list[torch.Tensor | None]:
        """x: (M, hidden), the input embeddings of every segment's rows, concatenated in order
        (M = sum of lengths). Returns per segment fp32 logits: (length, vocab) for "all", (1, vocab)
        for "last", None for "none". Side effect: writes each segment's K/V into its caches; nothing
        else. A segment's results do not depend on the others [BATCH-INVARIANT]."""
        if sum(s.length for s in segments) != x.shape[0] or any(s.length < 1 for s in segments):
            raise ValueError("segments must cover the rows of x, each with at least one row")
        parts: list[list[_Part]] = [[] for _ in self.layers] if self.native is None else []
        windows = sorted({layer.window for layer in self.layers})
        cos, sin = [[] for _ in self.ropes], [[] for _ in self.ropes]             # per rope: (T_i, head_dim) each
        r0 = 0
        for s in segments:
            end = s.start + s.length
            if end > self.cfg.max_position_embeddings:
                raise ValueError(f"position {end} beyond the model's context {self.cfg.max_position_embeddings}")
            if s.k_cache.shape[2] % ATTN_BLOCK:
                raise ValueError(f"KV capacity {s.k_cache.shape[2]} is not a multiple of {ATTN_BLOCK}")
            for j, (c, sn) in enumerate(self.ropes):
                cos[j].append(c[s.start:end])
                sin[j].append(sn[s.start:end])
            # the torch attention's masks, one per window; the native one reads each row's keys itself
            bias = {w: causal_bias(s.start, s.length, s.k_cache.shape[2], w) if self.kernels is None else None
                    for w in windows}
            if self.cfg.recurrent_layers and (s.state is None or s.state.pos != s.start):
                raise ValueError(f"a hybrid model's segment at {s.start} needs its recurrent state there "
                                 f"(state at {getattr(s.state, 'pos', None)})")
            for layer, layer_parts in zip(self.layers, parts):
                kv = layer.kv_index                              # None: no attention, no KV of its own
                layer_parts.append(_Part(r0, r0 + s.length, s.start, bias[layer.window],
                                         None if kv is None else s.k_cache[kv], None if kv is None else s.v_cache[kv],
                                         s.state, s.captures))
            r0 += s.length
        table = segment_table(segments, self.cfg, self.kv_type) if self.kernels is not None else None
        if self.native is not None:                 # whole layers in C (RoPE from the full tables), x in place
            x = x.to(torch.float32).clone()
            scratch = torch.empty(x.shape[0] * max(n.per_row for n in self.native))   # one for every layer
            for native in self.native:
                native(x, table, scratch)
        else:
            cos_m = [c[0] if len(c) == 1 else torch.cat(c) for c in cos]         # per rope: (M, head_dim)
            sin_m = [c[0] if len(c) == 1 else torch.cat(c) for c in sin]
            for layer, layer_parts in zip(self.layers, parts):
                x = layer(x, cos_m[layer.rope], sin_m[layer.rope], layer_parts, table)
        # rows that need logits, gathered so the LM head runs once: [0, M) batch -> (L, hidden)
        picks, r0 = [], 0
        for s in segments:
            r1 = r0 + s.length
            picks.append((r0, r1) if s.logits == "all" else (r1 - 1, r1) if s.logits == "last" else None)
            r0 = r1
        spans = [p for p in picks if p is not None]
        if not spans:
            return [None] * len(segments)
        h = x[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([x[a:b] for a, b in spans])
        logits = self.lm_head(rms_norm(h, self.norm, self.cfg.rms_norm_eps))          # (L, vocab)
        if self.cfg.final_logit_softcap:          # Gemma 2 style, in the compute dtype as the reference
            cap = self.cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        out, at = [], 0
        for p in picks:
            if p is None:
                out.append(None)
            else:
                out.append(logits[at:at + p[1] - p[0]])
                at += p[1] - p[0]
        return out
