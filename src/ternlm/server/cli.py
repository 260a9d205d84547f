"""`ternlm serve`: parse flags into a validated ServeConfig and run uvicorn.

Why a uvicorn.Server subclass: on SIGTERM / Ctrl-C uvicorn stops accepting and then waits for open
responses. We also tell the scheduler to drain at that moment (waiting requests get 503, running
ones `--shutdown-grace` seconds to finish, then an error event), so streams end promptly and the
process exits without a traceback. The model loads in the app's background thread; if that fails
the server exits with status 1.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable


def add_serve_parser(subparsers, engine_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with prefix KV reuse",
                              description="Serve /v1/chat/completions, /v1/completions, /v1/models, "
                                          "/health, /metrics and /slots.")
    engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--reasoning-format", default="auto", choices=["auto", "none"],
                   help="auto (default): a thinking model's <think> block goes to reasoning_content, apart "
                        "from the answer; none: the raw text in content")
    p.add_argument("--slots", type=int, default=4, help="KV sequences (concurrent requests)")
    p.add_argument("--api-key", dest="api_keys", action="extend", nargs="+", default=[], metavar="KEY",
                   help="require 'Authorization: Bearer KEY'; each key is its own cache namespace")
    p.add_argument("--admin-key", dest="admin_keys", action="extend", nargs="+", default=[], metavar="KEY",
                   help="like --api-key, and /slots shows every tenant's slots to it (other keys see their own)")
    p.add_argument("--cors-origins", action="extend", nargs="+", default=[], metavar="ORIGIN",
                   help="browser origins (e.g. http://localhost:5173, or *) allowed to call the API from "
                        "another origin; default none (the chat page at / is same-origin)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a slot; more get 429")
    p.add_argument("--max-body", type=_size, default="4MiB", metavar="SIZE",
                   help="largest request body (default 4MiB); larger ones get 413 before they are read whole")
    p.add_argument("--step-tokens", type=int, default=16,
                   help="rows one batched step feeds while some request decodes: decodes plus prefill "
                        "chunks (default 16: streams stay within ~2.5x their idle inter-token time during a long prefill; larger prefills faster)")
    p.add_argument("--shutdown-grace", type=float, default=5.0,
                   help="seconds running requests get to finish on SIGTERM/Ctrl-C")
    p.add_argument("--cache-ram", type=_size, default="2GiB", metavar="SIZE",
                   help="host RAM for KV blocks of conversations whose slot was reused (default 2GiB; 0: none)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="disk tier directory (default $XDG_CACHE_HOME/ternlm/kv; with --api-key the disk tier "
                        "is off unless a directory is given here)")
    p.add_argument("--cache-disk", type=_size, default="20GiB", metavar="SIZE",
                   help="disk budget for KV blocks (default 20GiB; 0: no disk tier)")
    p.add_argument("--cache-redis", default=None, metavar="URL",
                   help="shared KV tier in Redis/Valkey below RAM and disk, for replicas behind a router: "
                        "redis://[:password@]host:port/db, rediss://... or unix:///path.sock (README: Scale-out)")
    p.add_argument("--cache-redis-ttl", type=int, default=0, metavar="SECONDS",
                   help="expire KV blocks in Redis after this long (default 0: never; Redis's maxmemory policy evicts)")
    p.add_argument("--cache-redis-timeout", type=float, default=0.5, metavar="SECONDS",
                   help="Redis connect/read timeout; on any error the tier turns off and reconnects (default 0.5)")
    p.set_defaults(func=cmd_serve, ctx=8192)   # serve's default context (the model's max still caps it)
    return p


def _size(text: str) -> int:
    from ..sizes import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_kv_dir() -> str:
    """$XDG_CACHE_HOME/ternlm/kv (default ~/.cache/ternlm/kv). Creates nothing."""
    from ..paths import cache_root
    return str(cache_root() / "kv")


def disk_dir(args) -> str | None:
    """The disk tier's directory. With API keys the server is multi-tenant and block headers hold every
    tenant's token ids, so conversations go to disk only where the operator chose a directory."""
    if args.cache_dir:
        return args.cache_dir
    if args.api_keys or args.admin_keys:
        import logging
        logging.getLogger("ternlm.server").info(
            "disk KV tier off: with --api-key it is opt-in (--cache-dir DIR); RAM tier only")
        return None
    return default_kv_dir()


def cmd_serve(args) -> int:
    from ..malloc import one_arena
    one_arena()                 # before uvicorn and the loader start threads (one malloc arena for all)
    import uvicorn

    from .app import ServeConfig, create_app

    config = ServeConfig(model=args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype,
                         prefix_reuse=not args.no_prefix_kv,
                         min_reuse=args.min_reuse, slots=args.slots, ctx=args.ctx, chunk_size=args.chunk,
                         threads=args.threads, api_keys=tuple(args.api_keys), admin_keys=tuple(args.admin_keys),
                         cors_origins=tuple(args.cors_origins), step_tokens=args.step_tokens,
                         max_queue=args.max_queue, max_body_bytes=args.max_body,
                         shutdown_grace_s=args.shutdown_grace, cache_ram=args.cache_ram,
                         cache_dir=disk_dir(args), cache_disk=args.cache_disk, cache_redis=args.cache_redis,
                         cache_redis_ttl=args.cache_redis_ttl, cache_redis_timeout=args.cache_redis_timeout,
                         reasoning_format=args.reasoning_format, chat_template=args.chat_template,
                         expert_cache=args.expert_cache, draft_model=args.draft_model,
                         activations=args.activations, speculative=args.speculative != "off",
                         state_interval=args.state_interval)
    if not args.no_fit_check:    # one line and exit 2 before the port opens (fit.py); fetches a new model first
        from ..engine.fit import require_fit
        require_fit(config.model, dtype=config.dtype, weights=config.weights, kv_dtype=config.kv_dtype,
                    ctx=config.ctx, slots=config.slots, ram_tier=config.cache_ram if config.prefix_reuse else 0,
                    expert_cache=config.expert_cache, draft_model=config.draft_model, slots_flag=True)
    if config.cache_dir and config.cache_disk > 0 and config.prefix_reuse:
        from pathlib import Path

        from ..kv.disk import secure_dir
        try:
            secure_dir(Path(config.cache_dir))   # another user's directory: one line now, not at load
        except OSError:
            pass                                 # unusable: the disk tier turns itself off at load, logged
    server = None

    def on_fatal(message: str) -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_fatal=on_fatal)
    state = app.state.ternlm
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, lifespan="on",
                        timeout_graceful_shutdown=math.ceil(config.shutdown_grace_s) + 5)
    server = _make_server(uv, on_signal=state.begin_shutdown)
    server.run()
    return 1 if state.status == "failed" else 0


def _make_server(config, on_signal: Callable[[], None]):
    """A uvicorn.Server that also starts our drain on SIGINT/SIGTERM. Built here, not at import time,
    so the CLI parser (which imports this module for every subcommand) does not import uvicorn."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            on_signal()               # schedules the drain on the event loop; takes no locks here
            super().handle_exit(sig, frame)

    return Server(config)
