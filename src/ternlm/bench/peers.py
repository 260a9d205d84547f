"""The comparison peers, found rather than assumed: transformers (in this venv, the `[test]` extra) and
llama-cpp-python in its own venv (`make bench-peers`). Starting llama.cpp in any form (its worker, its
servers, llama-bench, llama-perplexity) is llamacpp.py's; find_llama_server is named here too for callers
that look for every peer in one place.

A missing peer is a named result (Peer.installed False, with the line that says how to get it), never
an exception: a report without peers still measures ternlm and says what it could not compare."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .llamacpp import PEERS_PYTHON, find_llama_server, peers_python  # noqa: F401  (named here for callers)

LLAMACPP, TRANSFORMERS = "llama.cpp", "transformers"


@dataclass(frozen=True)
class Peer:
    name: str              # LLAMACPP | TRANSFORMERS
    installed: bool
    version: str | None    # "0.3.36" (llama-cpp-python), "5.24.0" (transformers); None if not installed
    how: str               # how to install it, for the line a report prints when it is missing
    python: str | None = None   # llama.cpp only: the peers venv's interpreter

    @property
    def missing_text(self) -> str:
        return f"{self.name}: not installed ({self.how})"


def find_transformers() -> Peer:
    """transformers importable from this interpreter? Does not import it (seconds of start-up)."""
    how = "pip install -e '.[test]'"
    if importlib.util.find_spec("transformers") is None:
        return Peer(TRANSFORMERS, False, None, how)
    return Peer(TRANSFORMERS, True, importlib.metadata.version("transformers"), how)


def find_llamacpp(python: str) -> Peer:
    """llama-cpp-python under `python` (the peers venv)? Runs that interpreter once (about a second)
    to read its version; a python that is missing or cannot import llama_cpp counts as not installed."""
    how = "make bench-peers"
    if not python or not Path(python).exists():
        return Peer(LLAMACPP, False, None, how)
    try:
        out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return Peer(LLAMACPP, False, None, how)
    if out.returncode != 0:
        return Peer(LLAMACPP, False, None, how)
    return Peer(LLAMACPP, True, out.stdout.strip(), how, python)
