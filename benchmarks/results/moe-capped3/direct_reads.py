"""Cold reads of 96 experts (3 slabs each) of one layer: page cache path (WILLNEED 8 ahead, pread, DONTNEED) vs O_DIRECT
preads by N reader threads into aligned buffers. Wall time and the main thread's CPU time (thread_time).
    .venv/bin/python benchmarks/results/moe-capped3/direct_reads.py
"""
import os, time, numpy as np, threading, queue, sys
from concurrent.futures import ThreadPoolExecutor
from ternlm.models.gguf import FastGGUFReader, config_from_gguf, expert_slabs
M = "/tmp/m36/qwen3-30b-a3b-L4.gguf"
r = FastGGUFReader(M); cfg = config_from_gguf(r); slabs = expert_slabs(r, cfg)
fd = os.open(M, os.O_RDONLY); dfd = os.open(M, os.O_RDONLY | os.O_DIRECT)
W, D = os.POSIX_FADV_WILLNEED, os.POSIX_FADV_DONTNEED
A = 4096
def aligned(n):
    b = np.empty(n + A, np.uint8); o = (-b.ctypes.data) % A; return b[o:o + n]
buf = aligned(4 << 20)
def cached(keys):
    got_t = 0
    for i, k in enumerate(keys):
        if i % 8 == 0:
            for kk in keys[i:i + 8]:
                for s in slabs[kk]: os.posix_fadvise(fd, s.offset, s.length, W)
        for s in slabs[k]:
            mv = memoryview(buf)[:s.length]; g = 0
            while g < s.length: g += os.preadv(fd, [mv[g:]], s.offset + g)
            os.posix_fadvise(fd, s.offset, s.length, D)
def direct_read(s, b):
    lo = s.offset - s.offset % A; hi = -(-(s.offset + s.length) // A) * A
    mv = memoryview(b)[:hi - lo]; g = 0
    while g < hi - lo:
        n = os.preadv(dfd, [mv[g:]], lo + g)
        if n <= 0: raise OSError("short")
        g += n
    return s.offset - lo
def direct(keys, threads):
    bufs = [aligned(4 << 20) for _ in range(3 * 8)]
    ex = ThreadPoolExecutor(threads)
    futs = {}
    def submit(i):
        if i < len(keys):
            futs[i] = [ex.submit(direct_read, s, bufs[(i % 8) * 3 + j]) for j, s in enumerate(slabs[keys[i]])]
    for i in range(8): submit(i)
    for i in range(len(keys)):
        for f in futs.pop(i): f.result()
        submit(i + 8)
    ex.shutdown()
for rep in range(2):
    for name, fn in [("cached", cached), ("direct1", lambda k: direct(k, 1)), ("direct2", lambda k: direct(k, 2)), ("direct4", lambda k: direct(k, 4))]:
        keys = [(rep % 4, e) for e in range(96)]
        os.posix_fadvise(fd, 0, 0, D)
        t0 = time.perf_counter(); c0 = time.thread_time(); p0 = time.process_time()
        fn(keys)
        print(name, "wall %.0f ms, main-thread cpu %.0f ms, process cpu %.0f ms" % ((time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3, (time.process_time() - p0) * 1e3))
print(os.getloadavg())
