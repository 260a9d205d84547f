"""A decoder layer run whole by kernels/layer.c (fp32 activations, every projection quantized): llama,
qwen2, qwen3, and gemma3's (GeGLU, post-norms, sliding window, query_pre_attn_scalar) as data.

`NativeLayer.build` returns one when the layer's shapes and weights fit layer.c, else a reason string
(the caller keeps the torch layer then). The ctypes structures mirror layer.c's TqPart / TqProj /
TqLayer field for field; they hold raw addresses, so a NativeLayer keeps every tensor it points at.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..kernels.build import LAYOUT_CODE, MM_VARIANTS, MODE_CODE, Kernels
from ..kernels.build import Part as _Part

ACT_CODE = {"silu": 0, "gelu_tanh": 1}          # layer.c's ACT_SILU, ACT_GELU_TANH (config.MLP_ACTS)
MAXPARTS = 4
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Proj(ctypes.Structure):
    _fields_ = [("nparts", _i64), ("n_out", _i64), ("bias", _ptr), ("parts", _Part * MAXPARTS)]


class _Layer(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("inter", _i64), ("H", _i64), ("KV", _i64), ("D", _i64), ("index", _i64),
                ("eps", ctypes.c_double), ("in_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr),
                ("k_norm", _ptr), ("cos", _ptr), ("sin", _ptr),
                ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj), ("kv_mode", _i64),
                ("act", _i64), ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("window", _i64),
                ("q_scale", ctypes.c_double), ("qk_norm_full", _i64)]


def scratch_per_row(hidden: int, qkv_out: int, q_size: int, inter: int) -> int:
    """Floats of layer.c's scratch per batch row: h, o (hidden each), qkv, scaled q and attention
    output (q_size each), gate|up (2 inter), SiLU * up (inter)."""
    return 2 * hidden + qkv_out + 2 * q_size + 3 * inter


def _ptr_of(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _proj(q, keep: list) -> _Proj | str:
    """A QLinear (models/qlinear.py) -> _Proj, or why not."""
    from ..linear.qlinear import QLinear
    if not isinstance(q, QLinear):
        return "a projection is not quantized"
    if len(q.parts) > MAXPARTS:
        return f"a projection has {len(q.parts)} parts (layer.c takes {MAXPARTS})"
    p = _Proj(nparts=len(q.parts), n_out=q.out_features, bias=_ptr_of(q.bias))
    keep.append(q)                     # its tensors stay alive as long as this layer
    for i, w in enumerate(q.parts):
        if (w.fmt, w.mode) not in MM_VARIANTS:
            return f"no kernel for layout {w.fmt} with {w.mode} scales"
        p.parts[i] = _Part(LAYOUT_CODE[w.fmt], MODE_CODE[w.mode], w.shape[0], w.codes.data_ptr(),
                           _ptr_of(w.high), w.scale.data_ptr(), _ptr_of(w.bias), _ptr_of(w.sup))
    return p


def layer_spec(kernels: Kernels, layer, cos: torch.Tensor, sin: torch.Tensor, mlp: bool) -> "tuple[_Layer, int, list] | str":
    """layer (a models/llama.Layer) -> (its _Layer, scratch floats a row, the tensors it points into), or why
    layer.c cannot run it. mlp: with its dense gate|up and down; else those left empty (a MoE layer: its
    attention half only, tq_layer_attn). Pure but for reading the layer."""
    cfg = layer.cfg
    # What differs between the architectures is data here (activation, output norms, window, query
    # scale, this layer's RoPE tables); a kind layer.c does not compute is refused by name.
    if cfg.mlp_act not in ACT_CODE:
        return f"a {cfg.mlp_act} MLP (layer.c has {', '.join(ACT_CODE)})"
    norms = [layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attn_out_norm,
             layer.mlp_out_norm, cos, sin]
    if any(t is not None and (t.dtype != torch.float32 or not t.is_contiguous()) for t in norms):
        return "activations are not fp32"
    keep: list = [t for t in norms if t is not None]
    projs = {n: _proj(getattr(layer, n), keep) for n in (("qkv", "o", "gate_up", "down") if mlp else ("qkv", "o"))}
    for why in projs.values():
        if isinstance(why, str):
            return why
    if not mlp:
        projs.update(gate_up=_Proj(nparts=0, n_out=0, bias=None), down=_Proj(nparts=0, n_out=0, bias=None))
    d, inter = cfg.head_dim, projs["gate_up"].n_out // 2
    if cfg.hidden_size % 16 or inter % 16 or d % 16 or d > 256 or cfg.num_heads % cfg.num_kv_heads:
        return f"shapes layer.c does not take (hidden {cfg.hidden_size}, intermediate {inter}, head_dim {d})"
    spec = _Layer(hidden=cfg.hidden_size, inter=inter, H=cfg.num_heads, KV=cfg.num_kv_heads, D=d,
                  index=layer.kv_index, eps=cfg.rms_norm_eps, in_norm=_ptr_of(layer.input_norm),
                  post_norm=_ptr_of(layer.post_norm), q_norm=_ptr_of(layer.q_norm),
                  k_norm=_ptr_of(layer.k_norm), cos=cos.data_ptr(), sin=sin.data_ptr(), **projs,
                  act=ACT_CODE[cfg.mlp_act], attn_out_norm=_ptr_of(layer.attn_out_norm),
                  mlp_out_norm=_ptr_of(layer.mlp_out_norm), window=layer.window, q_scale=layer.q_scale,
                  qk_norm_full=int(bool(getattr(cfg, "qk_norm_full", False))))
    return spec, scratch_per_row(cfg.hidden_size, projs["qkv"].n_out, cfg.num_heads * d, inter), keep


@dataclass
class NativeLayer:
    kernels: Kernels
    spec: _Layer
    per_row: int          # scratch floats per batch row
    keep: list            # the tensors and projections spec points into

    @classmethod
    def build(cls, kernels: Kernels, layer, cos: torch.Tensor, sin: torch.Tensor) -> "NativeLayer | str":
        """layer: a models/llama.Layer; cos/sin: (max_pos, head_dim) fp32, that layer's own rope tables
        (Gemma 3: base 10k on windowed layers, 1e6 on global ones; kept alive here)."""
        if getattr(layer, "moe", None) is not None:
            return "a mixture-of-experts layer (models/native_moe.py runs those)"
        built = layer_spec(kernels, layer, cos, sin, mlp=True)
        return built if isinstance(built, str) else cls(kernels, *built)

    def __call__(self, x: torch.Tensor, table: torch.Tensor, scratch: torch.Tensor) -> None:
        """x: (M, hidden) fp32 contiguous, updated in place; table: llama.segment_table of the batch
        (its caches checked there); scratch: >= M * per_row fp32. Side effects: x and the caches."""
        M = x.shape[0]
        if not (x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.spec.hidden
                and scratch.dtype == torch.float32 and scratch.numel() >= M * self.per_row):
            raise ValueError("native layer: input or scratch does not match")
        rc = self.kernels.lib.tq_layer(ctypes.addressof(self.spec), table.data_ptr(), table.shape[0], x.data_ptr(),
                                       M, scratch.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"native layer: unsupported shape or batch (rows {M})")
