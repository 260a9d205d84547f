"""Write a synthetic hybrid GGUF (qwen35: gated DeltaNet + gated attention, llama.cpp's converter layout) of a
Qwen3.5-like geometry (issue 47's benchmark model: >= 24 layers, hidden >= 1024), random but well-formed.

Q4_K blocks for the projections and the embedding, Q6_K for the LM head and attn_v (llama.cpp's Q4_K_M
choices), F32 norms, conv kernels, decay rates (ssm_a < 0) and dt biases; the byte-level tokenizer and ChatML
template of benchmarks/synth_moe_gguf.py. Meaningless text, real bytes and timings (quality and parity are
tests/test_hybrid.py's job). Every 4th layer attention, the rest DeltaNet, as Qwen3.5.

--ftype q8_0 writes what llama.cpp's converter writes for `--outtype q8_0` (conversion/base.py,
prepare_tensors): every 2-D `.weight` in Q8_0, the embedding and LM head included; F32 for 1-D tensors,
`*_norm.weight`, ssm_conv1d.weight (always F32 there) and ssm_a (no `.weight` suffix); file type 7.

    python benchmarks/synth_qwen35_gguf.py -o /tmp/qwen35-24x1024.gguf                 # ~0.5 GB
    python benchmarks/synth_qwen35_gguf.py --ftype q8_0 -o /tmp/qwen35-24x1024-q8_0.gguf  # ~0.6 GB
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

sys.path.insert(0, str(Path(__file__).parent))
from synth_moe_gguf import _BLOCK, _nbytes, add_tokenizer, random_blocks  # noqa: E402

ARCH = "qwen35"


@dataclass(frozen=True)
class Geometry:
    layers: int = 24
    hidden: int = 1024
    ffn: int = 3584
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 256
    key_heads: int = 16          # DeltaNet q/k heads of key_dim
    value_heads: int = 16        # DeltaNet value heads of value_dim
    key_dim: int = 128
    value_dim: int = 128
    conv: int = 4
    vocab: int = 50304
    context: int = 32768

    def attention(self, i: int) -> bool:
        return (i + 1) % 4 == 0


FTYPES = {"q4_k_m": 15, "q8_0": 7}         # --ftype -> general.file_type (LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q8_0)


def tensor_plan(g: Geometry, ftype: str = "q4_k_m") -> list[tuple[str, QT | None, tuple[int, ...]]]:
    """(name, type or None for F32, numpy shape (rows, cols)) of every tensor, in file order. q8_0: every
    quantized tensor of the Q4_K_M plan becomes Q8_0 (the F32 ones are exactly the converter's F32 set)."""
    plan = _q4_k_m_plan(g)
    return plan if ftype == "q4_k_m" else [(n, None if q is None else QT.Q8_0, s) for n, q, s in plan]


def _q4_k_m_plan(g: Geometry) -> list[tuple[str, QT | None, tuple[int, ...]]]:
    kd, vd = g.key_heads * g.key_dim, g.value_heads * g.value_dim
    plan = [("token_embd.weight", QT.Q4_K, (g.vocab, g.hidden)), ("output_norm.weight", None, (g.hidden,)),
            ("output.weight", QT.Q6_K, (g.vocab, g.hidden))]
    for i in range(g.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", None, (g.hidden,)), (b + "post_attention_norm.weight", None, (g.hidden,)),
                 (b + "ffn_gate.weight", QT.Q4_K, (g.ffn, g.hidden)), (b + "ffn_up.weight", QT.Q4_K, (g.ffn, g.hidden)),
                 (b + "ffn_down.weight", QT.Q6_K if i % 3 == 0 else QT.Q4_K, (g.hidden, g.ffn))]
        if g.attention(i):
            q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
            plan += [(b + "attn_q.weight", QT.Q4_K, (2 * q, g.hidden)), (b + "attn_k.weight", QT.Q4_K, (kv, g.hidden)),
                     (b + "attn_v.weight", QT.Q6_K, (kv, g.hidden)), (b + "attn_output.weight", QT.Q4_K, (g.hidden, q)),
                     (b + "attn_q_norm.weight", None, (g.head_dim,)), (b + "attn_k_norm.weight", None, (g.head_dim,))]
        else:
            plan += [(b + "attn_qkv.weight", QT.Q4_K, (2 * kd + vd, g.hidden)),
                     (b + "attn_gate.weight", QT.Q4_K, (vd, g.hidden)),
                     (b + "ssm_beta.weight", QT.Q4_K, (g.value_heads, g.hidden)),
                     (b + "ssm_alpha.weight", QT.Q4_K, (g.value_heads, g.hidden)),
                     (b + "ssm_out.weight", QT.Q4_K, (g.hidden, vd)),
                     (b + "ssm_a", None, (g.value_heads,)), (b + "ssm_dt.bias", None, (g.value_heads,)),
                     (b + "ssm_conv1d.weight", None, (2 * kd + vd, g.conv)), (b + "ssm_norm.weight", None, (g.value_dim,))]
    return plan


def _data(rng: np.random.Generator, name: str, qtype: QT | None, shape: tuple[int, ...]) -> np.ndarray:
    if qtype is not None:
        return random_blocks(rng, qtype, shape[-2], shape[-1])
    if name.endswith("ssm_a"):                   # -exp(A_log): decays in (-1, -0.05]
        return -rng.uniform(0.05, 1.0, shape).astype(np.float32)
    if name.endswith(("ssm_dt.bias",)):
        return rng.standard_normal(shape).astype(np.float32) * 0.5
    if name.endswith("ssm_conv1d.weight"):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)
    return np.ones(shape, dtype=np.float32)      # norms (stored as 1 + w: w = 0)


def write(path: Path, g: Geometry, seed: int = 0, log=print, ftype: str = "q4_k_m") -> int:
    """Writes the file; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, ARCH)
    w.add_name(f"synthetic {ARCH} {g.layers}x{g.hidden} (random weights)")
    w.add_block_count(g.layers)
    w.add_context_length(g.context)
    w.add_embedding_length(g.hidden)
    w.add_feed_forward_length(g.ffn)
    w.add_head_count(g.heads)
    w.add_head_count_kv(g.kv_heads)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_rope_freq_base(1e7)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{ARCH}.ssm.conv_kernel", g.conv)
    w.add_uint32(f"{ARCH}.ssm.state_size", g.key_dim)
    w.add_uint32(f"{ARCH}.ssm.group_count", g.key_heads)
    w.add_uint32(f"{ARCH}.ssm.time_step_rank", g.value_heads)
    w.add_uint32(f"{ARCH}.ssm.inner_size", g.value_heads * g.value_dim)
    w.add_array(f"{ARCH}.attention.recurrent_layers", [not g.attention(i) for i in range(g.layers)])
    w.add_uint32(f"{ARCH}.full_attention_interval", 4)
    w.add_rope_dimension_count(g.head_dim // 4)
    w.add_array(f"{ARCH}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_file_type(FTYPES[ftype])
    add_tokenizer(w, g.vocab)
    plan = tensor_plan(g, ftype)
    for name, qtype, shape in plan:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(None, shape))
        else:
            block, size = _BLOCK[qtype]
            w.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8), _nbytes(qtype, shape),
                              raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.perf_counter()
    for name, qtype, shape in plan:
        w.write_tensor_data(_data(rng, name, qtype, shape))
    w.close()
    if log:
        log(f"{path}: {path.stat().st_size} bytes in {time.perf_counter() - t0:.0f} s")
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", required=True, type=Path)
    for f, v in Geometry.__dataclass_fields__.items():
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=v.default)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ftype", choices=sorted(FTYPES), default="q4_k_m",
                    help="q4_k_m: llama.cpp's Q4_K_M choices; q8_0: its converter's --outtype q8_0")
    args = ap.parse_args(argv)
    g = Geometry(**{f: getattr(args, f) for f in Geometry.__dataclass_fields__})
    write(args.output, g, args.seed, ftype=args.ftype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
