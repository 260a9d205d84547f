"""The quantized products (qlanes.c; qmatmul.c at revisions that still have it) at two git revisions, side by
side on a real model's matrices.

    python benchmarks/qmatmul_sweep.py -m qwen2.5-coder-0.5b --base HEAD~1 [--new WORKTREE] [--march native]
    python benchmarks/qmatmul_sweep.py -m smollm2-135m --base WORKTREE --cflags-new="-DKC_BYTES=65536" --no-lm-head --timed-m 37,256

Builds src/ternlm/kernels/qlanes.c (and qmatmul.c where the revision has it) as they are at --base and at --new (a revision, or
WORKTREE for the files on disk) with the flags of kernels/build.py (-march as given: x86-64-v3 times the
AVX2 path), loads the model with --weights gguf (its matrices in the layouts the engine holds: lanes where
they have one, so a --base from before qlanes.c has no kernel for them: compare such revisions with
`ternlm bench engine`) and then, for every matrix in model order:
  1. checks that both builds give the same output bits at M = 1, 3, 8, 13, 16, 37, 100 (a kernel change that is
     meant to be a speed change only must pass this; so must a tile constant set by --cflags-new);
  2. times the whole sweep of matrices (a decode step's GEMVs, caches cold as in a real step) at
     M = 1 and M = 8 (--timed-m: other row counts, e.g. 256 for a prefill chunk), both builds
     interleaved, and prints medians and the new/base ratio.
The opt-in AMX path (kernels/qamx.c) multiplies row layouts, which the engine no longer holds by default:
time it with `TERNLM_AMX=0|1 ternlm bench engine`.
Timing only, for this machine; not a test. Writes nothing.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ternlm.engine.core import Engine
from ternlm.linear.qlinear import QLinear

SOURCES = ["src/ternlm/kernels/qmatmul.c", "src/ternlm/kernels/qlanes.c"]     # those the revision has
HEADERS = ["src/ternlm/kernels/qmatmul_amx.h", "src/ternlm/kernels/vec.h",   # their includes (qmatmul_amx.h:
           "src/ternlm/kernels/layouts.h"]       # old revisions; layouts.h: since 02935c7)


def build(rev: str, march: str, out: Path, tag: str, cflags: list[str]) -> ctypes.CDLL:
    def text(path: str) -> str | None:
        if rev == "WORKTREE":
            return Path(path).read_text() if Path(path).exists() else None
        r = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None
    d = out / tag
    d.mkdir()
    for h in HEADERS:
        if (t := text(h)) is not None:
            (d / Path(h).name).write_text(t)
    srcs = []
    for s in SOURCES:
        if (t := text(s)) is not None:
            srcs.append(d / Path(s).name)
            srcs[-1].write_text(t)
    so = d / "kernels.so"
    subprocess.run(["cc", "-O3", f"-march={march}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi",
                    *cflags, *map(str, srcs), "-o", str(so), "-lm"], check=True)
    return ctypes.CDLL(str(so))


def matrices(engine: Engine) -> list:
    """Every QWeight part the model multiplies, in model order, each once."""
    found: dict[int, object] = {}

    def visit(o, depth=0):
        if depth > 6:
            return
        if isinstance(o, QLinear):
            for p in o.parts:
                found.setdefault(id(p), p)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, torch.nn.Module):
            for v in vars(o).values():
                visit(v, depth + 1)
            for m in o.children():
                visit(m, depth + 1)
    visit(engine.model)
    return list(found.values())


def call(lib: ctypes.CDLL, p, x: torch.Tensor, y: torch.Tensor, threads: int):
    """A prepared kernel call: (function, ctypes arguments)."""
    ptr = lambda t: ctypes.c_void_p(0 if t is None else t.data_ptr())  # noqa: E731
    n, k = p.shape
    return (getattr(lib, f"tq_{p.fmt}_{p.mode}_mm"),
            (ptr(x), ctypes.c_int64(x.shape[0]), ctypes.c_int64(k), ptr(p.codes), ptr(p.high), ptr(p.scale),
             ptr(p.bias), ptr(p.sup), ctypes.c_int64(n), ptr(y), ctypes.c_int64(n), ctypes.c_int(threads)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--new", default="WORKTREE")
    ap.add_argument("--march", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--timed-m", default="1,8", help="row counts to time, comma-separated (default 1,8)")
    ap.add_argument("--cflags-base", default="", help="extra compiler flags for the base build")
    ap.add_argument("--cflags-new", default="", help="extra compiler flags for the new build, written "
                    "--cflags-new=\"-DX=1 ...\": the constants qlanes.c leaves to the command line "
                    "(#ifndef: LANES_GEMM_M, KC_BYTES, CHUNKS_PER_THREAD)")
    ap.add_argument("--no-lm-head", action="store_true",
                    help="leave out the output projection (the widest matrix), as a prefill chunk does")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {k: build(rev, a.march, Path(tmp), k, flags.split())
                for k, rev, flags in (("base", a.base, a.cflags_base), ("new", a.new, a.cflags_new))}
        parts = matrices(Engine.load(a.model, weights="gguf"))
        if a.no_lm_head:      # a prefill multiplies only its last row by the output projection
            parts = [p for p in parts if p.shape[0] != max(q.shape[0] for q in parts)]
        print(f"{a.model}: {len(parts)} matrices, {sum(p.nbytes for p in parts) / 1e6:.1f} MB; "
              f"base {a.base}, new {a.new}, -march={a.march}, {a.threads} threads")
        for M in (1, 3, 8, 13, 16, 37, 100):
            for p in parts:
                x = torch.randn(M, p.shape[1])
                ys = {k: torch.empty(M, p.shape[0]) for k in libs}
                for k, lib in libs.items():
                    f, args = call(lib, p, x, ys[k], a.threads)
                    f(*args)
                if not torch.equal(ys["base"].view(torch.int32), ys["new"].view(torch.int32)):
                    raise SystemExit(f"different bits: {p.fmt}/{p.mode} {p.shape} at M = {M}")
        print("same output bits on every matrix at M = 1, 3, 8, 13, 16, 37, 100")
        for M in (int(v) for v in a.timed_m.split(",")):
            xs = {p.shape[1]: torch.randn(M, p.shape[1]) for p in parts}
            ys = [torch.empty(M, p.shape[0]) for p in parts]   # kept alive: the calls hold raw pointers
            calls = {k: [call(lib, p, xs[p.shape[1]], y, a.threads) for p, y in zip(parts, ys)]
                     for k, lib in libs.items()}
            times: dict[str, list[float]] = {k: [] for k in libs}
            for i in range(a.repeats):
                for k in (list(libs) if i % 2 else list(libs)[::-1]):   # interleaved, alternating order
                    t = time.perf_counter()
                    for f, args in calls[k]:
                        f(*args)
                    times[k].append(time.perf_counter() - t)
            b, n = statistics.median(times["base"]), statistics.median(times["new"])
            print(f"M = {M:3d}: base {b * 1e3:7.2f} ms   new {n * 1e3:7.2f} ms   new/base {n / b:.3f}   "
                  f"(median of {a.repeats}, all matrices once)")


if __name__ == "__main__":
    main()
