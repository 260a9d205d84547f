"""OpenAI-compatible HTTP server: `ternlm serve`. app (routes), schemas (request/response shapes),
errors (OpenAI error bodies), metrics (Prometheus, per app), cli (the serve subcommand).
The scheduler that owns the engine lives in ternlm.engine.scheduler; this package only talks to it."""
from .app import ServeConfig, create_app

__all__ = ["ServeConfig", "create_app"]
