"""Write a synthetic dense GGUF (llama layout) of a real model's geometry at Q4_K_M's type per tensor (issue 61).

Random but well-formed blocks (synth_moe_gguf.py's: finite, small fp16 scales), F32 norms: meaningless
text, real bytes, so a load's time and memory and a step's speed are the real model's. Q4_K_M's types as
llama.cpp picks them: Q4_K everywhere but attn_v and ffn_down on its use_more_bits layers and the output
(Q6_K). Written one tensor at a time (the script's memory stays far below the file).

    python benchmarks/synth_dense_gguf.py --preset llama3.1-8b -o /data/llama3.1-8b-synth.gguf   # ~4.6 GB
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

from synth_moe_gguf import _BLOCK, _more_bits, _nbytes, add_tokenizer, random_blocks

ARCH = "llama"


@dataclass(frozen=True)
class Geometry:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int = 131072


PRESETS = {
    # Llama-3.1-8B: 32 layers, hidden 4096, FFN 14,336, 32 q / 8 kv heads of 128, vocabulary 128,256
    "llama3.1-8b": Geometry(32, 4096, 14336, 32, 8, 128, 128256),
}


def tensor_plan(g: Geometry) -> list[tuple[str, QT | None, tuple[int, ...]]]:
    """(name, type or None for F32, (rows, cols) or (n,)) of every tensor, in file order."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    plan = [("token_embd.weight", QT.Q4_K, (g.vocab, g.hidden)), ("output_norm.weight", None, (g.hidden,)),
            ("output.weight", QT.Q6_K, (g.vocab, g.hidden))]
    for i in range(g.layers):
        b, more = f"blk.{i}.", QT.Q6_K if _more_bits(i, g.layers) else QT.Q4_K
        plan += [(b + "attn_norm.weight", None, (g.hidden,)), (b + "attn_q.weight", QT.Q4_K, (q, g.hidden)),
                 (b + "attn_k.weight", QT.Q4_K, (kv, g.hidden)), (b + "attn_v.weight", more, (kv, g.hidden)),
                 (b + "attn_output.weight", QT.Q4_K, (g.hidden, q)), (b + "ffn_norm.weight", None, (g.hidden,)),
                 (b + "ffn_gate.weight", QT.Q4_K, (g.ffn, g.hidden)), (b + "ffn_up.weight", QT.Q4_K, (g.ffn, g.hidden)),
                 (b + "ffn_down.weight", more, (g.hidden, g.ffn))]
    return plan


def write(path: Path, g: Geometry, seed: int = 0, log=print) -> int:
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
    w.add_rope_dimension_count(g.head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(15)                                       # LLAMA_FTYPE_MOSTLY_Q4_K_M
    add_tokenizer(w, g.vocab)
    plan = tensor_plan(g)
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
    t0, done, total = time.perf_counter(), 0, sum(_nbytes(q, s) for _, q, s in plan)
    for i, (name, qtype, shape) in enumerate(plan):
        data = random_blocks(rng, qtype, *shape) if qtype is not None else np.ones(shape, dtype=np.float32)
        w.write_tensor_data(data)
        done += data.nbytes
        del data
        if log and (i % 40 == 0 or i == len(plan) - 1):
            log(f"  {done / 2**30:6.2f} / {total / 2**30:.2f} GiB  ({time.perf_counter() - t0:.0f} s)")
    w.close()
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), required=True)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (a quick check)")
    ap.add_argument("-o", "--output", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    g = PRESETS[args.preset]
    if args.layers:
        g = Geometry(args.layers, *[getattr(g, f) for f in list(Geometry.__dataclass_fields__)[1:]])
    print(f"writing {args.output}: {g}", file=sys.stderr)
    size = write(args.output, g, args.seed, log=lambda m: print(m, file=sys.stderr))
    print(f"{args.output}: {size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
