"""malloc: big buffers freed and allocated again stop page-faulting once kept (glibc), and the engine
keeps them only when the torch attention runs."""
from __future__ import annotations

import subprocess
import sys

PROBE = """
import resource, sys, torch
from ternlm.malloc import keep_large_buffers
print(keep_large_buffers() if sys.argv[1] == "1" else "off")
for _ in range(3):                       # warm: the first time always faults its pages in
    torch.ones(64 << 18).sum()           # 64 MiB of fp32, freed at once
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.ones(64 << 18).sum()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def faults(tuned: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], capture_output=True, text=True,
                         env={"TERNLM_MALLOC_TUNE": "1", "PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    return out[0], int(out[1])


def test_reallocating_big_buffers_stops_faulting():
    state, off = faults(False)
    assert state == "off" and off > 10 * 10_000        # each 64 MiB buffer is ~16k fresh pages
    state, on = faults(True)
    # tuned: the heap keeps the buffer, though an occasional re-fault of one buffer (16k pages) was seen
    assert state == "True" and on <= off // 5


ENGINE_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from tiny import tiny_engine
from ternlm import malloc
_, e = tiny_engine()
print(e.kernels is not None, malloc.large_buffers_kept())
"""


def engine_state(native: str) -> list[str]:
    import os
    from pathlib import Path
    env = {**os.environ, "TERNLM_MALLOC_TUNE": "1", "TERNLM_NATIVE": native}
    return subprocess.run([sys.executable, "-c", ENGINE_PROBE, str(Path(__file__).parent)], capture_output=True,
                          text=True, env=env, check=True).stdout.split()


def test_thresholds_raised_only_for_the_torch_attention():
    # native attention: no (queries x keys) buffers, so the loader's temporaries need not stay resident
    assert engine_state("1") == ["True", "False"]
    # torch attention (no kernels): its score buffers would page-fault in every layer
    assert engine_state("0") == ["False", "True"]


LOAD_PROBE = """
import contextlib, resource, sys, torch
from ternlm.malloc import loading
def rss_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
r0, f0 = rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
keep = []
with loading() if sys.argv[1] == "1" else contextlib.nullcontext():
    for i in range(40):   # a loader's pattern: a temporary (8 MiB, shrinking), a small result kept after it
        t = torch.empty((8 << 20) - i * (64 << 10), dtype=torch.uint8).fill_(1)
        keep.append(torch.ones(16 << 10, dtype=torch.uint8))
        del t
print(rss_mib() - r0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def load_growth(tuned: bool) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", LOAD_PROBE, "1" if tuned else "0"], capture_output=True,
                         text=True, env={"TERNLM_MALLOC_TUNE": "1", "PATH": "/usr/bin:/bin"}, check=True).stdout
    rss, faults = out.split()
    return float(rss), int(faults)


def test_loader_temporaries_leave_the_process_without_refaulting():
    # glibc's dynamic threshold: after the first 8 MiB block is unmapped, the smaller ones come from the
    # heap and their holes stay resident; inside loading() the heap is reused (no fresh pages for each
    # temporary) and its free pages go back at the end (malloc_trim). Measured: 9.7 MiB untuned, 2.4
    # tuned, of which 0.6 kept on purpose and the rest torch's own; faults: 40 temporaries of ~2,000
    # pages each would be ~80,000 if each were mapped afresh (the previous tuning did that).
    (untuned, _), (tuned, faults) = load_growth(False), load_growth(True)
    assert untuned - tuned > 5             # the probe sees the effect: this fails without loading()
    assert tuned < 4
    assert faults < 20_000


STREAM_PROBE = """
import random, sys, torch
from ternlm import malloc
with malloc.loading():                   # the serving thresholds, as after a model load
    pass
print(malloc.streamed_blocks_return() if sys.argv[1] == "1" else "off")
def anon_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))
base = anon_kib()
rng = random.Random(0)
cache, held, budget = [], 0, 64 << 20   # an LRU of "experts" of mixed sizes within 64 MiB
for i in range(600):
    n = rng.choice((1, 2, 3)) << 20
    tmp = [torch.empty(n // 4, dtype=torch.uint8).fill_(1) for _ in range(3)]   # conversion temporaries
    cache.append(torch.empty(n, dtype=torch.uint8).fill_(1))
    held += n
    del tmp
    while held > budget:
        held -= cache.pop(0).numel()
print(anon_kib() - base - held // 1024)  # anonymous KiB beyond what the cache holds
"""


def test_streamed_experts_freed_blocks_leave_the_process():
    """malloc.streamed_blocks_return: blocks freed while experts stream go back to the system (their own
    mappings), where the serving thresholds (32 MiB) kept them in a fragmented heap."""
    def run(on: bool) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", STREAM_PROBE, "1" if on else "0"], capture_output=True,
                             text=True, env={"TERNLM_MALLOC_TUNE": "1", "PATH": "/usr/bin:/bin"},
                             check=True).stdout.split()
        return out[0], int(out[1])
    state, on = run(True)
    assert state == "True"
    _, off = run(False)
    # measured: ~0.2 MiB beyond the cache with it, ~33 MiB without (the heap's holes)
    assert on < off // 4 and on < 8 << 10
