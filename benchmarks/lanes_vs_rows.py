"""The two quantized products side by side on the same weights: qmatmul.c's row layouts and qlanes.c's
lanes layouts (models/qweight.py to_lanes), one matrix at a time.

    python benchmarks/lanes_vs_rows.py [--m 1,8,37,256] [--threads 2] [--only NAME]
    python benchmarks/lanes_vs_rows.py --pass-of qwen [--m 1]

Per matrix (random GGML blocks of the type and shape each model has; per M): medians of interleaved
calls, caches swept (64 MB written) before each call at M <= 8 as in a decode step; the rows / lanes time
ratio; GFLOP/s; and each kernel's largest error against a float64 product of the same weights, over the
largest output. --pass-of MODEL instead times a decode step's products the way the engine runs them:
each of 24 layers' matrices once, in order, then the output projection (every call's weights cold
because the others evicted them, no sweep in between). Timing for this machine; not a test. Writes
nothing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_qweight import random_blocks  # noqa: E402  (GGML blocks with finite fp16 fields)

from ternlm.kernels.build import load  # noqa: E402
from ternlm.models.qweight import from_gguf, to_lanes  # noqa: E402

# (name, type, out, in): the matrices of smollm2-135m (Q4_1; tied Q8_0 embedding) and qwen2.5-coder-0.5b
# (Q4_K_M: Q5_0 attention and gate/up, Q8_0 half the v and the output, down alternating Q4_K / Q6_K)
MATRICES = [("smollm2 q/o", QT.Q4_1, 576, 576), ("smollm2 k/v", QT.Q4_1, 192, 576), ("smollm2 gate|up", QT.Q4_1, 1536, 576),
            ("smollm2 down", QT.Q4_1, 576, 1536), ("smollm2 lm_head", QT.Q8_0, 49152, 576),
            ("qwen q/o", QT.Q5_0, 896, 896), ("qwen k", QT.Q5_0, 128, 896), ("qwen v", QT.Q8_0, 128, 896),
            ("qwen gate|up", QT.Q5_0, 4864, 896), ("qwen down Q4_K", QT.Q4_K, 896, 4864),
            ("qwen down Q6_K", QT.Q6_K, 896, 4864), ("qwen lm_head", QT.Q8_0, 151936, 896)]
# a layer's products in the order the engine calls them (a fused projection: one call per part)
LAYER = {"qwen": ["qwen q/o", "qwen k", "qwen v", "qwen q/o", "qwen gate|up", "qwen gate|up"],
         "smollm2": ["smollm2 q/o", "smollm2 k/v", "smollm2 k/v", "smollm2 q/o", "smollm2 gate|up",
                     "smollm2 gate|up", "smollm2 down"]}


def weights(qtype: QT, n: int, k: int, seed: int):
    q = from_gguf(torch.from_numpy(random_blocks(qtype, n, k, seed=seed)), qtype, n, k)
    return q, to_lanes(q)


def caller(kern, threads: int):
    def call(q, x, y):
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        kern.mm(q.fmt, q.mode, x.data_ptr(), x.shape[0], x.shape[1], q.codes.data_ptr(), ptr(q.high),
                q.scale.data_ptr(), ptr(q.bias), ptr(q.sup), q.shape[0], y.data_ptr(), q.shape[0], threads)
    return call


def per_matrix(a, call) -> None:
    sweep = torch.zeros(16 << 20)
    for name, qtype, n, k in MATRICES:
        if a.only and a.only not in name:
            continue
        rows, lanes = weights(qtype, n, k, seed=n + k)
        ref_w = rows.dequantize().double()
        for M in a.m:
            if n > 10000 and M > 8:
                continue                      # a prefill multiplies only its last row by the lm_head
            x = torch.randn(M, k)
            y = {0: torch.empty(M, n), 1: torch.empty(M, n)}
            times: dict[int, list[float]] = {0: [], 1: []}
            for r in range(a.repeats if M > 8 else 5 * a.repeats):
                for side in ((0, 1) if r % 2 else (1, 0)):
                    if M <= 8:
                        sweep += 1.0
                    t = time.perf_counter()
                    call(lanes if side else rows, x, y[side])
                    times[side].append(time.perf_counter() - t)
            ref = x.double() @ ref_w.T
            err = [((y[s].double() - ref).abs().max() / ref.abs().max()).item() for s in (0, 1)]
            t0, t1 = statistics.median(times[0]), statistics.median(times[1])
            print(f"{name:17s} {qtype.name:5s} {n:6d} x {k:4d}  M = {M:3d}: rows {t0 * 1e6:9.1f} us  lanes "
                  f"{t1 * 1e6:9.1f} us  lanes/rows {t1 / t0:.2f}  ({2 * M * n * k / t1 / 1e9:5.1f} GFLOP/s)  "
                  f"error {err[0]:.1e} / {err[1]:.1e}", flush=True)


def decode_pass(a, call) -> None:
    specs = {name: (qtype, n, k) for name, qtype, n, k in MATRICES}
    mats = []
    for layer in range(24 if a.pass_of == "qwen" else 30):
        names = list(LAYER[a.pass_of])
        if a.pass_of == "qwen":
            names.append("qwen down Q4_K" if layer % 2 else "qwen down Q6_K")
        for nm in names:
            qtype, n, k = specs[nm]
            mats.append(weights(qtype, n, k, seed=layer))
    qtype, n, k = specs[f"{a.pass_of} lm_head"]
    mats.append(weights(qtype, n, k, seed=1))
    for M in a.m:
        xs = [torch.randn(M, r.shape[1]) for r, _ in mats]
        ys = [torch.empty(M, r.shape[0]) for r, _ in mats]
        times: dict[int, list[float]] = {0: [], 1: []}
        for r in range(a.repeats):
            for side in ((0, 1) if r % 2 else (1, 0)):
                t = time.perf_counter()
                for (rows, lanes), x, y in zip(mats, xs, ys):
                    call(lanes if side else rows, x, y)
                times[side].append(time.perf_counter() - t)
        t0, t1 = statistics.median(times[0]), statistics.median(times[1])
        print(f"{a.pass_of} decode pass, {len(mats)} products, M = {M}: rows {t0 * 1e3:.2f} ms  lanes "
              f"{t1 * 1e3:.2f} ms  lanes/rows {t1 / t0:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,37,256", help="row counts, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--only", help="matrices whose name contains this")
    ap.add_argument("--pass-of", choices=("qwen", "smollm2"), help="time a decode step's products instead")
    a = ap.parse_args()
    a.m = [int(v) for v in a.m.split(",")]
    kern = load()
    if not hasattr(kern, "lib") or not kern.lanes:
        raise SystemExit(f"needs the native kernels with lanes layouts: {kern}")
    torch.manual_seed(0)
    call = caller(kern, a.threads)
    print(f"kernels: {kern.isa}, {a.threads} threads")
    (decode_pass if a.pass_of else per_matrix)(a, call)


if __name__ == "__main__":
    main()
