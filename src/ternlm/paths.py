"""Where ternlm keeps what it downloads and builds: one root for models, kernels and the KV disk tier."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/ternlm`` (default ``~/.cache/ternlm``). Pure: creates nothing."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ternlm"


def cache_dir() -> Path:
    """cache_root(). Side effect: creates it if missing."""
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path
