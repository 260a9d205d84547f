import random, sys, time, os
sys.path.insert(0, "/work/main/src")
import torch
from ternlm.engine import Engine
torch.set_num_threads(2)
e = Engine.load("/work/big/qwen3-30b-a3b-synth.gguf", expert_cache=5705181440, min_reuse=1, ctx=4096)
rng = random.Random(0); V = e.config.vocab_size
p1 = [rng.randrange(100, V - 100) for _ in range(300)]
st = e.model.experts.stats
e.generate(p1, max_tokens=1, slot=0)
for rep in range(2):
    b = st.snapshot()
    out = e.generate(p1 + [rng.randrange(100, V-100) for _ in range(5)], max_tokens=16, slot=0)
    t = out.timings
    print("raw", os.environ.get("TERNLM_EXPERT_RAW"), "mg", os.environ.get("TERNLM_MISS_GROUP"), f"decode {t.decode_tokens} in {t.decode_s:.2f} s = {t.decode_tokens/t.decode_s:.2f} tok/s; ttft {t.ttft_s:.2f}", st.minus(b)["read_wait_us"])
