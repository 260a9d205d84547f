"""gemma3-270m: the 18 layers of one decode step (forward_batch, no logits) fused in layer.c against the
same layers in torch (model.native = None), one process, 12 interleaved rounds of 8 steps, process CPU
time and wall time in ms a step. --weights gguf, fp32 cache in both arms.

    .venv/bin/python benchmarks/results/gemma3/layers_cpu_ab.py CONTEXT [THREADS]
"""
import time, sys, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
from ternlm.engine import Engine
from ternlm.models.registry import model_path
from ternlm.models.llama import Segment
ctx = int(sys.argv[1])
e = Engine.load(str(model_path("gemma3-270m")), dtype="float32", weights="gguf", ctx=ctx + 256, kv_dtype="float32")
native = e.model.native
slot = e.slots[0]
ids = torch.randint(10, 200_000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
e.runner.prefill(slot, ids)
x = e.model.embed_ids(torch.tensor([100]))
seg = [Segment(ctx, 1, slot.k, slot.v, "none")]
res = {True: [], False: []}
with torch.inference_mode():
    for r in range(12):
        for fused in (False, True):
            e.model.native = native if fused else None
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(8):
                e.model.forward_batch(x, seg)
            res[fused].append(((time.process_time() - c0) * 125, (time.perf_counter() - w0) * 125))
for f, v in res.items():
    cpu = sorted(a for a, _ in v); wall = sorted(b for _, b in v)
    print(f"ctx {ctx} {'fused' if f else 'torch'} layers: cpu ms/step median {cpu[len(cpu)//2]:.2f} min {cpu[0]:.2f}; wall median {wall[len(wall)//2]:.2f} min {wall[0]:.2f}")
