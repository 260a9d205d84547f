"""malloc.keep_large_buffers: big buffers freed and allocated again stop page-faulting (glibc)."""
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
