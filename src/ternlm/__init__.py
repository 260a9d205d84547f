"""ternlm: an LLM inference engine that never re-reads a conversation."""
from .cpu import cap_onednn_below_amx

cap_onednn_below_amx()   # [ONEDNN-CAP] before anything runs oneDNN: its AMX bf16 rows are not batch-invariant
from .engine.core import ChatIds, Completion, Delta, Engine, Restored, Timings
from .kv.store import CacheConfig

__all__ = ["Engine", "Completion", "Delta", "Timings", "ChatIds", "Restored", "CacheConfig"]
__version__ = "0.1.0"
