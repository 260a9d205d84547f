"""The resident load of a GGUF's quantized matrices with and without kernels/convert.c (issue 36):
load_gguf(keep_quantized, lanes) timed in one process, the two paths interleaved (python, native,
python, native, ...), and every weight of the two loads compared bit for bit.

    .venv/bin/python benchmarks/results/moe-capped2/load_time.py \
        ~/.cache/ternlm/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import ternlm.models.qconvert as qconvert
from ternlm.models.gguf import load_gguf
from ternlm.models.qweight import QWeight


def load(path: str, native: bool):
    real = qconvert.lanes_from_gguf
    if not native:
        qconvert.lanes_from_gguf = lambda *a, **k: None          # every matrix takes the Python path
    try:
        t0 = time.perf_counter()
        m = load_gguf(path, torch.float32, sha256="-", keep_quantized=True, lanes=True)
        return m, time.perf_counter() - t0
    finally:
        qconvert.lanes_from_gguf = real


def same(a, b) -> bool:
    if isinstance(a, QWeight):
        return a.fmt == b.fmt and all(
            (x is None and y is None) or (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y))
            for x, y in ((getattr(a, f), getattr(b, f)) for f in ("codes", "scale", "bias", "high", "sup")))
    return torch.equal(a, b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-o", "--out")
    a = ap.parse_args()
    times = {"python": [], "native": []}
    for _ in range(a.repeats):
        for path in ("python", "native"):
            m, dt = load(a.model, path == "native")
            times[path].append(dt)
            del m
    py, _ = load(a.model, False)
    nat, _ = load(a.model, True)
    assert py.weights.keys() == nat.weights.keys()
    bad = [k for k in py.weights if not same(py.weights[k], nat.weights[k])]
    res = {"model": a.model, "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
           "weights_seconds": times, "weights": len(py.weights), "differing": bad}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    assert not bad, bad


if __name__ == "__main__":
    main()
