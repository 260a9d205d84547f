"""gemma3-270m decode at two context lengths in one process, rounds interleaved (a shared, noisy
machine slows both alike: the ratio is what counts). One prefill of the longer context; each round
truncates the slot's record to a context and decodes from there (the KV below it is the prefill's).

    .venv/bin/python benchmarks/results/gemma3/context_ab.py [--short 1000] [--long 16000] [--steps 16] [--rounds 5]

--weights gguf, --kv-dtype auto (every layer fused in kernels/layer.c, fp16 cache), 2 threads. Prints
ms per decode step (wall and process CPU), median and min over the rounds, and long/short tok/s.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", type=int, default=1000)
    ap.add_argument("--long", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from ternlm.engine import Engine
    from ternlm.models.registry import model_path
    e = Engine.load(str(model_path("gemma3-270m")), dtype="float32", weights="gguf", kv_dtype="auto",
                    ctx=a.long + a.steps + 256)
    print(f"layers {'fused' if e.model.native is not None else 'torch'}, KV {e.model.kv_dtype}", flush=True)
    ids = torch.randint(10, 200_000, (a.long,), generator=torch.Generator().manual_seed(0)).tolist()
    slot = e.slots[0]
    t0 = time.perf_counter()
    e.runner.prefill(slot, ids)
    print(f"prefill {a.long} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    res: dict[int, list] = {a.short: [], a.long: []}
    for _ in range(a.rounds):
        for n in (a.short, a.long):
            slot.record.truncate(n)
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(a.steps):
                e.runner.decode(slot, 100 + i)
            res[n].append(((time.perf_counter() - w0) * 1000 / a.steps, (time.process_time() - c0) * 1000 / a.steps))
    med = {}
    for n, v in res.items():
        wall, cpu = sorted(x for x, _ in v), sorted(y for _, y in v)
        med[n] = (wall[len(wall) // 2], wall[0], cpu[len(cpu) // 2])
        print(f"context {n:6}: wall ms/step median {med[n][0]:.2f} min {med[n][1]:.2f}; cpu ms/step median "
              f"{med[n][2]:.2f}; samples " + " ".join(f"{x:.1f}" for x, _ in v))
    print(f"tok/s at {a.long} / at {a.short}: median {med[a.short][0] / med[a.long][0]:.2f}, "
          f"min {med[a.short][1] / med[a.long][1]:.2f}, cpu {med[a.short][2] / med[a.long][2]:.2f}")


if __name__ == "__main__":
    main()
