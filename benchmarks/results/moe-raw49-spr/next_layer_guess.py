import random, sys, collections
sys.path.insert(0, "/work/main/src")
import torch
from ternlm.engine import Engine
from ternlm.kernels import moe_layer
torch.set_num_threads(2)
H = {}
orig = moe_layer.NativeMoELayer.__call__
def call(self, x, table, scratch):
    r = orig(self, x, table, scratch)
    M = x.shape[0]
    if M == 1:
        h = scratch[:M * self.spec.hidden].clone()   # the experts' input (normed post-attention state)
        H.setdefault("steps", []).append((self.moe.layer, h, self.router))
    return r
moe_layer.NativeMoELayer.__call__ = call
e = Engine.load("/work/big/qwen3-30b-a3b-synth.gguf", expert_cache=5705181440, min_reuse=1, ctx=4096)
rng = random.Random(0); V = e.config.vocab_size
p = [rng.randrange(100, V - 100) for _ in range(200)]
e.generate(p, max_tokens=20, slot=0)
steps = H["steps"]
hit = tot = 0
for i in range(len(steps) - 1):
    (l, h, R), (l2, h2, R2) = steps[i], steps[i + 1]
    if l2 != l + 1: continue
    act = set(torch.topk(h2 @ R2.T, 8).indices.tolist())
    pred = set(torch.topk(h @ R2.T, 8).indices.tolist())
    pred16 = set(torch.topk(h @ R2.T, 16).indices.tolist())
    hit += len(act & pred); tot += 8
    H.setdefault("h16", 0); H["h16"] += len(act & pred16)
print(f"next layer's router on this layer's input: {hit}/{tot} = {hit/tot:.1%} of the next layer's experts in the top 8, {H['h16']/tot:.1%} in the top 16")
