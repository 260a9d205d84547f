"""ternlm: an LLM inference engine that never re-reads a conversation."""
from .engine import ChatIds, Completion, Delta, Engine, Timings

__all__ = ["Engine", "Completion", "Delta", "Timings", "ChatIds"]
__version__ = "0.1.0"
