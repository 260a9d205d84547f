"""A checkpoint holds exactly the parameters the engine runs: an unknown one means a variant this engine does not
run (an o_proj bias, experts where none are expected), a missing one a broken checkpoint. Shared by the families
whose names are data of their own (models/nemotron_h.py, models/lfm2.py) and hf._check_params."""
from __future__ import annotations

from .config import UnsupportedModelError


def require_exactly(names: set[str], expected: set[str], optional: set[str] = frozenset()) -> None:
    """UnsupportedModelError naming up to 8 unknown (not in expected | optional) or missing (in expected) names."""
    unknown = sorted(names - expected - optional)
    if unknown:
        raise UnsupportedModelError(f"checkpoint has parameters this engine does not run: {', '.join(unknown[:8])}")
    missing = sorted(expected - names)
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks parameters: {', '.join(missing[:8])}")
