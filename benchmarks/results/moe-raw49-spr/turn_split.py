import random, sys, time, collections
sys.path.insert(0, "/work/main/src")
import torch
from ternlm.engine import Engine
torch.set_num_threads(2)
import os
from ternlm.models import moe as _m
_m.READ_AHEAD = int(os.environ.get("RA", "24"))
e = Engine.load("/work/big/qwen3-30b-a3b-synth.gguf", expert_cache=5705181440, min_reuse=1, ctx=4096)
T = collections.Counter()
class LibProxy:
    def __init__(s, lib): s._lib = lib
    def __getattr__(s, n):
        f = getattr(s._lib, n)
        if not n.startswith("tq_"): return f
        def w(*a):
            t = time.perf_counter(); r = f(*a); T[n] += time.perf_counter() - t; return r
        return w
class KProxy:
    def __init__(s, k): s._k = k; s.lib = LibProxy(k.lib)
    def __getattr__(s, n): return getattr(s._k, n)
for L in e.model.native:
    L.kernels = KProxy(L.kernels)
rng = random.Random(0); V = e.config.vocab_size
p1 = [rng.randrange(100, V - 100) for _ in range(1990)]
p2 = p1 + [rng.randrange(100, V - 100) for _ in range(238)]
t = time.perf_counter(); e.generate(p1, max_tokens=1, slot=0); print("turn1", time.perf_counter() - t, dict((k, round(v, 2)) for k, v in T.items()))
T.clear(); st = e.model.experts.stats; b = st.snapshot()
t = time.perf_counter(); e.generate(p2, max_tokens=1, slot=0); print("turn2", time.perf_counter() - t, dict((k, round(v, 2)) for k, v in T.items()), st.minus(b))
