"""Test helper: a real `ternlm serve` process on a free port, ready once /health says 200.

The launcher itself is the benchmarks' (ternlm.bench.procs.TernlmServe); this module names it for the
tests and adds their fixtures. Why a subprocess and not an in-process app: the server's promises (one
engine thread, clean shutdown on signals, the model loading behind /health) are properties of the
process, so the tests talk to it over TCP exactly as a client would. Output goes to a log file (a pipe
could fill up and block the server); `log()` returns it for assertions and failure messages.
"""
from __future__ import annotations

from ternlm.bench.procs import LIVE as _LIVE  # noqa: F401  every child started; killed at exit if still running
from ternlm.bench.procs import TernlmServe as ServerProc
from ternlm.bench.procs import free_port  # noqa: F401

__all__ = ["ServerProc", "free_port", "serving", "openai_client", "_LIVE"]


def serving(*args: str):
    """Generator for a module fixture: `yield from serving(flags...)` runs one real server for the
    module, closes it pass or fail, and checks at the end that it logged no traceback."""
    with ServerProc(*args) as s:
        yield s
        assert "Traceback" not in s.log(), s.log()[-4000:]


def openai_client(s: ServerProc):
    """The official client against `s`: no retries (a failure shows), a generous timeout for 2 cores."""
    from openai import OpenAI
    return OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=300)
