"""attention.c at two git revisions, side by side on a model's attention shapes.

    python benchmarks/attention_sweep.py --shape smollm2 --base HEAD~1 [--new WORKTREE] [--march native]

Builds src/ternlm/kernels/attention.c (with the vec.h of the same revision) as it is at --base and at
--new (a revision, or WORKTREE for the files on disk) with the flags of kernels/build.py (-march as
given: x86-64-v3 times the AVX2 path), then on random queries and an fp16 KV cache of the shape's heads
(smollm2-135m: 9 query heads over 3 kv heads; qwen2.5-0.5b: 14 over 2; head_dim 64):
  1. says whether both builds give the same output bits in every case (a change meant as a speed change
     only must; two -march values or a change of the arithmetic will not);
  2. times, both builds interleaved, medians, scaled to the model's layer count:
     a 4,000- and a 1,024-token prefill in 256-row chunks, a 37-row tail after 2,084 cached positions
     (`ternlm bench reuse`'s turn 2), and one decode row after 1,024 and after 4,000.
Timing only, for this machine; not a test. Writes nothing but the two builds in a temporary directory.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = Path("src/ternlm/kernels")
SHAPES = {"smollm2": (9, 3, 64, 30), "qwen": (14, 2, 64, 24)}   # query heads, kv heads, head_dim, layers
CAP = 4096


def build(rev: str, march: str, out: Path) -> ctypes.CDLL:
    d = out / rev.replace("/", "_")
    d.mkdir()
    for name in ("attention.c", "vec.h"):
        text = (SRC / name).read_text() if rev == "WORKTREE" else subprocess.run(
            ["git", "show", f"{rev}:{SRC / name}"], check=True, capture_output=True, text=True).stdout
        (d / name).write_text(text)
    so = d / "attention.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi",
                    str(d / "attention.c"), "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.tq_attention_segments.argtypes = [p, i, i, p, i, i, i, i, p, ctypes.c_int, ctypes.c_int]
    lib.tq_attention_segments.restype = ctypes.c_int
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--new", default="WORKTREE")
    ap.add_argument("--march", default="native")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    H, KV, D, layers = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, KV, CAP, D)).astype(np.float16)      # one layer of a slot's cache
    v = rng.standard_normal((1, KV, CAP, D)).astype(np.float16)
    q = (rng.standard_normal((H, CAP, D)) * 0.3).astype(np.float32)   # scaled queries at every position

    def run(lib, start: int, M: int) -> np.ndarray:
        qq = np.ascontiguousarray(q[:, start:start + M])
        out = np.empty((M, H * D), np.float32)
        segs = np.array([[0, M, start, CAP, k.ctypes.data, v.ctypes.data]], np.int64)
        if lib.tq_attention_segments(segs.ctypes.data, 1, 0, qq.ctypes.data, M, H, KV, D, out.ctypes.data,
                                     a.threads, 1) != 0:
            raise SystemExit("tq_attention_segments refused the shape")
        return out

    cases = {"prefill 4,000 (256-row chunks)": [(s, min(256, 4000 - s)) for s in range(0, 4000, 256)],
             "prefill 1,024": [(s, 256) for s in range(0, 1024, 256)],
             "37-row tail after 2,084": [(2084, 37)],
             "decode after 1,024": [(1024, 1)], "decode after 4,000": [(4000, 1)]}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build(a.base, a.march, Path(tmp)), "new": build(a.new, a.march, Path(tmp))}
        print(f"{a.shape}: {H} query heads, {KV} kv heads, head_dim {D}, x{layers} layers, fp16 cache; "
              f"base {a.base}, new {a.new}, -march={a.march}, {a.threads} threads")
        same = all(np.array_equal(run(libs["base"], s, m).view(np.uint32), run(libs["new"], s, m).view(np.uint32))
                   for calls in cases.values() for s, m in calls)
        print("same output bits in every case" if same else "DIFFERENT output bits")
        for name, calls in cases.items():
            reps = 3 if name.startswith("prefill") else 31
            times: dict[str, list[float]] = {key: [] for key in libs}
            for i in range(reps):
                for key in (list(libs) if i % 2 else list(libs)[::-1]):   # interleaved, alternating order
                    t = time.perf_counter()
                    for s, m in calls:
                        run(libs[key], s, m)
                    times[key].append(time.perf_counter() - t)
            b, n = (statistics.median(times[key]) * layers * 1e3 for key in ("base", "new"))
            print(f"{name:32s} base {b:9.1f} ms   new {n:9.1f} ms   new/base {n / b:.3f}   (median of {reps})")


if __name__ == "__main__":
    main()
