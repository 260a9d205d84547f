"""One quantized product, fp32 activations (kernels/qlanes.c) beside int8 activations (kernels/qint8.c).

    .venv/bin/python benchmarks/qint8_products.py [--threads 1] [--m 1,64]

For each GGML type the 1.5B model uses most (Q4_K gate|up 17,920 x 1,536, Q6_K down 1,536 x 8,960) and two
block types (Q4_0, Q8_0): random valid GGML blocks (tests/test_qweight.random_blocks), one QLinear in each
layout, x of M random rows; the best of several calls (the weights stay in cache: a product's compute rate,
not a decode step's memory-bound one: `benchmarks/decode_bound.py` measures that). Prints ms and GFLOP/s.
Timing only, for this machine; not a test. Writes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

from ternlm.kernels.build import load
from ternlm.linear.qlinear import QLinear
from ternlm.linear.qweight import from_gguf, to_int8, to_lanes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_qweight import random_blocks  # noqa: E402

SHAPES = [(QT.Q4_K, 17920, 1536), (QT.Q6_K, 1536, 8960), (QT.Q4_0, 17920, 1536), (QT.Q8_0, 4096, 1536)]


def best_of(fn, x: torch.Tensor, n: int) -> float:
    fn(x)
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--m", default="1,64", help="activation row counts, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k = load()
    k8 = dataclasses.replace(k, activations="int8")
    print(f"kernels {k.isa}, integer path {k8.int8_path}, {args.threads} thread(s)")
    for qt, n, kin in SHAPES:
        q = from_gguf(torch.from_numpy(random_blocks(qt, n, kin, seed=1)), qt, n, kin)
        fp32, int8 = QLinear([q], None, k), QLinear([to_int8(to_lanes(q))], None, k8)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, kin)
            t32, t8 = (best_of(lin, x, max(3, 40 // m)) for lin in (fp32, int8))
            gf = 2 * m * n * kin / 1e9
            print(f"{qt.name} {n}x{kin} M={m}: fp32 {t32 * 1e3:.3f} ms ({gf / t32:.0f} GFLOP/s)  "
                  f"int8 {t8 * 1e3:.3f} ms ({gf / t8:.0f} GFLOP/s)  x{t32 / t8:.2f}")


if __name__ == "__main__":
    main()
