"""Invariant checks that stay on under `python -O`.

Why not `assert`: asserts vanish under -O, and the invariants here guard the worst bug this project can
have (KV answered from the wrong state). A failed check raises InvariantError: the request that hit it
fails (the scheduler turns any exception of one request into that request's error), the server and the
other conversations carry on. Pure Python; imports nothing of the engine.
"""
from __future__ import annotations


class InvariantError(RuntimeError):
    """An engine invariant did not hold. Fails the request, never the server."""


def check(ok: bool, what: str) -> None:
    """Raise InvariantError(what) unless ok. `what` says which invariant, in a log-ready phrase."""
    if not ok:
        raise InvariantError(what)
