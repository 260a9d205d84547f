"""Mixture-of-experts MLP (qwen3moe, Mixtral, qwen2moe, olmoe, qwen35moe): a router picks k of E SwiGLU experts per row.

Routing, as transformers and llama.cpp compute it: router logits in fp32, softmax over all E
experts, the k largest probabilities, renormalised to sum 1 when `norm_topk_prob` (Mixtral's
softmax over its top-k logits is the same numbers). The output of a row is
    sum over its k experts e of  weight_e * down_e(silu(gate_e(h)) * up_e(h))
    [+ sigmoid(g . h) * shared(h)]     qwen2moe's (and qwen35moe's) shared expert (`SharedExpert`): every row, dense.
silu(gate) * up is the layer's `act` (`silu_mul` here; a hybrid model's per-element one, models/llama.py [ROW-EXACT]).

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

import functools
import os
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Protocol

import numpy as np

import torch
import torch.nn.functional as F

from ..sizes import format_size as fs
from ..sizes import parse_size
from ..linear.dense import Linear


@dataclass
class Expert:
    """One expert's projections: gate_up (2 I, hidden) [gate rows first], down (hidden, I); each a
    qlinear.QLinear (quantized, lanes) or a linear.Linear (dense). nbytes: its weights' bytes.
    raw: for an expert served unkept as its GGML bytes [RAW], the direct read's buffer they lie in (the store
    gives it back when the expert leaves the unkept window); its projections are then the native layer's only."""
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    nbytes: int
    raw: "np.ndarray | None" = None


class RawBuild(Protocol):
    """[RAW] What a caller that multiplies GGML blocks as read (the native MoE layer with int8 activations) passes
    to `StreamedExperts.get`: `takes(slabs)` says whether it can (types, shapes; pure), and
    `build(slabs, views, nbytes)` makes the Expert over the bytes in `views` (one uint8 array a slab, valid while
    the Expert is in the store's unkept window) without converting them."""
    def takes(self, slabs: tuple["Slab", ...]) -> bool: ...
    def build(self, slabs: tuple["Slab", ...], views: list[np.ndarray], nbytes: int) -> Expert: ...


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
    # Where a streamed miss's time goes on the caller's thread (the step's critical path), microseconds:
    # waiting for its bytes (the reader threads' reads not yet done, or a pread) and converting them into
    # the kernels' layout. Wall time, so not part of `as_dict` (runs that must count the same compare that).
    read_wait_us: int = 0
    convert_us: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counts: the same in every run that asks for the same experts in the same order."""
        return dict(hits=self.hits, misses=self.misses, bytes_read=self.bytes_read,
                    bytes_used=self.bytes_used, rows=self.rows, evictions=self.evictions)

    def snapshot(self) -> dict[str, int]:
        """The counts and the miss times (timings and `bench engine` report both)."""
        return self.as_dict() | dict(read_wait_us=self.read_wait_us, convert_us=self.convert_us)

    def minus(self, before: dict[str, int]) -> dict[str, int]:
        """These counters less an earlier `snapshot()` (or `as_dict()`): what happened in between."""
        return {k: v - before.get(k, 0) for k, v in self.snapshot().items()}


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

    def prefetch(self, layer: int) -> None:
        """A guess (StreamedExperts'): nothing to read here."""

    def of_layer(self, layer: int) -> list[Expert]:
        """Every expert of `layer` held here (no counter changes): what a caller checks before running them."""
        return [e for (li, _), e in self._experts.items() if li == layer]

    def get(self, layer: int, expert: int, rows: int = 0, raw: RawBuild | None = None) -> Expert:
        """The expert's projections. Side effect: counts a hit (resident), `rows` rows and its bytes. raw: unused
        (every expert here is converted)."""
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
# Buffers `Decode` can convert a slab into (its `out=`), or None where it makes new tensors anyway
Blank = Callable[[Slab], object]


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
    experts ahead 1.7-1.8 GB/s, and the reads overlap the conversion and the products. [PREFETCH] Before a
    layer is routed, a caller whose step uses nearly every expert may have its experts not held read ahead
    (`prefetch`), so the disk does not idle through the layer's attention.

    Direct reads [DIRECT] (where the file system takes O_DIRECT, the default): the window's experts are read
    by reader threads straight into reused aligned buffers (`_DirectReader`) instead of advised into the page
    cache, pread out of it and dropped: no posix_fadvise, no kernel copy, no page cache charged beside the
    cache (turn 2 of the capped benchmark: 238 rows 1.91-1.99 s instead of 2.39-2.54 s in-process, TABLE.md
    in benchmarks/results/moe-capped3). The page cache path stays for file systems without O_DIRECT.

    Served and not kept [RING]: such an expert is converted into one of EXPERTS_IN_USE reused sets of
    buffers (a ring per signature: the (type, rows, cols) of its three slabs, so the same field shapes
    and dtypes), not into fresh tensors: at the 256 KiB mmap threshold that streaming sets
    (malloc.streamed_blocks_return) every fresh expert was a fresh mapping, page-faulted in while
    converting (~0.6 of convert's 0.78 ms a slab on the capped benchmark's turn 2, /tmp convbench: 0.17 ms
    into reused memory). The contract is `get`'s. Kept experts (pinned, tail) get their own memory.

    Served and not kept, as read [RAW]: a caller that multiplies GGML blocks as they are read (the native MoE
    layer with int8 activations: qint8.c's tq_int8_raw_range converts each block of 16 rows in cache and multiplies
    it there, the int layout's bits) passes `raw` to `get`; an expert served unkept whose types it takes is then not
    converted at all: its Expert points into the direct read's buffer, which stays out of the reader's free list
    until EXPERTS_IN_USE more experts have been served unkept (the same contract as a ring slot; such a buffer
    stands in for the ring slot it does not take). Kept experts are converted as before (multiplied many times).

    The store also holds the last EXPERTS_IN_USE Expert objects served unkept, so what a caller attaches to
    one (the native MoE layer's pointer table and the tensors behind it) lives as long as the contract
    says, and where `blank` gives no buffers (new tensors a miss) the contract holds the same.

    Memory: the budget holds the rings (`ring_reserve`: EXPERTS_IN_USE experts a signature, `ring_bytes` of
    it allocated as first used) and the experts kept: after every `get`, `nbytes` (pinned + tail) <=
    max(budget - ring_reserve, 0) (a budget below the rings' size keeps nothing and holds the rings: what
    a caller of EXPERTS_IN_USE experts holds anyway). On top: the raw bytes being read (direct: <= READ_AHEAD
    + 1 experts' aligned buffers, and the EXPERTS_IN_USE that [RAW] experts hold in place of the ring slots
    they leave untouched; else one slab's scratch buffer and the read-ahead's page cache, <=
    READ_AHEAD experts' slabs, clean: reclaimable), and the last EXPERTS_IN_USE experts served unkept where
    there is no ring.
    Side effects of a miss: reads (direct: on the reader threads); through the page cache, preads then
    posix_fadvise(DONTNEED) on the bytes read, so the kernel's page cache does not keep a second copy.
    [FILE-CHANGED] the file is held open from load (a replaced file keeps serving the loaded bytes);
    a file modified in place (its mtime changed) raises instead of mixing two models' experts."""
    streamed: ClassVar[bool] = True

    def __init__(self, path: str | os.PathLike[str], slabs: dict[tuple[int, int], tuple[Slab, Slab, Slab]],
                 budget: int, decode: Decode, blank: Blank | None = None, direct: bool | None = None,
                 int8: bool = False):
        """slabs: (layer, expert) -> its (gate, up, down) slabs. decode: the loader's conversion of one
        slab (gguf.expert_weight: the resident load's code), called as decode(raw, slab) or, into a ring's
        buffers [RING], decode(raw, slab, out=blank(slab)); blank: gguf.expert_blank, or None (no ring: every
        expert read is new tensors). direct [DIRECT]: read with O_DIRECT by reader threads (True: or raise),
        through the page cache (False), or O_DIRECT where the file system takes it (None). int8: decode
        makes int layouts (the model must multiply int8 activations: models/llama.py checks). Opens `path`
        (closed with the store)."""
        if budget < 0:
            raise ValueError(f"expert cache budget {budget} < 0")
        self.path = Path(path)
        self.int8 = int8
        self.budget = int(budget)
        self.stats = ExpertStats()
        self._slabs = slabs
        self._decode = decode
        self._blank = blank
        self._rings = self._make_rings()                             # slabs' signature -> its ring [RING]
        self._keep = max(self.budget - self.ring_reserve, 0)         # bytes for the experts kept
        self._unkept: deque[Expert] = deque()                       # the last EXPERTS_IN_USE served unkept [RING]
        self._build: dict[int, Build] = {}
        layers = {layer for layer, _ in slabs}
        self._layer_experts = {li: sorted(e for lj, e in slabs if lj == li) for li in layers}   # [PREFETCH]
        self._share = self._keep // max(len(layers), 1)              # each layer's pinned bytes, at most
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
        self._direct = None if direct is False else _DirectReader.open(self.path, slabs, must=bool(direct))
        self._closer = weakref.finalize(self, _close, self._fd, self._direct)

    # ---- set up by the model -----------------------------------------------------------------------
    def bind(self, layer: int, build: Build) -> None:
        """The layer's projection builder (Layer._experts): a streamed expert's gate|up and down are
        built by it exactly as the resident ones are."""
        self._build[layer] = build

    # ---- the interface -----------------------------------------------------------------------------
    def read_ahead(self, layer: int, experts: list[int]) -> None:
        """A hint [READ-AHEAD]: `experts` of `layer` are asked for next, in this order (a previous hint
        is dropped; the reads it started that this one wants too go on, moved into this order). Side effect:
        the slabs of the first READ_AHEAD not held start being read: by the reader threads [DIRECT], else
        posix_fadvise(WILLNEED); no counter changes. A hint not followed costs its reads (direct: waited for
        when it leaves the window) or clean page cache."""
        self._hint(layer, experts)

    def _hint(self, layer: int, experts: list[int]) -> None:
        """read_ahead's work (prefetch's too: a caller watching read_ahead sees the routed hints only)."""
        held = lambda k: k in self._pinned or k in self._tail      # noqa: E731
        order = {k: i for i, k in enumerate(k for k in ((layer, e) for e in experts) if not held(k))}
        going = sorted((k for k in self._advised if k in order), key=order.__getitem__)
        for key in self._advised:                                    # the rest leave the window unread
            if key not in order and self._direct is not None:
                self._direct.drop(key)
        self._advised, kept = deque(going), set(going)
        self._ahead = deque(k for k in order if k not in kept)
        self._advise()

    def prefetch(self, layer: int) -> None:
        """A guess [PREFETCH]: `layer`'s experts not held, ascending, are read ahead as `read_ahead` would
        before its routing is known. The caller guesses so where a step's rows use nearly every expert of a
        layer (238 rows of 8 of 128: each expert unused with probability (120/128)^238 ~ 2e-7), and says so
        once the layer before has got its last experts: the reads then run under that layer's last products
        and this layer's attention, when the disk would idle (on the capped benchmark's turn 2, attention
        over ~2,200 positions takes tens of ms a layer). The layer's own hint, once routed, keeps the reads
        it wants ([READ-AHEAD]); held ones run first, misses then ascend: the order read here."""
        experts = self._layer_experts.get(layer)
        if experts:
            self._hint(layer, experts)

    def _advise(self) -> None:
        while self._ahead and len(self._advised) < READ_AHEAD:
            key = self._ahead.popleft()
            self._advised.append(key)
            if self._direct is not None:                             # [DIRECT] the reads start now
                self._direct.start(key, self._slabs[key])
            elif hasattr(os, "posix_fadvise"):
                for slab in self._slabs[key]:
                    os.posix_fadvise(self._fd, slab.offset, slab.length, os.POSIX_FADV_WILLNEED)

    def get(self, layer: int, expert: int, rows: int = 0, raw: RawBuild | None = None) -> Expert:
        """The expert's projections, from the cache or read now. Side effects: counters; a miss reads,
        then pins the expert (evicting from the tail, never the one returned), or keeps it in the tail,
        or keeps nothing [SCAN-RESISTANT]; the read-ahead window moves on [READ-AHEAD]. raw: the caller
        multiplies GGML blocks as read: an expert served unkept that `raw.takes` is not converted [RAW].
        Contract [RING]: a caller uses at most EXPERTS_IN_USE experts from `get` at once; an expert served
        and not kept stays valid until EXPERTS_IN_USE more experts have been served-and-not-kept after it
        (its buffers are then overwritten by a later one's). A kept expert stays valid while held."""
        key = (layer, expert)
        if key in self._advised:                    # it and any hinted before it (skipped) leave the window
            self._unadvise(self._advised.index(key))
            self._advised.popleft()                 # key: its direct read (if any) is taken by _read
            self._advise()
        e = self._pinned.get(key)
        if e is None:
            e = self._tail.get(key)
            if e is not None:
                self._tail.move_to_end(key)
        if e is not None:
            self.stats.hits += 1
        else:
            ring = self._ring(key)
            if ring is not None and self._where(layer, ring.nbytes) is None:
                if raw is not None and self._direct is not None and raw.takes(self._slabs[key]):
                    e = self._read_raw(key, raw, ring.nbytes)        # [RAW] served as read, not kept
                else:
                    e = self._read(key, ring.take())                 # [RING] served, not kept
                self.stats.evictions += 1
                self._serve_unkept(e)
            else:
                e = self._read(key)
                if not self._place(key, e):
                    self._serve_unkept(e)
            self.stats.misses += 1
        self.stats.bytes_used += e.nbytes
        self.stats.rows += rows
        return e

    def _serve_unkept(self, e: Expert) -> None:
        """e joins the last EXPERTS_IN_USE served unkept [RING]; the oldest leaves, its direct buffer (a [RAW]
        expert's) back to the reader's free list."""
        if len(self._unkept) >= EXPERTS_IN_USE:
            old = self._unkept.popleft()
            if old.raw is not None and self._direct is not None:
                self._direct.release(old.raw)
        self._unkept.append(e)

    def _unadvise(self, n: int) -> None:
        """The first n experts of the window leave it unread: their direct reads are waited for and their
        buffers freed [DIRECT] (advised pages are left to the kernel)."""
        for _ in range(n):
            key = self._advised.popleft()
            if self._direct is not None:
                self._direct.drop(key)

    def _where(self, layer: int, nbytes: int) -> str | None:
        """Where a just-read expert of `nbytes` goes: "pin" while its layer's share has room, else "tail"
        while the budget has room, else None (not kept): an expert held is only ever evicted for a pin. Pure."""
        if self._pinned_layer[layer] + nbytes <= self._share and self._pinned_bytes + nbytes <= self._keep:
            return "pin"
        if self._pinned_bytes + self._tail_bytes + nbytes <= self._keep:
            return "tail"
        return None

    def _place(self, key: tuple[int, int], e: Expert) -> bool:
        """A just-read expert in its own memory, where `_where` says: pinned (evicting the tail's least
        recently used to make room), in the tail, or not kept (False). Keeps pinned + tail <= budget - ring_reserve."""
        layer = key[0]
        where = self._where(layer, e.nbytes)
        if where == "pin":
            self._shrink_tail(self._keep - self._pinned_bytes - e.nbytes)
            self._pinned[key] = e
            self._pinned_layer[layer] += e.nbytes
            self._pinned_bytes += e.nbytes
        elif where == "tail":
            self._tail[key] = e                                      # room: kept (no eviction for it)
            self._tail_bytes += e.nbytes
        else:
            self.stats.evictions += 1                                # served, not kept
        return where is not None

    def _ring(self, key: tuple[int, int]) -> "_Ring | None":
        """The ring of buffers for this expert's slabs' signature [RING], or None (no ring: new tensors)."""
        return self._rings.get(_signature(self._slabs[key]))

    def _make_rings(self) -> "dict[tuple, _Ring]":
        """A ring per signature of the slabs [RING], when `blank` gives buffers for every slab and the budget
        does not hold every expert (then each is pinned on first use: none is served unkept); else none (an
        expert served unkept is then new tensors). Allocates one slot's buffers a signature to size them
        (untouched pages: no RSS yet); they become its first slot."""
        if self._blank is None:
            return {}
        first: dict[tuple, tuple[tuple[Slab, ...], list]] = {}
        for slabs in self._slabs.values():
            sig = _signature(slabs)
            if sig not in first:
                first[sig] = (slabs, self._blanks(slabs))
        if any(b is None for _, blanks in first.values() for b in blanks):
            return {}
        rings = {sig: _Ring(functools.partial(self._blanks, slabs), sum(weight_nbytes(b) for b in blanks), blanks)
                 for sig, (slabs, blanks) in first.items()}
        every = sum(rings[_signature(slabs)].nbytes for slabs in self._slabs.values())
        return {} if self.budget >= every else rings

    def _blanks(self, slabs: tuple[Slab, ...]) -> list:
        return [self._blank(x) for x in slabs]

    @property
    def ring_reserve(self) -> int:
        """Bytes of the budget set aside for the rings [RING] (EXPERTS_IN_USE slots a signature, allocated
        as first used): the experts kept hold at most budget - ring_reserve."""
        return EXPERTS_IN_USE * sum(r.nbytes for r in self._rings.values())

    @property
    def ring_bytes(self) -> int:
        """Bytes of the rings' buffers taken so far [RING] (<= ring_reserve)."""
        return sum(len(r.slots) * r.nbytes for r in self._rings.values())

    def _shrink_tail(self, room: int) -> None:
        """Evicts the tail's least recently used experts until it holds <= room bytes."""
        while self._tail_bytes > room:
            _, old = self._tail.popitem(last=False)
            self._tail_bytes -= old.nbytes
            self.stats.evictions += 1

    def holds(self, layer: int, expert: int) -> bool:
        """Whether `get(layer, expert)` would be a hit now (pinned or in the tail). Pure: no counter changes
        (the native MoE layer runs the held experts first, under the misses' reads: [HELD-FIRST] there)."""
        key = (layer, expert)
        return key in self._pinned or key in self._tail

    def slab_types(self, layer: int) -> set[int]:
        """The GGML types of `layer`'s expert slabs (what a miss will convert). Pure."""
        return {x.qtype for (li, _), slabs in self._slabs.items() if li == layer for x in slabs}

    @property
    def pinned(self) -> int:
        """How many experts are pinned (never evicted)."""
        return len(self._pinned)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts kept now (<= budget - ring_reserve): pinned and tail."""
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
        self._rings.clear()
        self._unkept.clear()
        self._advised.clear()
        self._pinned_layer = dict.fromkeys(self._pinned_layer, 0)
        self._pinned_bytes = self._tail_bytes = 0
        self._closer()

    # ---- reading -----------------------------------------------------------------------------------
    def _read(self, key: tuple[int, int], into: list | None = None) -> Expert:
        """The expert read and converted: into new tensors, or into `into` (a ring slot's buffers, one a slab)."""
        self._check_unchanged()
        slabs = self._slabs[key]
        t0 = time.perf_counter()
        buf, views = self._direct.take(key, slabs) if self._direct is not None else (None, None)
        waited = time.perf_counter() - t0
        parts = []
        try:
            for i, slab in enumerate(slabs):
                t1 = time.perf_counter()
                raw = torch.from_numpy(self._pread(slab) if views is None else views[i])
                waited += time.perf_counter() - t1
                w = self._decode(raw, slab) if into is None else self._decode(raw, slab, out=into[i])
                # [SCRATCH] before the buffer is reused (written into the ring's own buffers: nothing to check)
                parts.append(w if into is not None and w is into[i] else _not_viewing(w, raw))
                self.stats.bytes_read += slab.length
        finally:
            if buf is not None:
                self._direct.release(buf)
        self.stats.read_wait_us += int(waited * 1e6)
        self.stats.convert_us += int((time.perf_counter() - t0 - waited) * 1e6)
        build = self._build[key[0]]
        return Expert(build(parts[:2]), build(parts[2:]), sum(weight_nbytes(p) for p in parts))

    def _check_unchanged(self) -> None:
        """[FILE-CHANGED] RuntimeError when the file was modified in place since load (before any read)."""
        if os.fstat(self._fd).st_mtime_ns != self._mtime:
            raise RuntimeError(f"{self.path} changed since it was loaded; restart to serve the new file")

    def _read_raw(self, key: tuple[int, int], raw: RawBuild, nbytes: int) -> Expert:
        """[RAW] The expert read by the direct reader and built over its bytes by `raw` (no conversion); the
        buffer goes with the Expert (`_serve_unkept` gives it back). nbytes: what it counts as (a ring slot's)."""
        self._check_unchanged()
        slabs = self._slabs[key]
        t0 = time.perf_counter()
        buf, views = self._direct.take(key, slabs)
        self.stats.read_wait_us += int((time.perf_counter() - t0) * 1e6)
        try:
            e = raw.build(slabs, views, nbytes)
        except BaseException:
            self._direct.release(buf)
            raise
        e.raw = buf
        self.stats.bytes_read += sum(x.length for x in slabs)
        return e

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


def _close(fd: int, direct: "_DirectReader | None") -> None:
    if direct is not None:
        direct.close()
    os.close(fd)


class _DirectReader:
    """[DIRECT] Expert slabs read with O_DIRECT by READERS threads into reused, aligned buffers (one an expert:
    its three slabs, each widened to DIRECT_ALIGN boundaries), so a miss costs no page cache: nothing to
    advise or drop (the two posix_fadvise calls a slab cost ~0.6 ms an expert of CPU on the capped benchmark's
    turn 2), no kernel copy out of it (preadv's ~0.9 ms an expert), nothing charged to a cgroup twice, and the
    reads run while the caller converts and multiplies (the threads wait on the disk, GIL released).
    Buffers in use: the window's READ_AHEAD in flight, the one being converted, and the EXPERTS_IN_USE that
    [RAW] experts multiply from, so <= READ_AHEAD + 1 + EXPERTS_IN_USE
    (allocated as first needed, then reused). Not thread-safe itself: the store's one caller drives it."""

    def __init__(self, fd: int, span: int):
        from concurrent.futures import ThreadPoolExecutor
        self.fd, self.span = fd, span
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="ternlm-experts")
        self._free: list[np.ndarray] = []
        self._inflight: dict[tuple[int, int], tuple[np.ndarray, list, list[int]]] = {}

    @classmethod
    def open(cls, path: Path, slabs: dict, must: bool) -> "_DirectReader | None":
        """A reader for `path`, or None where the file system refuses O_DIRECT (a tmpfs, or no O_DIRECT on
        this OS) and `must` is False; with `must`, that OSError. Probes one aligned read."""
        span = max((_aligned_span(x) for x in slabs.values()), default=0)
        fd = -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            probe = _aligned_buffer(DIRECT_ALIGN)
            os.preadv(fd, [memoryview(probe)], 0)
        except (OSError, AttributeError):
            if fd >= 0:
                os.close(fd)
            if must:
                raise
            return None
        return cls(fd, span)

    def start(self, key: tuple[int, int], slabs: tuple[Slab, ...]) -> None:
        """Starts reading the expert's slabs (a no-op when it is already being read)."""
        if key in self._inflight:
            return
        buf = self._free.pop() if self._free else _aligned_buffer(self.span)
        futures, starts, at = [], [], 0
        for x in slabs:
            lo = x.offset - x.offset % DIRECT_ALIGN
            n = _aligned_len(x)
            futures.append(self._pool.submit(_pread_direct, self.fd, lo, buf[at:at + n], x.offset + x.length - lo))
            starts.append(at + x.offset - lo)
            at += n
        self._inflight[key] = (buf, futures, starts)

    def take(self, key: tuple[int, int], slabs: tuple[Slab, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(the buffer, each slab's bytes in it) once read; started now if it was not. The caller
        `release`s the buffer when it has converted the bytes. Raises the read's OSError."""
        self.start(key, slabs)
        buf, futures, starts = self._inflight.pop(key)
        try:
            for f in futures:
                f.result()
        except BaseException:
            self._wait_free(buf, futures)
            raise
        return buf, [buf[a:a + x.length] for a, x in zip(starts, slabs)]

    def release(self, buf: np.ndarray) -> None:
        self._free.append(buf)

    def drop(self, key: tuple[int, int]) -> None:
        """An expert read ahead and not asked for: its reads waited for (they write into the buffer), the
        buffer freed; errors ignored (it was never used)."""
        got = self._inflight.pop(key, None)
        if got is not None:
            self._wait_free(got[0], got[1])

    def _wait_free(self, buf: np.ndarray, futures: list) -> None:
        for f in futures:
            try:
                f.result()
            except Exception:       # noqa: BLE001 (a read nobody uses)
                pass
        self._free.append(buf)

    def close(self) -> None:
        for key in list(self._inflight):
            self.drop(key)
        self._pool.shutdown(wait=True)
        self._free.clear()
        os.close(self.fd)


def _aligned_len(x: Slab) -> int:
    """Bytes of the DIRECT_ALIGN-aligned range that holds the slab."""
    lo = x.offset - x.offset % DIRECT_ALIGN
    return -(-(x.offset + x.length - lo) // DIRECT_ALIGN) * DIRECT_ALIGN


def _aligned_span(slabs: tuple[Slab, ...]) -> int:
    return sum(_aligned_len(x) for x in slabs)


def _aligned_buffer(n: int) -> np.ndarray:
    """n bytes whose address is a multiple of DIRECT_ALIGN (O_DIRECT's rule for buffers)."""
    raw = np.empty(n + DIRECT_ALIGN, dtype=np.uint8)
    at = -raw.ctypes.data % DIRECT_ALIGN
    return raw[at:at + n]


def _pread_direct(fd: int, offset: int, view: np.ndarray, need: int) -> None:
    """Reads view's aligned range at offset (O_DIRECT: one request; the file's end may cut it short, so
    only `need` bytes must come). Runs on a reader thread (os.preadv releases the GIL)."""
    n = os.preadv(fd, [memoryview(view)], offset)
    if n < need:
        raise OSError(f"short read at {offset}: {n} of {need} bytes (file truncated?)")


def _signature(slabs: tuple[Slab, ...]) -> tuple:
    """What fixes a converted expert's field shapes and dtypes: each slab's (type, rows, cols)."""
    return tuple((x.qtype, x.rows, x.cols) for x in slabs)


class _Ring:
    """EXPERTS_IN_USE slots of one signature's buffers [RING], handed out in turn: a slot comes back
    after EXPERTS_IN_USE more takes. make() -> one slot (a list of blanks, one a slab); nbytes: a slot's;
    first: the first slot's buffers, already made."""

    def __init__(self, make: Callable[[], list], nbytes: int, first: list):
        self.make, self.nbytes = make, nbytes
        self.slots: list[list] = []
        self._first: list | None = first
        self._next = 0

    def take(self) -> list:
        if len(self.slots) < EXPERTS_IN_USE:
            slot, self._first = (self._first or self.make()), None
            self.slots.append(slot)
            return slot
        slot = self.slots[self._next]
        self._next = (self._next + 1) % EXPERTS_IN_USE
        return slot


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


READ_AHEAD = 48     # experts whose slabs are being read ahead of their get (StreamedExperts [READ-AHEAD]): a
                    # [PREFETCH] runs under a layer's attention, ~75 ms of reads at 1.8 GB/s (8 was 15 ms); with [RAW]
                    # a layer's held experts multiply faster than 24 misses read (~40 ms), and the disk idled: the
                    # capped 30B turn 2 in process waited 1.0-1.4 s for reads with 24, 0.34 s with 48 (0.13 with 96)
READERS = 4         # threads reading slabs with O_DIRECT (StreamedExperts [DIRECT]): reads in flight at once
DIRECT_ALIGN = 4096  # O_DIRECT's alignment of file offsets, lengths and buffers (4 KiB: any block size up to it)
EXPERTS_IN_USE = 8  # experts from `get` a caller uses at once; a not-kept one is valid for this many more
                    # not-kept gets (StreamedExperts [RING]; the native MoE layer runs this many in one call)
# Beside the resident parts, the KV and a step's work, what a streaming server grows by after the plan (the
# plan's `available` is measured after the interpreter, torch and the tokenizer are in: they are not in it):
# the server's own objects, allocator slack, the direct reads' buffers [DIRECT], a step's fixed part.
# Measured on the capped benchmark (benchmarks/results/moe-capped3/TABLE.md, "Budget up to the cap"): ~140 MB
# over the planned terms at 256 rows (with step_work_bytes' 200 KB a row). It was 256 MiB, with twice the
# step's work, and the cgroup peaked 230 MB under the cap. others // RESIDENT_SLACK more covers an error in
# the resident parts' estimate and keeps the process's VmHWM, which counts ~110 MB of shared libraries'
# pages that the cgroup does not, under the cap too.
EXPERT_OVERHEAD = (176 + 48 + 72) << 20     # + 48 MiB: READ_AHEAD 8 -> 24; + 72 MiB: 24 -> 48 (direct buffers of ~2.9 MB)
RESIDENT_SLACK = 8


def step_work_bytes(cfg, rows: int) -> int:
    """Bytes a prefill step of `rows` rows holds at its peak in one MoE layer, for the cache plan
    (a streamed cache that takes all the room leaves the chunk's activations none: under a cgroup
    cap, a 2,048-row chunk was OOM-killed, benchmarks/results/moe-capped). fp32 rows of: the
    residual, the norm's output, q/k/v and the attention's output, and the experts' gate|up and
    their product for each row's k experts (k * (2 I + I + hidden)): 200 KB a row on Qwen3-30B-A3B, where
    the capped benchmark's step grew the process by ~165 KB a row (VmHWM over the settled RSS: ~50 MB at
    256 rows, ~177 MB at 1,024; benchmarks/results/moe-capped3/TABLE.md). It was twice that, which left a
    1,024-row chunk's experts 257 MiB of a cap with ~340 MB unused. An estimate from the shapes; the
    fixed part of a step is in EXPERT_OVERHEAD. Pure."""
    h, k, inter = cfg.hidden_size, max(cfg.experts_per_token, 1), cfg.expert_intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_row = 4 * (3 * h + qkv + cfg.num_heads * cfg.head_dim + k * (3 * inter + h))
    return rows * per_row


CHUNK_RESIDENT = 256         # prefill rows a step (--chunk auto) where no expert streams: best measured (dense)
CHUNK_STREAMED_MAX = 2048    # --chunk auto's most rows a step where experts stream (streamed_chunk)


def streamed_chunk(cfg, budget: int) -> int:
    """--chunk auto where experts stream from the file: the prefill rows of a step. Why more than
    CHUNK_RESIDENT: every step sweeps the experts its rows use, and a few hundred rows use nearly all of
    them, so a prompt's misses (reads and conversions) scale with its chunks, not its tokens (the whole
    Qwen3-30B-A3B file under 8 GiB: turn 1 of ~2,000 tokens read 122.8 GB in 8 sweeps of 256 rows,
    benchmarks/RESULTS.md). The step's working memory (step_work_bytes) comes out of the expert cache's room,
    so: the most rows, a power of two from CHUNK_RESIDENT to CHUNK_STREAMED_MAX, whose work is at most a
    quarter of `budget` (the cache planned at CHUNK_RESIDENT rows). Pure."""
    rows = CHUNK_RESIDENT
    while rows < CHUNK_STREAMED_MAX and step_work_bytes(cfg, 2 * rows) <= budget // 4:
        rows *= 2
    return rows


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
    fits (at least 0: every use then reads; StreamedExperts' budget holds its rings [RING] too). Sizes in
    bytes, as the weights are held in memory.
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
    room = available - others - kv - EXPERT_OVERHEAD - others // RESIDENT_SLACK
    if experts <= room:
        return ExpertCachePlan(None, f"resident: experts {fs(experts)} fit in {fs(room)} beside the rest "
                                     f"and the KV ({fs(available)} available)")
    budget = max(room, 0)
    return ExpertCachePlan(budget, f"streamed: experts {fs(experts)} > {fs(room)} left beside the rest "
                                   f"{fs(others)} and KV {fs(kv)} ({fs(available)} available)")


# SwiGLU's middle: (gate, up) (n, I) each -> silu(gate) * up (n, I) in gate's dtype
Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """torch's SiLU times up: the experts' activation unless the layer gives another (`MoE(act=...)`)."""
    return F.silu(g) * u


def select_experts(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: (M, E) fp32 -> (indices (M, k) int64, values (M, k)) in rank order: largest first,
    equal values by lower expert index [TOP-K-TIES]. Per row: no row sees another."""
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    return indices[:, :k], values[:, :k]


@dataclass(frozen=True)
class SharedExpert:
    """qwen2moe's (qwen35moe's) shared expert: one more SwiGLU MLP that every row goes through, scaled per row by
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
                 layer: int, pack: bool = True, shared: SharedExpert | None = None, act: Act = silu_mul):
        """act: silu(gate) * up of every expert and the shared one (a row-wise function: [BATCH-INVARIANT])."""
        self.num_experts, self.hidden = router.shape
        self.act = act
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
            y = ex.down(self.act(g, u))                                        # (1, hidden)
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
            y = ex.down(self.act(g, u))                                        # (n, hidden)
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
        y = self.shared.down(self.act(g, u))                                   # (M, hidden)
        z = self.shared_gate(h.float())                                        # (M, 1) fp32, as the router
        # [BATCH-INVARIANT] sigmoid(z) as softmax([z, 0])[0]: the last-dim softmax computes each row alone,
        # while torch.sigmoid over the (M, 1) column takes its vector or its scalar path by the row's
        # place in the batch (1 ulp apart: a chunked prefill changed the logits' bits)
        gate = torch.softmax(F.pad(z, (0, 1)), dim=-1)[:, :1]                  # (M, 1)
        return y * gate.to(y.dtype)
