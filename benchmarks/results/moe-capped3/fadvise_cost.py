"""fadvise cost per slab vs merged over a contiguous window (page cache path), 96 experts of one layer, cold.
    .venv/bin/python benchmarks/results/moe-capped3/fadvise_cost.py
"""
import os, time, numpy as np, sys
from ternlm.models.gguf import FastGGUFReader, config_from_gguf, expert_slabs
M = "/tmp/m36/qwen3-30b-a3b-L4.gguf"
r = FastGGUFReader(M); cfg = config_from_gguf(r); slabs = expert_slabs(r, cfg)
fd = os.open(M, os.O_RDONLY)
W, D = os.POSIX_FADV_WILLNEED, os.POSIX_FADV_DONTNEED
buf = np.empty(4 << 20, np.uint8)
def pread(off, n):
    mv = memoryview(buf)[:n]; got = 0
    while got < n: got += os.preadv(fd, [mv[got:]], off + got)
def run(layer, experts, merged):
    T = dict(will=0.0, dont=0.0, pread=0.0)
    os.posix_fadvise(fd, 0, 0, D)
    t = time.perf_counter()
    keys = [(layer, e) for e in experts]
    for i in range(0, len(keys), 8):
        win = keys[i:i + 8]
        t0 = time.perf_counter()
        if merged:   # one call per tensor over the window's span (contiguous here)
            for j in range(3):
                a = slabs[win[0]][j]; b = slabs[win[-1]][j]
                os.posix_fadvise(fd, a.offset, b.offset + b.length - a.offset, W)
        else:
            for k in win:
                for s in slabs[k]: os.posix_fadvise(fd, s.offset, s.length, W)
        T["will"] += time.perf_counter() - t0
        for k in win:
            for s in slabs[k]:
                t0 = time.perf_counter(); pread(s.offset, s.length); T["pread"] += time.perf_counter() - t0
                if not merged:
                    t0 = time.perf_counter(); os.posix_fadvise(fd, s.offset, s.length, D); T["dont"] += time.perf_counter() - t0
        if merged:
            t0 = time.perf_counter()
            for j in range(3):
                a = slabs[win[0]][j]; b = slabs[win[-1]][j]
                os.posix_fadvise(fd, a.offset, b.offset + b.length - a.offset, D)
            T["dont"] += time.perf_counter() - t0
    T["all"] = time.perf_counter() - t
    return {k: round(v * 1e3, 1) for k, v in T.items()}
for rep in range(2):
    for merged in (False, True):
        print("merged" if merged else "per-slab", run(rep % 4, list(range(0, 96)), merged))
print(os.getloadavg())
