"""How long a streamed expert's miss spends converting its slabs (issue 49): convert.c's conversion of one
expert's gate, up and down matrices from a GGUF mixture of experts, as moe.StreamedExperts does on a miss
(into reused buffers, one thread), into the int layout (int8 activations, the default) and the lanes
layout (fp32 activations). Medians of --repeats over the same slab (warm caches) and the mean over other
experts' slabs read first (cold).

    .venv/bin/python benchmarks/expert_convert.py -m FILE.gguf [--layer 0] [--repeats 20] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from ternlm.models.gguf import GGUFReader, config_from_gguf, expert_slabs  # noqa: E402
from ternlm.linear.qconvert import lanes_empty, lanes_from_gguf  # noqa: E402
from ternlm.linear.qweight import QT  # noqa: E402


def _raw(fd: int, slab) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(os.pread(fd, slab.length, slab.offset), dtype=np.uint8).copy())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    reader = GGUFReader(args.model)
    slabs = expert_slabs(reader, config_from_gguf(reader))
    experts = sorted(e for (layer, e) in slabs if layer == args.layer)
    fd = os.open(args.model, os.O_RDONLY)
    try:
        print(f"{args.model.name}, layer {args.layer}, {args.threads} thread(s): ms a slab, median of {args.repeats} "
              "(warm) / mean over 16 other experts' slabs (cold)")
        for i, kind in enumerate(("gate", "up", "down")):
            s = slabs[(args.layer, experts[0])][i]
            qtype, x = QT(s.qtype), _raw(fd, s)
            others = [_raw(fd, slabs[(args.layer, e)][i]) for e in experts[1:17]]
            cells = []
            for int8 in (True, False):
                out = lanes_empty(qtype, s.rows, s.cols, int8)
                if out is None or lanes_from_gguf(x, qtype, s.rows, s.cols, out=out, int8=int8) is None:
                    cells.append("not native")
                    continue
                warm = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    lanes_from_gguf(x, qtype, s.rows, s.cols, out=out, int8=int8)
                    warm.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for y in others:
                    lanes_from_gguf(y, qtype, s.rows, s.cols, out=out, int8=int8)
                cold = (time.perf_counter() - t0) / max(len(others), 1)
                cells.append(f"{statistics.median(warm) * 1e3:.3f} / {cold * 1e3:.3f}")
            print(f"  {kind:4} {qtype.name:5} {s.rows}x{s.cols} {s.length / 1e6:.2f} MB: int {cells[0]}; lanes {cells[1]}")
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
