"""Mixture-of-experts MLP (qwen3moe, Mixtral): a router picks k of E SwiGLU experts per row.

Routing, as transformers and llama.cpp compute it: router logits in fp32, softmax over all E
experts, the k largest probabilities, renormalised to sum 1 when `norm_topk_prob` (Mixtral's
softmax over its top-k logits is the same numbers). The output of a row is
    sum over its k experts e of  weight_e * down_e(silu(gate_e(h)) * up_e(h)).

[BATCH-INVARIANT] A row's bits never depend on the other rows in the batch:
  - the router is a packed fp32 Linear (linear.py: row-invariant for any M), softmax and the sort
    are per row;
  - top-k is a stable descending sort: equal probabilities go to the lower expert index [TOP-K-TIES]
    (torch.topk leaves ties unspecified);
  - rows are grouped by expert and each expert's product runs once over all its rows; the expert
    projections are row-invariant (qlinear.py lanes kernels, linear.py), so a row's expert output
    is the same whether 1 or 500 rows share that expert;
  - a row's k weighted outputs are summed in ONE fixed order: ascending expert index, starting from
    the lowest [SUM-ORDER] (transformers' index_add_ loop over experts adds in this order too, so
    dense fp32 matches it closely). The order is a property of the row alone.

Expert weights are fetched through `ExpertStore.get(layer, expert)`, the one place that knows where
they live. Today every expert is resident (a hit); the disk-streaming slice (issue 36) puts a
budgeted cache behind the same call, and its counters (`ExpertStats`) are what timings and
Prometheus will report.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .linear import Linear


@dataclass
class Expert:
    """One expert's projections: gate_up (2 I, hidden) [gate rows first], down (hidden, I); each a
    qlinear.QLinear (quantized, lanes) or a linear.Linear (dense). nbytes: its weights' bytes."""
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    nbytes: int


@dataclass
class ExpertStats:
    """Counters since load (or the last reset). hits/misses: `get` calls served from memory / that
    had to read the expert first; bytes_read: bytes read on misses; bytes_used: weight bytes of
    every expert served (what the products streamed through); rows: expert-rows computed
    (sum over experts of the rows routed to it)."""
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_used: int = 0
    rows: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(hits=self.hits, misses=self.misses, bytes_read=self.bytes_read,
                    bytes_used=self.bytes_used, rows=self.rows)


@dataclass
class ExpertStore:
    """Where expert weights come from: `get(layer, expert) -> Expert`. Resident: every expert is
    `put` at load and every `get` is a hit. Not thread-safe: one engine step at a time uses it."""
    _experts: dict[tuple[int, int], Expert] = field(default_factory=dict)
    stats: ExpertStats = field(default_factory=ExpertStats)

    def put(self, layer: int, expert: int, gate_up, down, nbytes: int) -> None:
        self._experts[(layer, expert)] = Expert(gate_up, down, nbytes)

    def get(self, layer: int, expert: int, rows: int = 0) -> Expert:
        """The expert's projections. Side effect: counts a hit (resident), `rows` rows and its bytes."""
        e = self._experts[(layer, expert)]
        self.stats.hits += 1
        self.stats.bytes_used += e.nbytes
        self.stats.rows += rows
        return e

    @property
    def nbytes(self) -> int:
        """Bytes of every expert held in memory."""
        return sum(e.nbytes for e in self._experts.values())

    def __len__(self) -> int:
        return len(self._experts)


def select_experts(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: (M, E) fp32 -> (indices (M, k) int64, values (M, k)) in rank order: largest first,
    equal values by lower expert index [TOP-K-TIES]. Per row: no row sees another."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return indices[:, :k], values[:, :k]


@dataclass(frozen=True)
class Routing:
    """Each row's experts, ascending index [SUM-ORDER], and their weights (fp32), (M, k) each."""
    experts: torch.Tensor
    weights: torch.Tensor


class MoE:
    """Not an nn.Module: a frozen MoE MLP of one layer. router: (E, hidden) weight."""

    def __init__(self, router: torch.Tensor, top_k: int, norm_topk_prob: bool, store: ExpertStore,
                 layer: int, pack: bool = True):
        self.num_experts, self.hidden = router.shape
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router = Linear(router.float().contiguous(), None, pack)   # logits in fp32, as the reference
        self.store, self.layer = store, layer

    def route(self, h: torch.Tensor) -> Routing:
        """h: (M, hidden) -> each row's k experts and weights. Pure."""
        probs = torch.softmax(self.router(h.float()), dim=-1)                  # (M, E) fp32
        idx, val = select_experts(probs, self.top_k)                           # rank order
        if self.norm_topk_prob:
            val = val / val.sum(dim=-1, keepdim=True)                          # summed in rank order, as the reference
        order = torch.argsort(idx, dim=-1)                                     # experts distinct: no ties
        return Routing(torch.gather(idx, 1, order), torch.gather(val, 1, order))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: (M, hidden), the post-attention-normed rows -> (M, hidden) in h's dtype.
        Side effect: the store's counters (one `get` per expert any row uses)."""
        M, k = h.shape[0], self.top_k
        r = self.route(h)
        flat = r.experts.reshape(-1)                                           # (M k,) row-major
        order = torch.argsort(flat, stable=True)                               # grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        wflat = r.weights.reshape(-1)
        slots: torch.Tensor | None = None                                      # (M, k, hidden): row, rank-by-index
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pos = order[at:at + n]                                             # flat positions routed to e
            at += n
            rows = pos // k
            ex = self.store.get(self.layer, e, n)
            g, u = ex.gate_up(h[rows]).chunk(2, dim=-1)                        # (n, I) each: one product for all its rows
            y = ex.down(F.silu(g) * u)                                         # (n, hidden)
            y = y * wflat[pos].to(y.dtype).unsqueeze(1)
            if slots is None:
                slots = torch.empty(M * k, y.shape[1], dtype=y.dtype)
            slots[pos] = y
        slots = slots.view(M, k, -1)
        out = slots[:, 0].clone()
        for j in range(1, k):                                                  # [SUM-ORDER] ascending expert index
            out += slots[:, j]
        return out.to(h.dtype)
