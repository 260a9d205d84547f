"""gemma3-270m decode step: layers fused in kernels/layer.c against the same layers in torch, in one
process, rounds interleaved (so a shared, noisy machine slows both alike: the ratio is what counts).

    .venv/bin/python benchmarks/results/gemma3/decode_ab.py [--context 1000] [--steps 32] [--rounds 3]

Both arms: --weights gguf (quantized blocks, native matmuls), fp32 KV, the same slot contents; the torch
arm is the same model with `model.native = None` (what every gemma3 layer ran before layer.c took it).
A third arm: fused with the fp16 cache (`--kv-dtype auto`), its own engine. Prints ms per decode step
(runner.decode: embedding, 18 layers, final norm, the 262,144-row LM head, sampling's logits) and ms of
the 18 layers alone (forward_batch with no logits: what layer.c replaced), median and min of the rounds.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from ternlm.engine import Engine
    from ternlm.models.llama import Segment
    from ternlm.models.registry import model_path
    path = str(model_path("gemma3-270m"))
    ctx = -(-(a.context + a.steps + 8) // 256) * 256
    e32 = Engine.load(path, dtype="float32", weights="gguf", ctx=ctx, kv_dtype="float32")
    e16 = Engine.load(path, dtype="float32", weights="gguf", ctx=ctx, kv_dtype="auto")
    assert e32.model.native is not None and e16.model.native is not None and e16.model.kv_dtype == torch.float16
    ids = torch.randint(10, 200_000, (a.context,), generator=torch.Generator().manual_seed(0)).tolist()
    for e in (e32, e16):
        e.runner.prefill(e.slots[0], ids)
    native = e32.model.native

    def steps(e, fused: bool) -> float:
        if e is e32:                                   # the fp16 engine always runs fused
            e32.model.native = native if fused else None
        slot = e.slots[0]
        slot.record.truncate(a.context)
        t0 = time.perf_counter()
        for i in range(a.steps):
            e.runner.decode(slot, 100 + i)
        return (time.perf_counter() - t0) * 1000 / a.steps

    @torch.inference_mode()
    def layers(e, fused: bool) -> float:
        if e is e32:
            e32.model.native = native if fused else None
        slot = e.slots[0]
        x = e.model.embed_ids(torch.tensor([100]))
        seg = [Segment(a.context, 1, slot.k, slot.v, "none")]     # rewrites one position: the same work
        t0 = time.perf_counter()
        for _ in range(a.steps):
            e.model.forward_batch(x, seg)
        return (time.perf_counter() - t0) * 1000 / a.steps

    arms = [("torch layers, fp32 KV", e32, False), ("fused, fp32 KV", e32, True), ("fused, fp16 KV", e16, True)]
    res = {(n, w): [] for n, _, _ in arms for w in ("step", "layers")}
    for _ in range(a.rounds):
        for n, e, fused in arms:
            res[(n, "step")].append(steps(e, fused))
            res[(n, "layers")].append(layers(e, fused))
    e32.model.native = native
    for (n, w), v in res.items():
        print(f"context {a.context}: {n:22} {w:6} ms median {sorted(v)[len(v) // 2]:7.2f} min {min(v):7.2f}"
              "  samples " + " ".join(f"{x:.2f}" for x in v))


if __name__ == "__main__":
    main()
