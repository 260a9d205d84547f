"""Load a GGUF file (llama, qwen2, qwen3, phi3, qwen3moe, Mixtral, qwen2moe, olmoe, gemma3, qwen35, qwen35moe, qwen3next, nemotron_h, lfm2) into a LoadedModel: HF names/layouts, dequantized to a dtype.

Three jobs, in this order in the file:
  1. open the file fast (GGUFReader over a plain ndarray view of the memory map),
  2. dequantize GGML blocks with vectorised torch code (bit-exact with ``gguf.quants.dequantize``),
  3. map metadata to ModelConfig and tensor names/layouts to Hugging Face's.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import mmap
import os
import re
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from .config import SUPPORTED_ARCHS, ModelConfig, UnsupportedModelError
from .families import FAMILIES
from ..text.tokenizer import Tokenizer
from ..linear.ggml_blocks import _bits, _f16, _k_low_nibbles, _k_scales_mins, _nibbles, pack_bits  # noqa: F401
from . import lfm2, nemotron_h
from .recurrent.deltanet import fused_rows
from .loaded import LoadedModel
from .registry import cached_sha256
from .rope import Rope, rotary_row_order
from .templates import with_builtin_template

log = logging.getLogger(__name__)
_U64 = struct.Struct("<Q")


# ---------------------------------------------------------------------------------------------
# 1. Opening.
# ---------------------------------------------------------------------------------------------

class FastGGUFReader(GGUFReader):
    """GGUFReader whose ``data`` is a plain ndarray over the same memory map.

    Why: the reader slices ``data`` once per metadata item (~250k times for a 49k-token vocab), and
    np.memmap's Python-level ``__array_finalize__`` makes each slice ~5x slower than a plain view;
    this cut opening smollm2 from ~2.2 s to ~0.8 s. Arrays are parsed in one loop each
    (_get_field_parts below): qwen2.5's open 5.4 s -> 0.7 s. The memmap object is kept alive beside it.
    Mode 'c' (copy-on-write) makes the views writable, so torch.from_numpy has nothing to warn about;
    nothing here writes to them.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._memmap = value
        self._plain_data = np.asarray(value)  # same buffer, base-class ndarray

    def __init__(self, path: os.PathLike[str] | str):
        super().__init__(path, mode="c")
        self.mtp_tensors = self._set_aside_mtp_blocks()

    def _set_aside_mtp_blocks(self) -> list[ReaderTensor]:
        """[MTP-ASIDE] A file with multi-token-prediction blocks (`{arch}.nextn_predict_layers` = n: llama.cpp's
        converter appends them as the last n of block_count's blocks, e.g. Qwen3.5's and Qwen3-Next's own
        checkpoints converted without --no-mtp) runs its first block_count - n blocks only, as llama.cpp does
        for the main model. Those blocks' tensors move from ``tensors`` to the returned list, so every reader
        of ``tensors`` (config, the tensor check, the loader, the expert slabs, the fit check) sees the main
        model alone. Side effect: ``self.tensors`` loses them."""
        arch = self.get_field("general.architecture")
        nextn = arch is not None and self.get_field(f"{arch.contents()}.nextn_predict_layers")
        if not nextn or not int(nextn.contents()):
            return []
        first = int(_field(self, f"{arch.contents()}.block_count")) - int(nextn.contents())
        aside = [t for t in self.tensors if (m := _LAYER_RE.fullmatch(t.name)) and int(m.group(1)) >= first]
        names = {t.name for t in aside}
        self.tensors = [t for t in self.tensors if t.name not in names]
        log.info("%d multi-token-prediction block(s) (%d tensors) set aside: the main model's %d blocks run",
                 int(nextn.contents()), len(aside), first)
        return aside

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        """The base class's parts for an array of strings or scalars, built in one loop.

        Why: the base class recurses once per element, each through three numpy views and an enum
        lookup: qwen2.5's 151,936-token vocabulary and 151,387 merges took ~5 s of its 24 s load (455k
        recursive calls). Here the same ReaderField structure comes out (per element the same parts,
        dtypes and bytes, the same data indices and types; tests/test_loaders.py compares them with the
        base class on a real file) from one struct read and two slices per string. Anything else (a
        scalar, nested arrays, a big-endian file) goes to the base class."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(int(raw_itype[0]))      # an unknown type raises ValueError, as the base does
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != GGUFValueType.STRING and nptype is None:
            return super()._get_field_parts(orig_offs, raw_type)
        data, n, offs = self.data, int(alen[0]), orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == GGUFValueType.STRING:   # per string: its uint64 length, then its bytes
            idxs = list(range(3, 3 + 2 * n, 2))
            for _ in range(n):
                (slen,) = _U64.unpack_from(data, offs)
                parts += (data[offs:offs + 8].view(np.uint64), data[offs + 8:offs + 8 + slen])
                offs += 8 + slen
        else:                               # per scalar: a one-element view
            size = np.dtype(nptype).itemsize
            arr = data[offs:offs + n * size].view(nptype)
            parts += (arr[i:i + 1] for i in range(n))
            idxs = list(range(2, 2 + n))
            offs += n * size
        return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY] + ([itype] if n else [])

    def drop_pages(self, offset: int, length: int) -> None:
        """Drop the file's bytes [offset, offset + length) from the resident set (madvise MADV_DONTNEED on
        the map; whole pages, so a neighbour's edge page too). Safe: the pages are clean copy-on-write
        pages (nothing writes to the map), so a later read faults the same bytes in again from the page
        cache. Why: load_gguf reads each tensor once into copies; the pages read stayed resident until
        the map closed after the load (qwen2.5-0.5b's peak: +445 MiB). A no-op without madvise."""
        mm, advice = getattr(self._memmap, "_mmap", None), getattr(mmap, "MADV_DONTNEED", None)
        if mm is None or advice is None or self._memmap.offset != 0 or not 0 <= offset < len(mm):
            return                                  # (offset 0: the map's offsets are the file's)
        start = offset - offset % mmap.PAGESIZE     # madvise wants a page-aligned start
        mm.madvise(advice, start, length + offset - start)


# ---------------------------------------------------------------------------------------------
# 2. Dequantization. Each function takes raw blocks, a uint8 tensor (n_blocks, type_size), and
#    returns float32 (n_blocks, block_size). Arithmetic order follows gguf.quants so results are
#    bit-identical (d * q, then + m or - min).
# ---------------------------------------------------------------------------------------------

_QK_K = 256  # super-block size of the K-quants


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:   # 34 bytes: d f16, q int8[32]
    return b[:, 2:].view(torch.int8).float() * _f16(b, 0)


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:   # 18 bytes: d, qs[16] (4-bit, offset 8)
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8.0)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:   # 20 bytes: d, m, qs[16]
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:   # 22 bytes: d, qh u32 (5th bits), qs[16] (offset 16)
    q = _nibbles(b[:, 6:]) | (_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16.0)


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:   # 24 bytes: d, m, qh u32, qs[16]
    q = _nibbles(b[:, 8:]) | (_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:   # 144 bytes: d, dmin, scales[12], qs[128]
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = (_f16(b, 0) * sc.float()).unsqueeze(-1)   # (n, 8, 1)
    offset = (_f16(b, 2) * mn.float()).unsqueeze(-1)  # (n, 8, 1)
    return (scale * _k_low_nibbles(b[:, 16:]).float() - offset).reshape(-1, _QK_K)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:   # 176 bytes: d, dmin, scales[12], qh[32], qs[128]
    sc, mn = _k_scales_mins(b[:, 4:16])
    scale = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    offset = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    # Sub-block k takes its 5th bit from bit k of the 32 qh bytes.
    high = (b[:, 16:48].unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1  # (n, 8, 32)
    q = _k_low_nibbles(b[:, 48:]) | (high << 4)
    return (scale * q.float() - offset).reshape(-1, _QK_K)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:   # 210 bytes: ql[128], qh[64], scales int8[16], d
    ql = b[:, :128].reshape(-1, 2, 64)                                   # two halves of 128 values
    low = torch.stack((ql & 0x0F, ql >> 4), dim=2).reshape(-1, 8, 32)    # (n, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 32)
    high = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(-1, 8, 32)
    q = ((low | (high << 4)).float() - 32.0).reshape(-1, 16, 16)        # 16 sub-blocks of 16
    scale = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # (n, 16, 1)
    return (scale * q).reshape(-1, _QK_K)


# qtype -> (block_size, type_size, dequantizer)
_BLOCK_DEQUANT = {
    QT.Q8_0: (32, 34, _deq_q8_0),
    QT.Q4_0: (32, 18, _deq_q4_0),
    QT.Q4_1: (32, 20, _deq_q4_1),
    QT.Q5_0: (32, 22, _deq_q5_0),
    QT.Q5_1: (32, 24, _deq_q5_1),
    QT.Q4_K: (_QK_K, 144, _deq_q4_k),
    QT.Q5_K: (_QK_K, 176, _deq_q5_k),
    QT.Q6_K: (_QK_K, 210, _deq_q6_k),
}
_FLOAT_TYPES = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
SUPPORTED_QTYPES = tuple(t.name for t in (*_FLOAT_TYPES, *_BLOCK_DEQUANT))

_CHUNK_BLOCKS = 1 << 14  # blocks per job: bounds float32 temporaries (~16 MB for K-quants) and
                         # gives the worker threads pieces small enough to balance well


def dequantize_jobs(raw: torch.Tensor, qtype: QT, n_elements: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """Raw little-endian GGML bytes (uint8, flat) -> (flat output of ``n_elements`` in ``dtype``,
    jobs that fill it). The output holds garbage until every job has run; jobs touch disjoint
    slices, so they may run in any order on any thread.

    Float types are converted immediately (no jobs). Raises KeyError for a type without a
    dequantizer (the caller names the tensor).
    """
    if qtype in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[qtype]).to(dtype, copy=True), []
    block_size, type_size, fn = _BLOCK_DEQUANT[qtype]
    blocks = raw.view(-1, type_size)                       # (n_blocks, type_size)
    out = torch.empty(n_elements, dtype=dtype)
    view = out.view(-1, block_size)                        # (n_blocks, block_size)

    def job(start: int, stop: int) -> None:
        view[start:stop] = fn(blocks[start:stop])          # casts to dtype chunk by chunk

    jobs = [functools.partial(job, start, min(start + _CHUNK_BLOCKS, blocks.shape[0]))
            for start in range(0, blocks.shape[0], _CHUNK_BLOCKS)]
    return out, jobs


def dequantize(raw: torch.Tensor, qtype: QT, n_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """Raw GGML bytes (uint8, flat) -> flat tensor in ``dtype``, on the calling thread."""
    out, jobs = dequantize_jobs(raw, qtype, n_elements, dtype)
    for job in jobs:
        job()
    return out


@contextlib.contextmanager
def _parallel_jobs() -> Iterator[Callable[[list[Callable[[], None]]], None]]:
    """Yields run(jobs): runs jobs on a pool of torch.get_num_threads() Python threads while torch's
    own intra-op parallelism is set to 1 (restored on exit).

    Why: each dequantizer is ~10 small torch kernels; with intra-op threads every kernel ends in a
    barrier, and on a busy machine (another process on a core) each barrier waits a scheduler
    slice: loading smollm2 went from 0.3 s to 16 s. Independent jobs on plain threads (torch
    releases the GIL inside kernels) use the same cores without barriers. Side effect: while this
    is active, torch ops elsewhere in the process run single-threaded.
    """
    workers = max(1, torch.get_num_threads())
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ternlm-dequant") as pool:
            def run(jobs: list[Callable[[], None]]) -> None:
                for future in [pool.submit(j) for j in jobs]:
                    future.result()  # re-raises a job's exception here
            yield run
    finally:
        torch.set_num_threads(previous)


def _tensor_bytes(t: ReaderTensor) -> torch.Tensor:
    """The tensor's bytes in the memory map as a flat uint8 tensor (no copy)."""
    return torch.from_numpy(t.data.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------
# 3. Metadata and names.
# ---------------------------------------------------------------------------------------------

_MISSING = object()

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",      # phi3: q, k, v fused (split at load)
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture of experts: the router, and every expert's matrix stacked in one 3-D tensor
    # (GGUF [hidden, ff, E] = torch (E, ff, hidden)); `expert_parts` names each expert's slab
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.*.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.*.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.*.down_proj.weight",
    # qwen2moe's shared expert (resident, dense) and its gate: [hidden] or [hidden, 1] = torch (hidden,) or (1, hidden)
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    # Gemma's norms after attention and after the MLP (ModelConfig.post_norms); in such a file ffn_norm
    # is the MLP's pre-norm, pre_feedforward_layernorm (_POST_NORM_NAMES)
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_POST_NORM_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight"}
# qwen35's gated DeltaNet layers (llama.cpp's converter: A stored as -exp(A_log), dt_bias as ssm_dt.bias, the
# conv kernel squeezed to (channels, K), norms but ssm_norm stored as 1 + w, V heads in its tiled order).
# qwen3next: the same but b and a in one ssm_ba, interleaved per key head as transformers' in_proj_ba (split by
# hf_parts), and V heads left grouped (its converter's Qwen3NextModel has no V reorder: Family.gguf_v_tiled)
_DELTANET_NAMES = {
    "ssm_a": "linear_attn.A", "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_norm.weight": "linear_attn.norm.weight", "ssm_out.weight": "linear_attn.out_proj.weight",
}
_DELTANET_BA = {True: ("ssm_ba.weight",), False: ("ssm_alpha.weight", "ssm_beta.weight")}   # by "has ssm_ba"
# qwen35: post_attention_norm is the MLP's input norm (llama's post_attention_layernorm), no ffn_norm; the MLP's
# tensors are _DENSE_MLP's, or (qwen35moe) _MOE_PER_LAYER's and _SHARED_PER_LAYER's, on either layer kind
_QWEN35_PER_LAYER = ("attn_norm.weight", "post_attention_norm.weight")
_QWEN35_ATTN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
# Not weights: RoPE frequency factors, read into the config (_rope_from_gguf).
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_REQUIRED_PER_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                       "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                       "ffn_down.weight")
_DENSE_MLP = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_MOE_PER_LAYER = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_SHARED_PER_LAYER = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def hf_name(gguf_name: str, config: ModelConfig | None = None) -> str | None:
    """GGUF tensor name -> Hugging Face parameter name; None for a name this engine does not know.
    config: with post_norms (Gemma), ffn_norm is pre_feedforward_layernorm; without a config a norm's
    name is only good for telling it is a known norm (the weights' names come from hf_parts)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layout = FAMILIES[config.arch].layout if config is not None else "llama"
    if layout == "nemotron_h":          # each layer's names by its block
        return nemotron_h.gguf_name(gguf_name, config)
    if layout == "lfm2":                # each layer's names by its mixer
        return lfm2.gguf_name(gguf_name, config)
    m = _LAYER_RE.fullmatch(gguf_name)
    layer = int(m.group(1)) if m else -1       # a layer past block_count (an MTP block): no kind, not ours
    if config is not None and 0 <= layer < config.num_layers and config.kind(layer) == "deltanet":
        shared = _QWEN35_PER_LAYER + _DENSE_MLP + _MOE_PER_LAYER + _SHARED_PER_LAYER     # both kinds have these
        name = _DELTANET_NAMES.get(m.group(2)) or (_LAYER_NAMES.get(m.group(2)) if m.group(2) in shared else None)
        return None if name is None else f"model.layers.{m.group(1)}.{name}"
    if m and config is not None and config.post_norms and m.group(2) in _POST_NORM_NAMES:
        return f"model.layers.{m.group(1)}.{_POST_NORM_NAMES[m.group(2)]}"
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def expert_parts(name: str, num_experts: int) -> list[tuple[str, int]] | None:
    """A stacked expert tensor's HF name (hf_name: "...mlp.experts.*.gate_proj.weight") -> each
    expert's own name and index [(".../mlp.experts.{e}.gate_proj.weight", e)]; None for any other
    tensor. Expert e is slab e of the (E, rows, in) tensor: whole rows, so exact when quantized too."""
    if ".experts.*." not in name:
        return None
    return [(name.replace(".experts.*.", f".experts.{e}."), e) for e in range(num_experts)]


def _moe_from_gguf(reader: GGUFReader, arch: str, names: dict[str, ReaderTensor]) -> dict:
    """ModelConfig's expert fields from `{arch}.expert_*` metadata; {} for a dense model. Mixtral
    files are llama files with expert tensors (llama.expert_count) and no expert_feed_forward_length:
    their feed_forward_length is the expert's. Weights are renormalised over the top k (llama.cpp
    does for llama, qwen3moe and qwen35moe) unless the file says expert_weights_norm = false; qwen2moe and
    olmoe the other way round (Family.gguf_topk_normed: llama.cpp builds them with norm_w = false whatever the
    file says, qwen2moe.cpp, olmoe.cpp; real Qwen1.5/2-MoE and OLMoE files all say false). A shared expert
    (qwen2moe, qwen35moe) is there when its tensors are: its width from ffn_gate_shexp (llama.cpp reads no
    expert_shared_count for qwen2moe)."""
    count = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if not count:
        return {}
    shexp = names.get("blk.0.ffn_gate_shexp.weight")
    shared = int(_field(reader, f"{arch}.expert_shared_count", 0) or 0)
    gating = int(_field(reader, f"{arch}.expert_gating_func", 1) or 1)      # 1: softmax
    scale = float(_field(reader, f"{arch}.expert_weights_scale", 1.0) or 1.0)
    if shared > 1 or (shared and shexp is None) or gating != 1 or scale != 1.0:
        raise UnsupportedModelError(f"mixture of experts with shared experts ({shared}), gating function "
                                    f"{gating} or weights scale {scale}: only softmax routing with at most "
                                    f"one shared expert (ffn_*_shexp tensors) is supported")
    gate = names.get("blk.0.ffn_gate_exps.weight")
    default_ff = int(gate.shape[1]) if gate is not None else int(_field(reader, f"{arch}.feed_forward_length"))
    return dict(num_experts=count, experts_per_token=int(_field(reader, f"{arch}.expert_used_count")),
                expert_intermediate_size=int(_field(reader, f"{arch}.expert_feed_forward_length", default_ff)),
                norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", FAMILIES[arch].gguf_topk_normed)),
                shared_expert_intermediate_size=0 if shexp is None else int(shexp.shape[1]))


def _field(reader: GGUFReader, key: str, default=_MISSING):
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise UnsupportedModelError(f"GGUF metadata {key!r} is missing")
        return default
    return field.contents()


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    """GGUF metadata (+ tensor presence) -> ModelConfig; UnsupportedModelError for what we can't run."""
    if reader.byte_order != "I":
        raise UnsupportedModelError("big-endian GGUF files are not supported")
    arch = _field(reader, "general.architecture")
    family = FAMILIES.get(arch)
    if family is not None and family.layout == "nemotron_h":   # one block a layer, kinds from the tensors
        return nemotron_h.config_from_gguf(functools.partial(_field, reader), arch, {t.name: t for t in reader.tensors})
    if family is not None and family.layout == "lfm2":         # short convs beside attention, kinds from the tensors
        return lfm2.config_from_gguf(functools.partial(_field, reader), {t.name: t for t in reader.tensors})
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    names = {t.name: t for t in reader.tensors}

    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim > head_dim or rope_dim % 2:
        raise UnsupportedModelError(
            f"head sizes key={head_dim} value={value_dim} rope={rope_dim}: only equal key and value sizes "
            f"and an even rotary size up to them are supported"
        )

    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(_field(reader, f"{arch}.vocab_size"))
    embd_rows = int(names["token_embd.weight"].shape[-1])  # GGUF shape is [in, out] = [hidden, vocab]
    if embd_rows != vocab:
        # The embedding decides the logits' width; the token list is only what the tokenizer knows.
        log.warning("token list has %d entries but token_embd has %d rows; using %d", vocab, embd_rows, embd_rows)
        vocab = embd_rows

    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    context = int(_field(reader, f"{arch}.context_length"))
    window = _field(reader, f"{arch}.attention.sliding_window", None)
    # [MTP-ASIDE]: the last nextn_predict_layers blocks are multi-token prediction, not the main model's
    layers = int(_field(reader, f"{arch}.block_count")) - int(_field(reader, f"{arch}.nextn_predict_layers", 0))
    kinds = _layer_kinds_from_gguf(reader, arch, names, hidden, heads, head_dim, layers) \
        if family.kinds == "gemma3" else {}
    moe = _moe_from_gguf(reader, arch, names)
    if reader.get_field(f"{arch}.ssm.conv_kernel") is not None:     # recurrent layers: a hybrid file
        kinds = _hybrid_from_gguf(reader, arch, layers)
    first = f"blk.{kinds['layer_kinds'].index('attention')}." if "attention" in kinds.get("layer_kinds", ()) else "blk.0."
    if not kinds and window is not None and 0 < int(window) < context:
        # Phi-3-mini-4k's 2,047-token window on every layer: within it attention is full, so the
        # model runs exactly up to the window; past it would need windowed attention (issue 37).
        log.warning("%s: sliding window %d < context %d; context limited to %d", arch, window, context, window)
        context = int(window)
    return ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        # qwen35moe's converter writes none (every MLP is experts): the experts' width then
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", moe["expert_intermediate_size"]) if moe
                              else _field(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=first + "attn_q.bias" in names,
        qk_norm=first + "attn_q_norm.weight" in names,
        qk_norm_full=family.qk_norm_full and "blk.0.attn_q_norm.weight" in names,
        rope=_rope_from_gguf(reader, arch, theta, rope_dim if rope_dim < head_dim else 0, names),
        **moe,
        **kinds,
    )


def _hybrid_from_gguf(reader: GGUFReader, arch: str, layers: int) -> dict:
    """qwen35's per-layer kinds and DeltaNet sizes: attention.recurrent_layers (or every
    full_attention_interval-th layer attention), ssm.{conv_kernel, state_size (dk), group_count (key heads),
    time_step_rank (value heads), inner_size (value heads x dv)}; the converter's V heads are tiled (qwen35,
    qwen35moe) or grouped as transformers has them (qwen3next): the file does not say, its arch does."""
    field = reader.get_field(f"{arch}.attention.recurrent_layers")
    if field is not None:
        recurrent = [bool(x) for x in field.contents()]
        if len(recurrent) == int(_field(reader, f"{arch}.block_count")):     # it names the MTP blocks too
            recurrent = recurrent[:layers]
    else:
        every = int(_field(reader, f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    if len(recurrent) != layers:
        raise UnsupportedModelError(f"{arch}.attention.recurrent_layers has {len(recurrent)} entries, not {layers}")
    hv = int(_field(reader, f"{arch}.ssm.time_step_rank"))
    hk = int(_field(reader, f"{arch}.ssm.group_count"))
    return dict(layer_kinds=tuple("deltanet" if r else "attention" for r in recurrent), attn_output_gate=True,
                linear_key_heads=hk, linear_value_heads=hv, linear_key_dim=int(_field(reader, f"{arch}.ssm.state_size")),
                linear_value_dim=int(_field(reader, f"{arch}.ssm.inner_size")) // hv,
                linear_conv_kernel=int(_field(reader, f"{arch}.ssm.conv_kernel")),
                linear_v_tiled=hk != hv and FAMILIES[arch].gguf_v_tiled)


GEMMA3_SWA_PATTERN = 6      # llama.cpp's set_swa_pattern(6): layers 5, 11, ... global, the rest windowed
GEMMA3_LOCAL_THETA = 10000.0


def _layer_kinds_from_gguf(reader: GGUFReader, arch: str, names: dict[str, ReaderTensor], hidden: int,
                           heads: int, head_dim: int, layers: int) -> dict:
    """ModelConfig's per-layer kinds of a gemma3 file, with what the file leaves implicit defaulted as
    llama.cpp does: the 5-local-to-1-global pattern (or `attention.sliding_window_pattern`: a period, or
    one bool per layer, true = windowed), local RoPE base 10k unscaled (`rope.freq_base_swa` if given;
    the global rope, with its linear scaling, is the file's), the query scale 1/sqrt(head_dim) except
    27B's (62 layers) 1/sqrt(hidden/heads) (transformers' query_pre_attn_scalar; `attention.scale` if
    given). The converter stored every norm weight as 1 + w, so the norms here are plain x * w."""
    if _field(reader, f"{arch}.attn_logit_softcapping", None):
        raise UnsupportedModelError("attention logit soft-capping is not supported")
    window = int(_field(reader, f"{arch}.attention.sliding_window"))
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(f"sliding_window_pattern has {len(pattern)} entries for {layers} layers")
        windowed = [bool(x) for x in pattern]
    else:
        windowed = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    scale = _field(reader, f"{arch}.attention.scale", None)
    if scale is None:
        scale = (hidden // heads if layers == 62 else head_dim) ** -0.5
    local = float(_field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_THETA))
    return dict(layer_windows=tuple(window if w else 0 for w in windowed), swa_rope=Rope(theta=local),
                post_norms="blk.0.post_attention_norm.weight" in names, mlp_act="gelu_tanh",
                embed_scale=hidden ** 0.5, query_scale=float(scale),
                final_logit_softcap=float(_field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0))


def _float_values(t: ReaderTensor) -> tuple[float, ...]:
    if t.tensor_type != QT.F32:
        raise UnsupportedModelError(f"tensor {t.name} is {t.tensor_type.name}; rope factors must be F32")
    return tuple(float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1))


def _rope_from_gguf(reader: GGUFReader, arch: str, theta: float, rotary_dim: int,
                    names: dict[str, ReaderTensor]) -> Rope | None:
    """The file's RoPE variant (models/rope.py), or None for plain RoPE. Metadata keys and factor
    tensors as llama.cpp's converter writes them: `rope.scaling.*` (linear, yarn, longrope) and the
    tensors `rope_freqs` (Llama 3.1's per-frequency divisors) and `rope_factors_long/short` (Phi-3)."""
    kind = _field(reader, f"{arch}.rope.scaling.type", None) or "none"
    factor = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    original = int(_field(reader, f"{arch}.rope.scaling.original_context_length", 0))
    attn = _field(reader, f"{arch}.rope.scaling.attn_factor", None)
    common = dict(theta=theta, rotary_dim=rotary_dim, attention_factor=None if attn is None else float(attn))
    freqs = _float_values(names["rope_freqs.weight"]) if "rope_freqs.weight" in names else None
    try:
        if "rope_factors_long.weight" in names or kind == "longrope":
            if "rope_factors_short.weight" not in names or "rope_factors_long.weight" not in names:
                raise UnsupportedModelError("longrope needs both rope_factors_short and rope_factors_long tensors")
            context = int(_field(reader, f"{arch}.context_length"))
            original = original or context
            return Rope(kind="longrope", factor=context / original, original_context=original,
                        freq_factors=_float_values(names["rope_factors_short.weight"]),
                        long_factors=_float_values(names["rope_factors_long.weight"]), **common)
        if kind == "linear":
            return Rope(kind="linear", factor=factor, freq_factors=freqs, **common)
        if kind == "yarn":
            beta_fast = float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0))
            beta_slow = float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0))
            yarn_attn = _field(reader, f"{arch}.rope.scaling.yarn_attn_factor", None)
            if common["attention_factor"] is None and yarn_attn is not None:   # llama.cpp: it multiplies the mscale
                mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
                common["attention_factor"] = float(yarn_attn) * mscale
            return Rope(kind="yarn", factor=factor, original_context=original or int(_field(reader, f"{arch}.context_length")),
                        beta_fast=beta_fast, beta_slow=beta_slow, freq_factors=freqs, **common)
        if kind != "none":
            raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (none, linear, yarn, longrope, rope_freqs)")
        # Llama 3.1/3.2: the llama3 rule precomputed by the converter as per-frequency divisors
        if freqs is None and not rotary_dim and common["attention_factor"] is None:
            return None
        return Rope(freq_factors=freqs, **common)
    except ValueError as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise UnsupportedModelError(f"rope metadata: {e}") from None


def _check_tensor_set(reader: GGUFReader, config: ModelConfig) -> None:
    """Every tensor is one we know, and every layer has what the config implies."""
    names = {t.name for t in reader.tensors}
    family = FAMILIES[config.arch]
    if family.layout == "nemotron_h":
        return nemotron_h.check_gguf_tensors(names, config)
    if family.layout == "lfm2":
        return lfm2.check_gguf_tensors(names, config)
    unknown = sorted(n for n in names if hf_name(n, config) is None and n not in _ROPE_TENSORS)
    if unknown:
        raise UnsupportedModelError(f"GGUF has tensors this engine does not know: {', '.join(unknown[:8])}")
    mlp = list(_DENSE_MLP)
    if config.num_experts:         # every layer's MLP is experts (a dense layer among them: not yet)
        mlp = list(_MOE_PER_LAYER) + (list(_SHARED_PER_LAYER) if config.shared_expert_intermediate_size else [])
    required = ["token_embd.weight", "output_norm.weight"]
    if config.layer_kinds:         # a hybrid file: each layer's own token mixer, the same MLP on every kind
        for i in range(config.num_layers):
            ba = _DELTANET_BA[f"blk.{i}.ssm_ba.weight" in names]       # qwen3next's fused b|a, or qwen35's two
            kind = [n for n in _DELTANET_NAMES if n not in _DELTANET_BA[True] + _DELTANET_BA[False]] + list(ba) \
                if config.kind(i) == "deltanet" else _QWEN35_ATTN + (
                ("attn_q_norm.weight", "attn_k_norm.weight") if config.qk_norm else ())
            required += [f"blk.{i}.{n}" for n in (*_QWEN35_PER_LAYER, *kind, *mlp)]
    else:
        per_layer = [n for n in _REQUIRED_PER_LAYER if n not in _DENSE_MLP] + mlp
        if family.fused_qkv_gate_up:   # phi3: fused q/k/v; ffn_up holds gate and up
            per_layer = [n for n in per_layer if n not in ("attn_q.weight", "attn_k.weight", "attn_v.weight",
                                                            "ffn_gate.weight")] + ["attn_qkv.weight"]
        if config.qkv_bias:
            per_layer += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if config.qk_norm:
            per_layer += ["attn_q_norm.weight", "attn_k_norm.weight"]
        if config.post_norms:
            per_layer += ["post_attention_norm.weight", "post_ffw_norm.weight"]
        elif stray := sorted(n for n in names if n.endswith(("post_attention_norm.weight", "post_ffw_norm.weight"))):
            raise UnsupportedModelError(f"GGUF has post-norms ({', '.join(stray[:2])}) this architecture does not run")
        required += [f"blk.{i}.{n}" for i in range(config.num_layers) for n in per_layer]
    missing = [n for n in required if n not in names]
    if missing:
        raise UnsupportedModelError(f"GGUF lacks tensors: {', '.join(missing[:8])}")
    if config.num_experts:         # GGUF shapes innermost first: [in, out(, E)]
        E, ff, hidden = config.num_experts, config.expert_intermediate_size, config.hidden_size
        want = {"ffn_gate_inp.weight": [hidden, E], "ffn_gate_exps.weight": [hidden, ff, E],
                "ffn_up_exps.weight": [hidden, ff, E], "ffn_down_exps.weight": [ff, hidden, E]}
        if sff := config.shared_expert_intermediate_size:
            want |= {"ffn_gate_inp_shexp.weight": [hidden], "ffn_gate_shexp.weight": [hidden, sff],
                     "ffn_up_shexp.weight": [hidden, sff], "ffn_down_shexp.weight": [sff, hidden]}
        shapes = {t.name: t.shape.tolist() for t in reader.tensors}
        for i in range(config.num_layers):
            for n, shape in want.items():
                got = [int(d) for d in shapes[f"blk.{i}.{n}"]]
                if n == "ffn_gate_inp_shexp.weight" and got[1:] == [1]:     # [hidden, 1]: the converter's (1, hidden)
                    got = got[:1]
                if got != shape:
                    raise UnsupportedModelError(f"GGUF tensor blk.{i}.{n} has shape {got}, expected {shape}")
    elif stray := sorted(n for n in names if n.startswith("blk.") and n.endswith(_MOE_PER_LAYER)):
        raise UnsupportedModelError(f"GGUF has expert tensors ({', '.join(stray[:4])}) but no "
                                    f"{config.arch}.expert_count metadata")
    if not config.shared_expert_intermediate_size and (stray := sorted(n for n in names if n.endswith(_SHARED_PER_LAYER))):
        raise UnsupportedModelError(f"GGUF has shared-expert tensors ({', '.join(stray[:4])}) but layer 0 "
                                    f"has no ffn_gate_shexp")
    extra_layers = sorted({int(m.group(1)) for n in names if (m := _LAYER_RE.fullmatch(n))} - set(range(config.num_layers)))
    if extra_layers:
        raise UnsupportedModelError(f"GGUF has layers {extra_layers[:4]} beyond block_count {config.num_layers}")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's llama Q/K row order.

    The converter stores each head's rows as interleaved pairs (rotate-every-two layout): HF row
    (half j, index i) of a head becomes GGUF row (i, j). Here ``w`` is (out, in) weight or (out,) bias,
    out = n_heads * head_dim; we view rows as (head, i, j) and swap back to (head, j, i).
    """
    rest = w.shape[1:]
    rows_per_head = w.shape[0] // n_heads
    return (w.reshape(n_heads, rows_per_head // 2, 2, *rest)
             .transpose(1, 2)
             .reshape(w.shape))


def hf_parts(gguf_name: str, config: ModelConfig, rows: int) -> list[tuple[str, torch.Tensor | None]]:
    """One GGUF tensor -> the Hugging Face tensors it holds: [(name, row indices or None for all)].
    Rows are output features, so a split or reorder is exact for dense and quantized tensors alike.
      - llama files store q/k rows in the rotate-every-two order (undone: unpermute_rows);
      - phi3 fuses q/k/v (attn_qkv) and gate/up (ffn_up, gate first): split into the llama layout;
      - partial rotary reorders each head's q/k rows (rope.rotary_row_order) for the kernels' RoPE."""
    name = hf_name(gguf_name, config)
    family = FAMILIES[config.arch]
    d, H, KV = config.head_dim, config.num_heads, config.num_kv_heads
    rd = config.rope_spec.rotary_dim

    def qk_order(heads: int, size: int) -> torch.Tensor | None:
        order = torch.arange(size)
        if family.gguf_rotated_qk:        # converter's rotate-every-two rows (llama; not mistral-named files)
            order = unpermute_rows(order, heads)
        if rd:
            order = order[rotary_row_order(heads, d, rd)] if size == heads * d else order[rotary_row_order(1, d, rd)]
        return None if torch.equal(order, torch.arange(size)) else order

    if name.endswith("self_attn.qkv_proj.weight"):
        base = name.removesuffix("qkv_proj.weight")
        q, kv = H * d, KV * d
        oq, ok = qk_order(H, q), qk_order(KV, kv)
        return [(base + "q_proj.weight", torch.arange(q) if oq is None else oq),
                (base + "k_proj.weight", q + (torch.arange(kv) if ok is None else ok)),
                (base + "v_proj.weight", torch.arange(q + kv, q + 2 * kv))]
    if family.fused_qkv_gate_up and name.endswith("mlp.up_proj.weight"):
        base, inter = name.removesuffix("up_proj.weight"), rows // 2
        return [(base + "gate_proj.weight", torch.arange(inter)), (base + "up_proj.weight", torch.arange(inter, rows))]
    if name.endswith("linear_attn.in_proj_ba.weight"):      # qwen3next: per key head [b r | a r] -> b and a
        base = name.removesuffix("in_proj_ba.weight")
        return [(f"{base}{part}.weight", rows) for part, rows in fused_rows(config, "in_proj_ba").items()]
    if config.attn_output_gate and name.endswith("self_attn.q_proj.weight"):
        # qwen35: each head's q rows then its gate rows (H, 2 D): q (in the kernels' RoPE order) and gate_proj
        per_head = torch.arange(rows).reshape(H, 2, d)
        oq = qk_order(H, H * d)
        q = per_head[:, 0].reshape(-1)
        return [(name, q if oq is None else q[oq]),
                (name.removesuffix("q_proj.weight") + "gate_proj.weight", per_head[:, 1].reshape(-1))]
    if ".self_attn.q_" in name or ".self_attn.k_" in name:
        heads = H if ".self_attn.q_" in name else KV
        return [(name, qk_order(heads, rows))]
    return [(name, None)]


def _start_tensor(t: ReaderTensor, dtype: torch.dtype) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """One GGUF tensor -> (torch tensor in HF layout, jobs that fill it). GGUF lists dims
    innermost first, so [in, out] becomes (out, in)."""
    try:
        flat, jobs = dequantize_jobs(_tensor_bytes(t), t.tensor_type, int(t.n_elements), dtype)
    except KeyError:
        raise UnsupportedModelError(
            f"tensor {t.name} has quantization type {t.tensor_type.name}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_QTYPES)}"
        ) from None
    return flat.reshape(tuple(int(d) for d in reversed(t.shape.tolist()))), jobs


def _keeps_quantized(t: ReaderTensor, name: str) -> bool:
    """Whether `--weights gguf` keeps this tensor in a QWeight layout: the projection matrices and
    the embedding/LM head, when their type has an exact layout (qweight.py); norms, biases and float
    tensors stay dense."""
    from ..linear.qweight import QUANTIZED_TYPES
    return (t.tensor_type in QUANTIZED_TYPES and (len(t.shape) == 2 or ".experts.*." in name)
            and (name.endswith("_proj.weight") or ".linear_attn.in_proj_" in name
                 or name in ("lm_head.weight", "model.embed_tokens.weight")))


def expert_weight(raw: torch.Tensor, slab: "Slab", dtype: torch.dtype, keep_quantized: bool,
                  lanes: bool, out: "object | None" = None, int8: bool = False) -> "torch.Tensor | object":
    """One expert matrix's raw GGML bytes -> the weight the resident load makes of it: a QWeight (in
    the lanes layout with ``lanes``) where ``keep_quantized`` keeps its type, else dense (rows, cols)
    in ``dtype`` (GGML blocks are independent: one slab dequantizes to the same values as inside the
    whole tensor). The one conversion of the resident and the streamed experts [SAME-BITS]: natively
    where kernels/convert.c covers it (qconvert.py: the same bits as the Python path, ~GB/s instead of
    ~0.08 GB/s, which made a streamed expert's miss a conversion more than a read), else in Python.
    out: an `expert_blank(slab, ...)` to convert into (overwritten and returned: a streamed expert's
    reused buffers, moe.StreamedExperts [RING]) where the native path takes the slab; where it does not
    (an inf/nan fp16 scale), the weight comes in new tensors and out is untouched. ValueError: an out
    whose fields do not fit the slab. int8 (with lanes): the int layout instead (qint8.c's; a streamed
    expert read straight into it, one pass: convert.c's tq_convert_int)."""
    from ..linear.qweight import QUANTIZED_TYPES, from_gguf, to_int8, to_lanes
    qtype = QT(slab.qtype)
    if keep_quantized and qtype in QUANTIZED_TYPES:
        if lanes:
            from ..linear.qconvert import lanes_from_gguf
            native = lanes_from_gguf(raw, qtype, slab.rows, slab.cols, out=out, int8=int8)
            if native is not None:
                return native
        q = from_gguf(raw, qtype, slab.rows, slab.cols)
        if not lanes:
            return q
        q = to_lanes(q) or q
        return to_int8(q) if int8 and q.lanes else q
    return dequantize(raw, qtype, slab.rows * slab.cols, dtype).reshape(slab.rows, slab.cols)


def expert_blank(slab: "Slab", keep_quantized: bool, lanes: bool, int8: bool = False) -> "object | None":
    """Buffers that `expert_weight(..., out=)` converts this slab into (qconvert.lanes_empty: its native
    lanes weight, allocated, not filled), or None where expert_weight makes new tensors anyway (kept
    dense, a row layout, a type or shape convert.c does not cover). Pure."""
    from ..linear.qweight import QUANTIZED_TYPES
    qtype = QT(slab.qtype)
    if not (keep_quantized and lanes and qtype in QUANTIZED_TYPES):
        return None
    from ..linear.qconvert import lanes_empty
    return lanes_empty(qtype, slab.rows, slab.cols, int8)


def _expert_direct() -> bool | None:
    """TERNLM_EXPERT_DIRECT: 1 = streamed experts read with O_DIRECT (or fail), 0 = through the page cache,
    unset = O_DIRECT where the file system takes it (moe.StreamedExperts [DIRECT])."""
    v = os.environ.get("TERNLM_EXPERT_DIRECT", "")
    return {"1": True, "0": False}.get(v)


def expert_slabs(reader: GGUFReader, config: ModelConfig) -> dict[tuple[int, int], tuple["Slab", "Slab", "Slab"]]:
    """(layer, expert) -> the file offsets of its gate, up and down matrices (moe.Slab): slab e of
    each stacked ffn_{gate,up,down}_exps tensor ([in, out, E] in GGUF order). Reads no tensor data."""
    from .moe import Slab
    names = {t.name: t for t in reader.tensors}
    out = {}
    for i in range(config.num_layers):
        per_kind = []
        for kind in ("gate", "up", "down"):
            t = names[f"blk.{i}.ffn_{kind}_exps.weight"]
            k, n, E = (int(d) for d in t.shape.tolist())
            per = int(t.n_bytes) // E
            per_kind.append([Slab(int(t.data_offset) + e * per, per, int(t.tensor_type), n, k) for e in range(E)])
        for e in range(config.num_experts):
            out[(i, e)] = (per_kind[0][e], per_kind[1][e], per_kind[2][e])
    return out


def _expert_memory(reader: GGUFReader, dtype: torch.dtype, keep_quantized: bool) -> tuple[int, int]:
    """(experts, the rest): bytes the weights take in memory once loaded, estimated from the header:
    a tensor kept quantized ~ its file bytes, a dense one elements x the dtype's size."""
    from ..linear.qweight import QUANTIZED_TYPES
    experts = rest = 0
    for t in reader.tensors:
        kept = keep_quantized and t.tensor_type in QUANTIZED_TYPES
        size = int(t.n_bytes) if kept else int(t.n_elements) * dtype.itemsize
        if t.name.endswith(_MOE_PER_LAYER[1:]):
            experts += size
        else:
            rest += size
    return experts, rest


ExpertBudget = "int | Callable[[ModelConfig, int, int], int | None] | None"


def _each_then_dropped(reader: FastGGUFReader, tensors: list[ReaderTensor]) -> Iterator[ReaderTensor]:
    """Yields each tensor; when the next is asked for, the previous one's pages leave the resident set
    (reader.drop_pages): the caller has converted it into copies and never reads it again."""
    for t in tensors:
        yield t
        reader.drop_pages(int(t.data_offset), int(t.n_bytes))


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype, sha256: str | None = None,
              keep_quantized: bool = False, lanes: bool = False,
              expert_budget: ExpertBudget = None, int8: bool = False) -> LoadedModel:
    """Read a GGUF file into a LoadedModel with weights dequantized to ``dtype``, or, with
    ``keep_quantized``, the quantized matrices as QWeights (models/qweight.py) and the rest dequantized;
    with ``lanes`` too, each QWeight in its lanes layout where it has one (qweight.to_lanes), converted as
    it is read: the whole model never exists in both layouts at once (the freed row layouts, left in
    glibc's heap between the lanes copies, added ~90 MiB to smollm2's RSS after load when the model
    converted them all at the end). Peak RSS stays near the result's: each matrix converted in chunks
    (qweight.from_gguf), each tensor's pages of the map dropped once read (FastGGUFReader.drop_pages), the
    tokenizer built first and the reader's vocabulary dropped before the weights.

    ``sha256``: the file's known digest (e.g. from the registry); when None the file is hashed
    (cached by path+size+mtime under the ternlm cache dir, so usually only once).
    ``expert_budget`` (mixture of experts only): None = every expert converted now (resident); bytes =
    the experts stay in the file and stream through a cache of that many bytes (moe.StreamedExperts,
    ``LoadedModel.experts``; their weights are absent from ``weights``); a callable (config, experts'
    bytes, the rest's bytes in memory) -> either, decided once the header is read. ``int8`` (with
    ``lanes``; the model multiplies int8 activations, `--activations int8`): every quantized matrix with a
    lanes layout is read straight into its int layout (qconvert.lanes_from_gguf's int8: to_int8 of the lanes
    result, bit for bit), streamed experts too, so no lanes copy of the model is ever held beside the int
    one (issue 61: an 8B's load peaked at twice its loaded RSS); what has no native conversion is converted
    by the model (models/llama.py [INT8]).
    Side effects: logs what is loading and the time taken (logger ``ternlm.models.gguf``);
    may write the sha256 index in the cache dir.
    """
    path = Path(path)
    t0 = time.perf_counter()
    reader = FastGGUFReader(path)
    config = config_from_gguf(reader)
    _check_tensor_set(reader, config)
    log.info("loading %s: %s, %d layers, %d tensors -> %s", path, config.arch, config.num_layers,
             len(reader.tensors), dtype)
    t_open = time.perf_counter()

    tokenizer = Tokenizer.from_gguf(reader)
    chat_template = getattr(tokenizer, "chat_template", None)
    if chat_template is None:
        chat_template = _field(reader, "tokenizer.chat_template", None)
    chat_template = with_builtin_template(config.arch, chat_template)   # gemma3 base files carry none
    # [VOCAB-DROPPED] the tokenizer built, the reader's parsed vocabulary goes before the weights: two numpy
    # views a string (qwen2.5's 151,936 tokens and 151,387 merges: ~118 MiB of peak RSS when held through them)
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    reader.drop_pages(0, int(reader.data_offset))      # the header's pages too
    t_tok = time.perf_counter()

    streamed = None                 # experts read on demand (issue 36): nothing of them converted here
    budget = expert_budget(config, *_expert_memory(reader, dtype, keep_quantized)) \
        if callable(expert_budget) else expert_budget
    int8 = int8 and keep_quantized and lanes
    if config.num_experts and budget is not None:
        from .moe import StreamedExperts
        streamed = StreamedExperts(path, expert_slabs(reader, config), budget, functools.partial(
            expert_weight, dtype=dtype, keep_quantized=keep_quantized, lanes=lanes, int8=int8),
            functools.partial(expert_blank, keep_quantized=keep_quantized, lanes=lanes, int8=int8),
            direct=_expert_direct(), int8=int8)
        log.info("experts streamed from %s: %s in the file, cache budget %d bytes", path.name,
                 streamed.file_bytes, budget)
    weights: dict[str, torch.Tensor] = {}
    tensors = [t for t in reader.tensors if t.name not in _ROPE_TENSORS
               and not (streamed is not None and t.name.endswith(_MOE_PER_LAYER[1:]))]
    with _parallel_jobs() as run:
        all_jobs: list[Callable[[], None]] = []
        quantized: list[ReaderTensor] = []
        dense: dict[str, torch.Tensor] = {}
        for t in tensors:  # checks every type before any work starts
            if keep_quantized and _keeps_quantized(t, hf_name(t.name, config) or ""):
                quantized.append(t)
                continue
            dense[t.name], jobs = _start_tensor(t, dtype)
            all_jobs += jobs
        run(all_jobs)
        for t in tensors:
            if t.name in dense:     # read once, into copies
                reader.drop_pages(int(t.data_offset), int(t.n_bytes))
        for gname, w in dense.items():
            experts = expert_parts(hf_name(gname, config) or "", config.num_experts)
            if experts is not None:                 # (E, rows, in): expert e is the view w[e]
                weights.update((name, w[e]) for name, e in experts)
                continue
            for name, rows in hf_parts(gname, config, int(w.shape[0])):
                weights[name] = w if rows is None else w[rows]
        dense.clear()
        if quantized:
            from .moe import Slab
            from ..linear.qconvert import lanes_from_gguf
            from ..linear.qweight import from_gguf, to_lanes
            for t in _each_then_dropped(reader, quantized):     # one at a time, each read once
                experts = expert_parts(hf_name(t.name, config) or "", config.num_experts)
                if experts is not None:             # quantization blocks run along the input: an
                    k, n, E = (int(d) for d in t.shape.tolist())     # expert is a contiguous slab of whole rows
                    raw = _tensor_bytes(t)
                    per = raw.numel() // E
                    for name, e in experts:          # the streamed experts' conversion too [SAME-BITS]
                        slab = Slab(e * per, per, int(t.tensor_type), n, k)
                        weights[name] = expert_weight(raw[e * per:(e + 1) * per], slab, dtype, True, lanes,
                                                      int8=int8)
                    continue
                k, n = (int(d) for d in t.shape.tolist())       # GGUF: innermost (input) first
                parts = hf_parts(t.name, config, n)
                if lanes:       # natively, whole rows gathered (convert.c): the Python path's bits, or None
                    native = {name: lanes_from_gguf(_tensor_bytes(t), t.tensor_type, n if rows is None else len(rows),
                                                    k, order=rows, int8=int8) for name, rows in parts}
                    if all(q is not None for q in native.values()):
                        weights.update(native)
                        continue
                    del native
                if len(parts) == 1 and parts[0][1] is None:     # as is: chunk by chunk into the kernels' layout
                    weights[parts[0][0]] = from_gguf(_tensor_bytes(t), t.tensor_type, n, k, lanes=lanes)
                    continue
                q = from_gguf(_tensor_bytes(t), t.tensor_type, n, k)    # rows reordered or split: whole rows, exact
                for name, rows in parts:
                    part = q if rows is None else q.permute_rows(rows)    # whole rows: exact
                    weights[name] = (to_lanes(part) or part) if lanes else part
                del q
    t_weights = time.perf_counter()

    digest = sha256 if sha256 is not None else cached_sha256([path])
    t_end = time.perf_counter()
    log.info("loaded %s in %.2fs (open %.2fs, tokenizer %.2fs, weights %.2fs, sha256 %.2fs)",
             path.name, t_end - t0, t_open - t0, t_tok - t_open, t_weights - t_tok, t_end - t_weights)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, chat_template=chat_template,
                       sha256=digest, source=path, experts=streamed)
