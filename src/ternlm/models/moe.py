"""Mixture-of-experts MLP (qwen3moe, Mixtral, qwen2moe, olmoe): a router picks k of E SwiGLU experts per row.

Routing, as transformers and llama.cpp compute it: router logits in fp32, softmax over all E
experts, the k largest probabilities, renormalised to sum 1 when `norm_topk_prob` (Mixtral's
softmax over its top-k logits is the same numbers). The output of a row is
    sum over its k experts e of  weight_e * down_e(silu(gate_e(h)) * up_e(h))
    [+ sigmoid(g . h) * shared(h)]     qwen2moe's shared expert (`SharedExpert`): every row, dense.

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
    dense fp32 matches it closely). The order is a property of the row alone. A shared expert
    (qwen2moe) is added last, to the finished routed sum: (e_1 + ... + e_k) + shared, the order
    of transformers' `expert_output + shared_expert_output` and llama.cpp's ggml_add(moe_out, shexp).

Expert weights are fetched through `get(layer, expert)`, the one place that knows where they live:
  - `ExpertStore`: every expert resident, converted at load; every `get` is a hit;
  - `StreamedExperts` (issue 36, `--expert-cache SIZE`): the loader records each expert's gate, up
    and down byte slabs in the GGUF (`Slab`) and converts nothing; a miss preads the slabs, drops
    their file pages (posix_fadvise DONTNEED: the page cache must not hold a second copy), converts
    them with the SAME code as the resident load (gguf.expert_weight, then the layer's own
    projection builder), and keeps the result within a byte budget (pinned per layer, then a tail:
    [SCAN-RESISTANT] in the class), reading ahead what the routing asks for [READ-AHEAD]. [SAME-BITS] the
    bytes and the conversion are the resident path's, so a streamed expert's product is the same
    bits; tests/test_moe_stream.py checks logits with torch.equal.
Their counters (`ExpertStats`) are what timings, Prometheus and `ternlm info` report. A shared
expert is not in either store: it is a dense part of the layer (resident, never in the expert cache, not counted).
"""
from __future__ import annotations

import os
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import numpy as np

import torch
import torch.nn.functional as F

from ..sizes import format_size as fs
from ..sizes import parse_size
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
    evictions: int = 0          # experts a streamed store read and dropped to stay within its budget: evicted
                                # from its LRU tail, or served and not kept (so held = misses - evictions)

    def as_dict(self) -> dict[str, int]:
        return dict(hits=self.hits, misses=self.misses, bytes_read=self.bytes_read,
                    bytes_used=self.bytes_used, rows=self.rows, evictions=self.evictions)

    def minus(self, before: dict[str, int]) -> dict[str, int]:
        """These counters less an earlier `as_dict()`: what happened in between."""
        return {k: v - before.get(k, 0) for k, v in self.as_dict().items()}


@dataclass
class ExpertStore:
    """Where expert weights come from: `get(layer, expert) -> Expert`. Resident: every expert is
    `put` at load and every `get` is a hit. Not thread-safe: one engine step at a time uses it."""
    _experts: dict[tuple[int, int], Expert] = field(default_factory=dict)
    stats: ExpertStats = field(default_factory=ExpertStats)
    streamed: ClassVar[bool] = False   # experts converted at load (Layer puts them here)
    budget: ClassVar[int | None] = None

    def put(self, layer: int, expert: int, gate_up, down, nbytes: int) -> None:
        self._experts[(layer, expert)] = Expert(gate_up, down, nbytes)

    def read_ahead(self, layer: int, experts: list[int]) -> None:
        """A hint (StreamedExperts'): nothing to read here."""

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


def weight_nbytes(w) -> int:
    """Bytes of a QWeight (its `nbytes`) or a dense tensor."""
    return w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


@dataclass(frozen=True)
class Slab:
    """One expert matrix in the file: bytes [offset, offset + length) of GGML type `qtype`, an
    (rows, cols) weight (rows = output features). Quantization blocks run along the input, so an
    expert of a stacked (E, rows, cols) tensor is one contiguous slab of whole rows."""
    offset: int
    length: int
    qtype: int
    rows: int
    cols: int


# An expert's weights as the layer builds projections from them: Slab bytes -> QWeight or tensor
Decode = Callable[[torch.Tensor, Slab], object]
# The layer's projection builder: [parts stacked along outputs] -> a callable projection
Build = Callable[[list], Callable[[torch.Tensor], torch.Tensor]]


class StreamedExperts:
    """Experts read from the GGUF on demand into a cache of at most `budget` bytes (converted weights,
    `weight_nbytes`). The same `get` as ExpertStore. Not thread-safe: one engine step at a time uses it
    (a metrics scrape only reads int counters).

    Placement [SCAN-RESISTANT]: a prefill chunk uses every expert of every layer (256 rows x 8 of 128
    experts: P(one unused) ~ 1e-7) in the same order, layer by layer and ascending index, so an LRU
    smaller than the experts evicts exactly what the next chunk needs first (turn 1 of the capped
    benchmark hit 546 of 4,479 gets: benchmarks/results/moe-capped). Instead:
      - pinned: each layer keeps the first experts it reads, up to its fair share of the budget
        (budget // layers, whole experts), for good: never evicted. Every sweep then hits the pinned
        ones (~budget / experts' bytes of its gets), whatever the order;
      - tail: other experts, kept while the budget has room (the shares' rounding to whole experts, and
        all of it while the pins fill); a tail expert is evicted (least recently used first) only to make
        room for a pin, never for another tail expert, so a sweep cannot flush it either;
      - the rest is read, served, and not kept (counted as an eviction).
    With a budget for every expert, every expert is pinned on first use: nothing is read twice.

    Read-ahead [READ-AHEAD]: the layer says which experts it will ask for (`read_ahead`, from its
    routing); the store asks the kernel to start reading the slabs of the next READ_AHEAD of them not
    held (posix_fadvise WILLNEED: asynchronous, into the page cache, where the miss's pread finds them and
    drops them), topping the window up as gets come. One pread at a time read 0.9-1.0 GB/s cold here; 8
    experts ahead 1.7-1.8 GB/s, and the reads overlap the conversion and the products.

    Memory: after every `get` the experts kept hold <= budget bytes (`nbytes` = pinned + tail); while a
    miss is being converted, that expert, its raw bytes and the one the caller still holds come on top;
    the read-ahead's page cache (<= READ_AHEAD experts' slabs, clean: reclaimable) too.
    Side effects of a miss: preads, then posix_fadvise(DONTNEED) on the bytes read, so the kernel's page
    cache does not keep a second copy.
    [FILE-CHANGED] the file is held open from load (a replaced file keeps serving the loaded bytes);
    a file modified in place (its mtime changed) raises instead of mixing two models' experts."""
    streamed: ClassVar[bool] = True

    def __init__(self, path: str | os.PathLike[str], slabs: dict[tuple[int, int], tuple[Slab, Slab, Slab]],
                 budget: int, decode: Decode):
        """slabs: (layer, expert) -> its (gate, up, down) slabs. decode: the loader's conversion of one
        slab (gguf.expert_weight: the resident load's code). Opens `path` (closed with the store)."""
        if budget < 0:
            raise ValueError(f"expert cache budget {budget} < 0")
        self.path = Path(path)
        self.budget = int(budget)
        self.stats = ExpertStats()
        self._slabs = slabs
        self._decode = decode
        self._build: dict[int, Build] = {}
        layers = {layer for layer, _ in slabs}
        self._share = self.budget // max(len(layers), 1)             # each layer's pinned bytes, at most
        self._pinned: dict[tuple[int, int], Expert] = {}
        self._pinned_layer = dict.fromkeys(layers, 0)                # layer -> its pinned bytes
        self._pinned_bytes = 0
        self._tail: OrderedDict[tuple[int, int], Expert] = OrderedDict()   # least recently used first
        self._tail_bytes = 0
        self._ahead: deque[tuple[int, int]] = deque()                # hinted, not yet advised, in order
        self._advised: deque[tuple[int, int]] = deque()              # advised (reading), not yet got
        self._scratch = np.empty(0, dtype=np.uint8)                  # raw bytes of the slab being read [SCRATCH]
        self._fd = os.open(self.path, os.O_RDONLY)
        self._mtime = os.fstat(self._fd).st_mtime_ns
        self._closer = weakref.finalize(self, os.close, self._fd)

    # ---- set up by the model -----------------------------------------------------------------------
    def bind(self, layer: int, build: Build) -> None:
        """The layer's projection builder (Layer._experts): a streamed expert's gate|up and down are
        built by it exactly as the resident ones are."""
        self._build[layer] = build

    # ---- the interface -----------------------------------------------------------------------------
    def read_ahead(self, layer: int, experts: list[int]) -> None:
        """A hint [READ-AHEAD]: `experts` of `layer` are asked for next, in this order (a previous hint
        is dropped). Side effect: posix_fadvise(WILLNEED) on the slabs of the first READ_AHEAD not held;
        no counter changes. A hint not followed costs only clean page cache."""
        held = lambda k: k in self._pinned or k in self._tail      # noqa: E731
        self._ahead = deque(k for k in ((layer, e) for e in experts) if not held(k))
        self._advised.clear()
        self._advise()

    def _advise(self) -> None:
        while self._ahead and len(self._advised) < READ_AHEAD:
            key = self._ahead.popleft()
            self._advised.append(key)
            if hasattr(os, "posix_fadvise"):
                for slab in self._slabs[key]:
                    os.posix_fadvise(self._fd, slab.offset, slab.length, os.POSIX_FADV_WILLNEED)

    def get(self, layer: int, expert: int, rows: int = 0) -> Expert:
        """The expert's projections, from the cache or read now. Side effects: counters; a miss reads,
        then pins the expert (evicting from the tail, never the one returned), or keeps it in the tail,
        or keeps nothing [SCAN-RESISTANT]; the read-ahead window moves on [READ-AHEAD]."""
        key = (layer, expert)
        if key in self._advised:                    # it and any hinted before it (skipped) leave the window
            while self._advised.popleft() != key:
                pass
            self._advise()
        e = self._pinned.get(key)
        if e is None:
            e = self._tail.get(key)
            if e is not None:
                self._tail.move_to_end(key)
        if e is not None:
            self.stats.hits += 1
        else:
            e = self._read(key)
            self.stats.misses += 1
            self._place(key, e)
        self.stats.bytes_used += e.nbytes
        self.stats.rows += rows
        return e

    def _place(self, key: tuple[int, int], e: Expert) -> None:
        """A just-read expert: pinned while its layer's share has room (evicting the tail's least recently
        used to make that room), else into the tail while the budget has room, else not kept: an expert
        held is only ever evicted for a pin. Keeps pinned + tail <= budget."""
        layer = key[0]
        if self._pinned_layer[layer] + e.nbytes <= self._share and self._pinned_bytes + e.nbytes <= self.budget:
            self._shrink_tail(self.budget - self._pinned_bytes - e.nbytes)
            self._pinned[key] = e
            self._pinned_layer[layer] += e.nbytes
            self._pinned_bytes += e.nbytes
        elif self._pinned_bytes + self._tail_bytes + e.nbytes <= self.budget:
            self._tail[key] = e                                      # room: kept (no eviction for it)
            self._tail_bytes += e.nbytes
        else:
            self.stats.evictions += 1                                # served, not kept

    def _shrink_tail(self, room: int) -> None:
        """Evicts the tail's least recently used experts until it holds <= room bytes."""
        while self._tail_bytes > room:
            _, old = self._tail.popitem(last=False)
            self._tail_bytes -= old.nbytes
            self.stats.evictions += 1

    @property
    def pinned(self) -> int:
        """How many experts are pinned (never evicted)."""
        return len(self._pinned)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts held now (<= budget): pinned and tail."""
        return self._pinned_bytes + self._tail_bytes

    @property
    def total_experts(self) -> int:
        return len(self._slabs)

    @property
    def file_bytes(self) -> int:
        """Bytes of every expert slab in the file (what `ternlm info` calls mapped)."""
        return sum(s.length for slabs in self._slabs.values() for s in slabs)

    def __len__(self) -> int:
        return len(self._pinned) + len(self._tail)

    def close(self) -> None:
        self._pinned.clear()
        self._tail.clear()
        self._pinned_layer = dict.fromkeys(self._pinned_layer, 0)
        self._pinned_bytes = self._tail_bytes = 0
        self._closer()

    # ---- reading -----------------------------------------------------------------------------------
    def _read(self, key: tuple[int, int]) -> Expert:
        if os.fstat(self._fd).st_mtime_ns != self._mtime:          # [FILE-CHANGED]
            raise RuntimeError(f"{self.path} changed since it was loaded; restart to serve the new file")
        parts = []
        for slab in self._slabs[key]:
            raw = torch.from_numpy(self._pread(slab))
            parts.append(_not_viewing(self._decode(raw, slab), raw))     # [SCRATCH] before the next pread
            self.stats.bytes_read += slab.length
        build = self._build[key[0]]
        return Expert(build(parts[:2]), build(parts[2:]), sum(weight_nbytes(p) for p in parts))

    def _pread(self, slab: Slab) -> np.ndarray:
        """The slab's bytes, read into the store's one scratch buffer [SCRATCH]: valid until the next
        _pread. (A fresh buffer a slab is a fresh mapping at the 256 KiB mmap threshold that streaming
        sets, malloc.streamed_blocks_return: ~1.5 ms of page faults an expert, a third of a miss's read.)"""
        if self._scratch.size < slab.length:
            self._scratch = np.empty(slab.length, dtype=np.uint8)
        buf = self._scratch[:slab.length]
        view, got = memoryview(buf), 0
        while got < slab.length:
            n = os.preadv(self._fd, [view[got:]], slab.offset + got)
            if n <= 0:
                raise OSError(f"{self.path}: short read at {slab.offset + got} (file truncated?)")
            got += n
        if hasattr(os, "posix_fadvise"):     # the bytes are converted now: their file pages are not needed
            os.posix_fadvise(self._fd, slab.offset, slab.length, os.POSIX_FADV_DONTNEED)
        return buf


def _not_viewing(w, raw: torch.Tensor):
    """w (a decoded slab: QWeight or tensor) with every tensor that shares raw's storage copied out
    [SCRATCH]: the conversions copy (convert.c always), but a float slab's dequantization or a Python
    path's corner case may return a view, and raw is overwritten by the next read."""
    lo, hi = raw.data_ptr(), raw.data_ptr() + raw.numel() * raw.element_size()

    def own(t):
        if not isinstance(t, torch.Tensor):
            return t
        st = t.untyped_storage()
        return t.clone() if st.data_ptr() < hi and lo < st.data_ptr() + st.nbytes() else t
    if isinstance(w, torch.Tensor):
        return own(w)
    return type(w)(w.fmt, *(own(t) for t in (w.codes, w.scale, w.bias, w.high, w.sup)))


READ_AHEAD = 8      # experts whose slabs are being read ahead of their get (StreamedExperts [READ-AHEAD])
EXPERT_OVERHEAD = 256 << 20     # beside the resident parts: tokenizer, tables, allocator slack (as fit.py)


def step_work_bytes(cfg, rows: int) -> int:
    """Bytes a prefill step of `rows` rows holds at its peak in one MoE layer, for the cache plan
    (a streamed cache that takes all the room leaves the chunk's activations none: under a cgroup
    cap, a 2,048-row chunk was OOM-killed, benchmarks/results/moe-capped). fp32 rows of: the
    residual, the norm's output, q/k/v and the attention's output, and the experts' gate|up and
    their product for each row's k experts (k * (2 I + I + hidden)), twice over for the grouping's
    gathers and the torch temporaries beside them. An estimate, sized from the shapes. Pure."""
    h, k, inter = cfg.hidden_size, max(cfg.experts_per_token, 1), cfg.expert_intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_row = 4 * (3 * h + qkv + cfg.num_heads * cfg.head_dim + k * (3 * inter + h))
    return 2 * rows * per_row


@dataclass(frozen=True)
class ExpertCachePlan:
    """Where experts live: budget None = resident (converted at load); else streamed with this many
    bytes of cache. reason: one line for the log and `ternlm info`."""
    budget: int | None
    reason: str


def plan_expert_cache(requested: "str | int | None", experts: int, others: int, kv: int,
                      available: int | None) -> ExpertCachePlan:
    """--expert-cache -> ExpertCachePlan. Pure. requested: bytes (streamed, that budget), "resident"
    or None (converted at load), "auto": resident when the experts fit in what is available beside
    the resident parts (`others`), the KV budget (`kv`) and an overhead, else streamed with what
    fits (at least 0: every use then reads). Sizes in bytes, as the weights are held in memory.
    A size may be given as text ("8GiB", sizes.parse_size). Raises ValueError for anything else."""
    if isinstance(requested, str) and requested not in ("auto", "resident"):
        try:
            requested = parse_size(requested)
        except ValueError:
            raise ValueError(f"--expert-cache {requested!r}: a size (e.g. 8GiB), auto or resident") from None
    if isinstance(requested, int):
        return ExpertCachePlan(requested, f"--expert-cache {fs(requested)}")
    if requested in (None, "resident"):
        return ExpertCachePlan(None, "resident (--expert-cache resident)")
    if requested != "auto":
        raise ValueError(f"--expert-cache {requested!r}: a size (e.g. 8GiB), auto or resident")
    if available is None:
        return ExpertCachePlan(None, "resident (available memory unknown)")
    room = available - others - kv - EXPERT_OVERHEAD - others // 8
    if experts <= room:
        return ExpertCachePlan(None, f"resident: experts {fs(experts)} fit in {fs(room)} beside the rest "
                                     f"and the KV ({fs(available)} available)")
    budget = max(room, 0)
    return ExpertCachePlan(budget, f"streamed: experts {fs(experts)} > {fs(room)} left beside the rest "
                                   f"{fs(others)} and KV {fs(kv)} ({fs(available)} available)")


def select_experts(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: (M, E) fp32 -> (indices (M, k) int64, values (M, k)) in rank order: largest first,
    equal values by lower expert index [TOP-K-TIES]. Per row: no row sees another."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return indices[:, :k], values[:, :k]


@dataclass(frozen=True)
class SharedExpert:
    """qwen2moe's shared expert: one more SwiGLU MLP that every row goes through, scaled per row by
    sigmoid(gate . h). Dense and always used, so it is held by the layer (resident), never by a
    store. gate_up (2 I_s, hidden) [gate rows first], down (hidden, I_s): built as an expert's
    projections; gate: (1, hidden) weight (transformers' shared_expert_gate, llama.cpp's
    ffn_gate_inp_shexp), applied in fp32 as the router is."""
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    gate: torch.Tensor


@dataclass(frozen=True)
class Routing:
    """Each row's experts, ascending index [SUM-ORDER], and their weights (fp32), (M, k) each."""
    experts: torch.Tensor
    weights: torch.Tensor


class MoE:
    """Not an nn.Module: a frozen MoE MLP of one layer. router: (E, hidden) weight."""

    def __init__(self, router: torch.Tensor, top_k: int, norm_topk_prob: bool, store: ExpertStore,
                 layer: int, pack: bool = True, shared: SharedExpert | None = None):
        self.num_experts, self.hidden = router.shape
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.router_weight = router.float().contiguous()                 # (E, hidden): the native layer's
        self.router = Linear(self.router_weight, None, pack)             # logits in fp32, as the reference
        self.store, self.layer = store, layer
        self.shared = shared
        self.shared_gate = None if shared is None else Linear(
            shared.gate.float().reshape(1, self.hidden).contiguous(), None, pack)   # (1, hidden) fp32

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
        r = self.route(h)
        out = self._one_row(h, r) if h.shape[0] == 1 else self._grouped(h, r)
        if self.shared is not None:                                            # [SUM-ORDER] then the shared expert
            out += self._shared(h).to(out.dtype)
        return out.to(h.dtype)

    def _one_row(self, h: torch.Tensor, r: Routing) -> torch.Tensor:
        """A lone row (a decode step alone): its k experts in ascending index, each product on h
        itself, summed as they come. The same operations on the same values as `_grouped` with one
        row (its y * weight, its sum from the lowest index up, its `get`s in the same order), so the
        same bits, without the grouping's ~8 small torch ops an expert (argsort, bincount, gathers,
        the scatter into slots): 128 experts a token on olmoe-small. -> (1, hidden)."""
        out = None
        experts = r.experts[0].tolist()
        self.store.read_ahead(self.layer, experts)                             # [READ-AHEAD] a hint: no bits change
        for j, e in enumerate(experts):                                        # [SUM-ORDER] ascending index
            ex = self.store.get(self.layer, e, 1)
            g, u = ex.gate_up(h).chunk(2, dim=-1)                              # (1, I) each
            y = ex.down(F.silu(g) * u)                                         # (1, hidden)
            y = y * r.weights[:, j:j + 1].to(y.dtype)
            if out is None:
                out = y
            else:
                out += y
        return out

    def _grouped(self, h: torch.Tensor, r: Routing) -> torch.Tensor:
        """Rows grouped by expert: each expert's product once over all its rows. -> (M, hidden)."""
        M, k = h.shape[0], self.top_k
        flat = r.experts.reshape(-1)                                           # (M k,) row-major
        order = torch.argsort(flat, stable=True)                               # grouped by expert, rows ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        wflat = r.weights.reshape(-1)
        slots: torch.Tensor | None = None                                      # (M, k, hidden): row, rank-by-index
        self.store.read_ahead(self.layer, [e for e, n in enumerate(counts) if n])   # [READ-AHEAD] in get order
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
        return out

    def _shared(self, h: torch.Tensor) -> torch.Tensor:
        """h: (M, hidden) -> (M, hidden): sigmoid(gate . h) * down(silu(gate(h)) * up(h)), row-wise."""
        g, u = self.shared.gate_up(h).chunk(2, dim=-1)                         # (M, I_s) each
        y = self.shared.down(F.silu(g) * u)                                    # (M, hidden)
        z = self.shared_gate(h.float())                                        # (M, 1) fp32, as the router
        # [BATCH-INVARIANT] sigmoid(z) as softmax([z, 0])[0]: the last-dim softmax computes each row alone,
        # while torch.sigmoid over the (M, 1) column takes its vector or its scalar path by the row's
        # place in the batch (1 ulp apart: a chunked prefill changed the logits' bits)
        gate = torch.softmax(F.pad(z, (0, 1)), dim=-1)[:, :1]                  # (M, 1)
        return y * gate.to(y.dtype)
