"""An expert miss, timed in parts (issue 36): cold pread of its three slabs, then its conversion by the
Python path (qweight.from_gguf + to_lanes, what every miss did before) and by kernels/convert.c
(models/qconvert.py), interleaved expert by expert (the order alternates), bits compared.

    .venv/bin/python benchmarks/results/moe-capped2/miss_cost.py -m /tmp/m36/qwen3-30b-a3b-L4.gguf -n 200
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ternlm.kernels.build import load
from ternlm.models.gguf import FastGGUFReader, config_from_gguf, expert_slabs
from ternlm.models.qconvert import lanes_from_gguf
from ternlm.models.qweight import from_gguf, to_lanes


def pread(fd: int, off: int, n: int) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    view, got = memoryview(buf), 0
    while got < n:
        got += os.preadv(fd, [view[got:]], off + got)
    return buf


def python_path(raw, s):
    q = from_gguf(raw, QT(s.qtype), s.rows, s.cols)
    return to_lanes(q) or q


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("-o", "--out")
    a = ap.parse_args()
    kern = load()
    reader = FastGGUFReader(a.model)
    cfg = config_from_gguf(reader)
    slabs = expert_slabs(reader, cfg)
    keys = sorted(slabs)[:: max(1, len(slabs) // a.n)][: a.n]
    fd = os.open(a.model, os.O_RDONLY)
    t = {"pread": [], "python": [], "native": []}
    nbytes = 0
    for i, key in enumerate(keys):
        raws = []
        for s in slabs[key]:                                      # cold: the slab's pages dropped first
            os.posix_fadvise(fd, s.offset, s.length, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for s in slabs[key]:
            raws.append(torch.from_numpy(pread(fd, s.offset, s.length)))
        t["pread"].append(time.perf_counter() - t0)
        nbytes += sum(s.length for s in slabs[key])
        outs = {}
        for path in (("python", "native") if i % 2 == 0 else ("native", "python")):
            t0 = time.perf_counter()
            if path == "python":
                outs[path] = [python_path(r, s) for r, s in zip(raws, slabs[key])]
            else:
                outs[path] = [lanes_from_gguf(r, QT(s.qtype), s.rows, s.cols, kernels=kern)
                              for r, s in zip(raws, slabs[key])]
            t[path].append(time.perf_counter() - t0)
        for p, n in zip(outs["python"], outs["native"]):          # the same bits
            for f in ("codes", "scale", "bias", "high", "sup"):
                x, y = getattr(p, f), getattr(n, f)
                assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), f
    per = nbytes / len(keys)
    res = {"model": a.model, "experts": len(keys), "bytes_per_expert": per, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg()}
    for k, v in t.items():
        ms = [x * 1e3 for x in v]
        res[k] = {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
                  "GB_s": per / statistics.fmean(v) / 1e9}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
