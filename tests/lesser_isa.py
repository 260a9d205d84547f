"""Run a test script against the native kernels as a lesser CPU would build them.

The host may have AVX-512; users' CPUs may have AVX2 only, or less. TERNLM_KERNEL_MARCH caps the
kernels' -march (and is part of their digest, so builds never mix); each call builds into its own
cache directory, in a fresh interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# (-march, the ISA path kernels/build.py reports for it)
LESSER = pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64", "scalar")])


def run_built_for(march: str, script: str, cache_dir, mtune: str | None = None) -> list[str]:
    """Run `script` (python source; tests/ on its path) with the kernels built for `march` (and tuned
    for `mtune`) into `cache_dir`; returns its stdout split in words. Fails the test on a non-zero exit."""
    env = dict(os.environ, TERNLM_KERNEL_MARCH=march, XDG_CACHE_HOME=str(cache_dir),
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    if mtune:
        env["TERNLM_KERNEL_MTUNE"] = mtune
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()
