import random, sys, collections
sys.path.insert(0, "/work/main/src")
import torch
from ternlm.engine import Engine
from ternlm.models.moe import StreamedExperts
torch.set_num_threads(2)
C = collections.Counter()
g = StreamedExperts.get
def get(self, layer, expert, rows=0, raw=None):
    C[(layer, expert)] += rows
    return g(self, layer, expert, rows, raw)
StreamedExperts.get = get
e = Engine.load("/work/big/qwen3-30b-a3b-synth.gguf", expert_cache=5705181440, min_reuse=1, ctx=4096)
rng = random.Random(0); V = e.config.vocab_size
p = [rng.randrange(100, V - 100) for _ in range(1000)]
e.generate(p, max_tokens=1, slot=0)
first = dict(C); C.clear()
e.generate(p + [rng.randrange(100, V - 100) for _ in range(3)], max_tokens=40, slot=0)
dec = dict(C)
L = 48; E = 128; top = 41
tot = sum(dec.values())
# share of decode rows on each layer's top-41 experts by prefill popularity, vs on experts 0..40 (first-read pins)
pop = sum(sum(dec.get((l, x), 0) for x in sorted(range(E), key=lambda x: -first.get((l, x), 0))[:top]) for l in range(L))
asc = sum(sum(dec.get((l, x), 0) for x in range(top)) for l in range(L))
orc = sum(sum(sorted((dec.get((l, x), 0) for x in range(E)), reverse=True)[:top]) for l in range(L))
print(f"decode rows {tot}: on top-{top} by prefill popularity {pop/tot:.1%}, on experts 0..{top-1} {asc/tot:.1%}, oracle {orc/tot:.1%}")
