"""OpenAI-compatible HTTP server: `ternlm serve`. app (routes), schemas (request/response shapes),
errors (OpenAI error bodies), metrics (Prometheus, per app), cli (the serve subcommand), ollama.py /
anthropic.py / responses.py (the other dialects), ui.py (the chat page), cluster.py (`ternlm cluster`).
The scheduler that owns the engine lives in ternlm.engine.scheduler; this package only talks to it.
May import: engine, models, kv, text, and the helpers at ternlm's top. Never cli or bench."""
from .app import ServeConfig, create_app

__all__ = ["ServeConfig", "create_app"]
