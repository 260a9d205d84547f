"""A mixture-of-experts decoder layer run by kernels/layer.c (qwen3moe, Mixtral, olmoe, qwen2moe: every projection
and expert quantized, in a lanes layout (fp32 activations) or an int layout (int8 activations, qint8.c: each
expert's gathered rows quantized once, its shares then integer products)).

Why: a MoE layer in torch is ~30 kernel calls and ~100 small torch ops a decoded token (router, norms,
RoPE, each expert's gate, up, down: each its own OpenMP region), while a dense layer is one layer.c call;
resident MoE decode ran at x0.55 of llama.cpp's that way (benchmarks/RESULTS.md, Mixture of experts).
Here a layer is four C calls and a little Python between them:
    tq_layer_attn    the attention half (layer.c's own: fp16 KV with it), h = the MLP's normed input
    tq_moe_route     each row's k experts (ascending index) and weights, in C
    store.get        the experts the rows use, ascending index: models/moe.py's store, the one place that
                     knows where they live (resident, or streamed from the file); its counters
    tq_moe_experts   those experts' products over their rows, every expert's share of blocks in one
                     parallel region; a streamed store's experts EXPERTS_IN_USE at a time (its contract)
    tq_moe_sum       x += each row's k weighted outputs, summed in ascending expert index
[BATCH-INVARIANT] as layer.c states it: a row's bits depend on that row alone, so prefill chunks,
decode and batches with other sequences give the same bits (tests/test_native_moe.py). These bits are
not the torch MoE's (another router product, another exp): the kernels' digest is in the KV namespace.
olmoe's q/k norms over the whole projection are layer.c data (qk_norm_full); qwen2moe's shared expert is
one more call (tq_moe_shared: every row, resident, its sigmoid gate), added last in tq_moe_sum.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from ..kernels.build import RAW_LAYOUT, RAW_TYPES, ROW_LAYOUTS, Kernels
from ..kernels.build import Part as _Part
from .native_layer import _Proj, _proj, layer_spec


class _Expert(ctypes.Structure):
    """layer.c's TqExpert."""
    _fields_ = [("gate_up", _Proj), ("down", _Proj)]


def _native_expert(ex) -> int:
    """ex: a models/moe.Expert -> the address of its _Expert, built once and kept on the Expert (it lives as
    long as the Expert's tensors do: a streamed expert's ring buffers are reused only by a new Expert object).
    RuntimeError when an expert is not in a lanes layout (build() checked what could be checked before)."""
    addr = getattr(ex, "_native_addr", None)
    if addr is None:
        keep: list = []
        gu, down = _proj(ex.gate_up, keep), _proj(ex.down, keep)
        for p in (gu, down):
            if isinstance(p, str):
                raise RuntimeError(f"native MoE layer: an expert it cannot run ({p})")
            if any(p.parts[i].layout in ROW_LAYOUTS for i in range(p.nparts)):
                raise RuntimeError("native MoE layer: an expert in a row layout (lanes only)")
        spec = _Expert(gu, down)
        ex._native, ex._native_keep, ex._native_addr = spec, keep, ctypes.addressof(spec)
        addr = ex._native_addr
    return addr


def _raw_only(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("an expert served as its GGML bytes [RAW] is multiplied by the native MoE layer only")


@dataclass(frozen=True)
class _RawExperts:
    """[RAW] (models/moe.py RawBuild) An expert the streamed store serves unkept, multiplied straight from its GGML
    blocks as read: its _Expert's parts are layer.c's layout 12 (mode: the slab's GGML type), which qint8.c's
    tq_int8_raw_range multiplies with the bits of the int layout the store would have converted it into. Only
    where the store converts experts into int layouts (int8 activations): those are the bits it must give."""
    hidden: int
    inter: int

    def takes(self, slabs) -> bool:
        gate, up, down = slabs
        return (all(x.qtype in RAW_TYPES and x.rows % 16 == 0 and x.cols % 256 == 0 for x in slabs)
                and gate.rows == up.rows == self.inter and down.rows == self.hidden
                and gate.cols == up.cols == self.hidden and down.cols == self.inter)

    def build(self, slabs, views, nbytes: int):
        from .moe import Expert

        def proj(xs, vs) -> _Proj:
            p = _Proj(nparts=len(xs), n_out=sum(x.rows for x in xs), bias=None)
            for i, (x, v) in enumerate(zip(xs, vs)):
                p.parts[i] = _Part(RAW_LAYOUT, x.qtype, x.rows, v.ctypes.data, 0, 0, 0, 0)
            return p
        spec = _Expert(proj(slabs[:2], views[:2]), proj(slabs[2:], views[2:]))
        ex = Expert(_raw_only, _raw_only, nbytes)
        ex._native, ex._native_keep, ex._native_addr = spec, list(views), ctypes.addressof(spec)
        return ex


def _raw_build(store, hidden: int, inter: int) -> "_RawExperts | None":
    """[RAW] for a streamed store that converts into int layouts, unless TERNLM_EXPERT_RAW=0 (every expert then
    converted, as before: an A/B switch for benchmarks; the bits are the same either way)."""
    if not (store.streamed and getattr(store, "int8", False)) or os.environ.get("TERNLM_EXPERT_RAW", "1") == "0":
        return None
    return _RawExperts(hidden, inter)


@dataclass
class NativeMoELayer:
    kernels: Kernels
    spec: object                 # layer_spec's _Layer, MLP empty
    per_row: int                 # scratch floats a batch row: the attention half's, then slots and experts'
    keep: list
    moe: object                  # models/moe.MoE: router, top_k, norm_topk_prob, store, layer
    router: torch.Tensor         # (E, hidden) fp32 contiguous
    act: int
    inter: int                   # an expert's intermediate size I
    layout: list[int]            # scratch floats a row: attention half, slots, experts' rows, shared expert
    shared: "_Expert | None" = None   # qwen2moe's shared expert (resident), and its gate (hid,) fp32
    shared_gate: "torch.Tensor | None" = None
    raw: "_RawExperts | None" = None  # [RAW]: experts served unkept multiplied from their blocks as read

    @classmethod
    def build(cls, kernels: Kernels, layer, cos: torch.Tensor, sin: torch.Tensor) -> "NativeMoELayer | str":
        """layer: a models/llama.Layer with a MoE MLP -> the native layer, or why not."""
        moe = getattr(layer, "moe", None)
        if moe is None:
            return "a dense layer (models/native_layer.py runs those)"
        if not kernels.lanes:
            return "the experts are in row layouts (TERNLM_AMX=1): layer.c's experts take lanes layouts"
        built = layer_spec(kernels, layer, cos, sin, mlp=False)
        if isinstance(built, str):
            return built
        spec, attn_per_row, keep = built
        cfg = layer.cfg
        inter = cfg.expert_intermediate_size
        if inter % 16:
            return f"an expert intermediate size {inter} not a multiple of 16"
        why = _experts_native(moe.store, layer.index)
        if why:
            return why
        router = _router_weight(moe)
        k, hid = cfg.experts_per_token, cfg.hidden_size
        shared = gate = None
        if moe.shared is not None:                               # qwen2moe: dense, every row, resident
            shared = _Expert(*(_proj(p, keep) for p in (moe.shared.gate_up, moe.shared.down)))
            if isinstance(shared.gate_up, str) or isinstance(shared.down, str) or shared.gate_up.n_out % 32:
                return "a shared expert layer.c does not take"
            gate = moe.shared.gate.float().reshape(-1).contiguous()     # (hid,)
            keep += [shared, gate]
        # scratch, a row: the attention half's | k slots | the experts' rows (k of them at most: gathered
        # input, gate|up, SiLU * up, output) | the shared expert's output and rows
        layout = [attn_per_row, k * hid, k * (2 * hid + 3 * inter),
                  0 if shared is None else hid + 3 * (shared.gate_up.n_out // 2)]
        return cls(kernels, spec, sum(layout), keep + [router], moe, router, spec.act, inter, layout, shared, gate,
                   _raw_build(moe.store, hid, inter))

    def __call__(self, x: torch.Tensor, table: torch.Tensor, scratch: torch.Tensor) -> None:
        """x: (M, hidden) fp32 contiguous, updated in place; table: llama.segment_table of the batch;
        scratch: >= M * per_row fp32. Side effects: x, the caches, the store's counters (a `get` per
        expert used; a streamed store may read experts from the file)."""
        M, hid, lib, nt = x.shape[0], self.spec.hidden, self.kernels.lib, torch.get_num_threads()
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == hid
                and scratch.dtype == torch.float32 and scratch.numel() >= M * self.per_row):
            raise ValueError("native MoE layer: input or scratch does not match")
        if lib.tq_layer_attn(ctypes.addressof(self.spec), table.data_ptr(), table.shape[0], x.data_ptr(), M,
                             scratch.data_ptr(), nt) != 0:
            raise ValueError(f"native MoE layer: unsupported shape or batch (rows {M})")
        moe, k, E = self.moe, self.moe.top_k, self.moe.num_experts
        h = scratch[:M * hid]                                     # (M, hid): the experts' input
        _, slots, work, shared_out = torch.split(scratch[:M * self.per_row], [M * n for n in self.layout])
        route = torch.empty((M, k), dtype=torch.int64)
        weights = torch.empty((M, k), dtype=torch.float32)
        if lib.tq_moe_route(h.data_ptr(), M, hid, self.router.data_ptr(), E, k, int(moe.norm_topk_prob),
                            route.data_ptr(), weights.data_ptr(), nt) != 0:
            raise ValueError("native MoE layer: routing failed")
        used, counts = _used(route)
        store, layer = moe.store, moe.layer
        held = len(used)
        if store.streamed:       # experts held first: their products run while the misses are read [HELD-FIRST]
            used, counts, held = _held_first(store, layer, used, counts)
        store.read_ahead(layer, used)                             # a hint: no bits change
        sweep = M * k >= PREFETCH_ROWS * E               # the step uses ~every expert: its reads run ahead [PREFETCH]
        group = len(used) if not store.streamed else _in_use()
        for g0, g1 in _spans(len(used), held, group, group if sweep else MISS_GROUP):
            ids, ns = used[g0:g1], counts[g0:g1]
            got = [store.get(layer, e, n, self.raw) for e, n in zip(ids, ns)]    # alive until the call returns: a
            # served-not-kept expert (and its _Expert) may have no other owner
            if store.streamed and g1 >= len(used) and sweep:
                store.prefetch(layer + 1)     # [PREFETCH] the next layer will use ~every expert: no bits change
            pairs = sorted(zip(ids, (_native_expert(ex) for ex in got)))    # layer.c takes a group ascending
            table = torch.tensor(list(zip(*pairs)), dtype=torch.int64)    # (2, n): indices; _Expert addresses
            if lib.tq_moe_experts(h.data_ptr(), M, hid, self.inter, k, route.data_ptr(), weights.data_ptr(),
                                  len(ids), table.data_ptr(), table.data_ptr() + 8 * len(ids), self.act,
                                  slots.data_ptr(), work.data_ptr(), work.numel(), nt) != 0:
                raise ValueError("native MoE layer: the experts' products failed")
        shared = 0
        if self.shared is not None:                               # added last, to the routed sum [SUM-ORDER]
            if lib.tq_moe_shared(h.data_ptr(), M, hid, ctypes.addressof(self.shared), self.shared_gate.data_ptr(),
                                 shared_out.data_ptr(), shared_out.data_ptr() + 4 * M * hid, nt) != 0:
                raise ValueError("native MoE layer: the shared expert failed")
            shared = shared_out.data_ptr()
        lib.tq_moe_sum(x.data_ptr(), slots.data_ptr(), shared, M, k, hid, nt)


def _used(route: torch.Tensor) -> tuple[list[int], list[int]]:
    """route (M, k) -> the experts used, ascending, and how many (m, j) each. Pure. (A decode step's few
    indices counted in Python: torch.unique's dispatch cost more than the counting.)"""
    if route.numel() <= 64:
        counts: dict[int, int] = {}
        for e in route.view(-1).tolist():
            counts[e] = counts.get(e, 0) + 1
        used = sorted(counts)
        return used, [counts[e] for e in used]
    used, n = torch.unique(route, sorted=True, return_counts=True)
    return used.tolist(), n.tolist()


def _held_first(store, layer: int, used: list[int], counts: list[int]) -> tuple[list[int], list[int], int]:
    """used (ascending) and their counts, the experts the store holds first, each part still ascending
    [HELD-FIRST]: the read-ahead of the misses then starts with the layer, under the held experts' products;
    and how many are held. Order only: each expert writes its own rows' slots, tq_moe_sum adds them in ascending
    index. Pure but for asking the store (`holds`: no counter changes)."""
    holds = getattr(store, "holds", None)
    if holds is None:
        return used, counts, len(used)
    held = [holds(layer, e) for e in used]
    order = [i for i, h in enumerate(held) if h] + [i for i, h in enumerate(held) if not h]
    return [used[i] for i in order], [counts[i] for i in order], sum(held)


def _spans(n: int, held: int, group: int, miss_group: int) -> list[tuple[int, int]]:
    """[MISS-GROUPS] The product calls' ranges of n experts whose first `held` are held: those `group` at a time,
    then the misses `miss_group` at a time. Why: a call multiplies after all its experts are read, so a miss's
    product (and, served as read [RAW], its blocks' conversion) overlaps the later misses' reads only from the
    next call on; in decode steps a layer's ~5 misses in one call left the disk idle while they multiplied and
    the products idle while they read. Order only: no bits change (each expert writes its own rows' slots). Pure."""
    spans = [(g, min(g + group, held)) for g in range(0, held, group)]
    return spans + [(g, min(g + miss_group, n)) for g in range(held, n, miss_group)]


# [MISS-GROUPS] misses a product call takes in a step that does not sweep the experts (decode, short tails): one,
# so each multiplies as soon as it is read. In process on the capped 30B's 5.7 GB cache, 15 decode steps: 1.75
# tok/s instead of 1.23 (read wait 4.7 s instead of 9.3). A sweeping step (a prefill chunk) keeps EXPERTS_IN_USE a
# call: its misses were read ahead [PREFETCH], and a call an expert cost 0.4-0.6 s more of turn 2 (238 rows).
MISS_GROUP = 1


# [PREFETCH] (models/moe.py): a step whose rows pick at least this many times as many experts as a layer has
# uses nearly all of them (each unused with probability ~e^-PREFETCH_ROWS at k << E); decode steps never guess.
PREFETCH_ROWS = 8


def _in_use() -> int:
    """How many experts a streamed store lets a caller hold at once (models/moe.py's contract)."""
    from . import moe
    return getattr(moe, "EXPERTS_IN_USE", 1)


def _router_weight(moe) -> torch.Tensor:
    """The router's (E, hidden) fp32 weight as given at load (moe.MoE keeps it packed for torch)."""
    w = getattr(moe, "router_weight", None)
    if w is None:
        raise RuntimeError("native MoE layer: the MoE keeps no router weight")
    return w.float().contiguous()


def _experts_native(store, layer: int) -> str:
    """Why this layer's experts cannot run in layer.c, or "" (resident: each expert's projections are
    checked; streamed: every slab's GGML type converts to a lanes layout, qweight.QUANTIZED_TYPES)."""
    if store.streamed:
        from gguf import GGMLQuantizationType as QT
        from ..linear.qweight import QUANTIZED_TYPES
        bad = sorted(QT(t).name for t in store.slab_types(layer) if QT(t) not in QUANTIZED_TYPES)
        return f"experts of type {', '.join(bad)} (dequantized: no lanes product)" if bad else ""
    for ex in store.of_layer(layer):
        for proj in (ex.gate_up, ex.down):
            p = _proj(proj, [])
            if isinstance(p, str):
                return p
            if any(p.parts[i].layout in ROW_LAYOUTS for i in range(p.nparts)):
                return "experts in a row layout"
    return ""
