"""ternlm: an LLM inference engine that never re-reads a conversation."""
import os

# OpenMP threads that spin-wait between parallel regions collapse when any other process wants a
# core (measured on 2 cores with a neighbour busy: decode 3 tok/s spinning vs 31 tok/s passive).
# Set before torch loads its OpenMP runtime; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .engine import ChatIds, Completion, Delta, Engine, Timings  # noqa: E402

__all__ = ["Engine", "Completion", "Delta", "Timings", "ChatIds"]
__version__ = "0.1.0"
