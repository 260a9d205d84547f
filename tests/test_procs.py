"""procs.die_with_parent: a child started with it dies when its parent is SIGKILLed (no cleanup code
runs then), which is how benches and `ternlm cluster` keep servers from outliving them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PARENT = r"""
import subprocess, sys, time
from ternlm.procs import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=die_with_parent if sys.argv[1] == "yes" else None)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"      # a zombie has died
    except FileNotFoundError:
        return False


def _orphan_after_parent_killed(tie: bool) -> tuple[int, bool]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "yes" if tie else "no"], stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _alive(child)
        if alive:
            os.kill(child, signal.SIGKILL)
        return child, alive
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_child_dies_with_its_killed_parent():
    _, alive = _orphan_after_parent_killed(tie=True)
    assert not alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_without_it_the_child_outlives_the_parent():
    """The control: the test above passes because of die_with_parent, not because children always die."""
    _, alive = _orphan_after_parent_killed(tie=False)
    assert alive
