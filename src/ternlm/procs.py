"""Child processes that never outlive the process that started them.

A bench or `ternlm cluster` starts servers and stops them in `finally:` blocks, but SIGTERM or SIGKILL
to the parent skips those (seen: `pkill -f "bench multiturn"` left its three servers running). The
kernel can do it instead: PR_SET_PDEATHSIG sends the child SIGTERM when its parent thread dies,
however it dies. Linux-only; elsewhere the parent's own cleanup is the only line.
"""
from __future__ import annotations

import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A subprocess.Popen `preexec_fn` (runs in the child before exec): SIGTERM this child when its
    parent dies. Side effect: the child's death signal. Silently nothing where prctl is missing."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
