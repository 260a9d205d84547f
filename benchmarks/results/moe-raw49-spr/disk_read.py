import os, sys, time, mmap, random
from concurrent.futures import ThreadPoolExecutor
path = "/work/big/qwen3-30b-a3b-synth.gguf"
size = os.path.getsize(path)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
CH = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
def buf():
    m = mmap.mmap(-1, CH); return m
rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
n = int(3e9 // CH)
offs = [rng.randrange(1 << 30, size - CH) // 4096 * 4096 for _ in range(n)]
T = int(sys.argv[1])
bufs = [buf() for _ in range(T)]
import threading
loc = threading.local()
def rd(o):
    if not hasattr(loc, "b"): loc.b = buf()
    return os.preadv(fd, [loc.b], o)
t = time.perf_counter()
with ThreadPoolExecutor(T) as ex:
    tot = sum(ex.map(rd, offs))
dt = time.perf_counter() - t
print(f"threads {T} chunk {CH>>10} KiB: {tot/dt/1e9:.2f} GB/s")
