"""The OpenAI-compatible HTTP front: app factory, routes, and the bridge to the scheduler's thread.

Why this shape:
- Routes never touch slots or the model. They authenticate, parse, render the chat template /
  tokenize (read-only tokenizer work, off the event loop), check the context budget, and hand a
  GenRequest to the Scheduler, whose one worker thread owns the engine. Events come back through a
  per-request asyncio queue fed by `loop.call_soon_threadsafe`, so the worker never waits on a client.
- The model loads in a background thread started by the lifespan: the port is open at once and
  /health says 503 until the engine is ready.
- A response starts only with the request's first generated output, so failures found at prefill
  are still proper HTTP errors, not a 200 stream carrying an error event.
- Clients that leave are noticed (stream cancelled by Starlette; non-stream requests poll) and their
  ticket cancelled: the worker stops them within one step and frees the slot.
- No module globals: all state hangs off one ServerState per app.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import threading
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..cpu import choose_dtype, probe
from ..engine.core import Completion, Delta, Engine
from ..kv.kvtype import KV_CHOICES
from ..kv.store import CacheConfig
from ..engine.scheduler import (Admitted, Cancelled, Event, Failed, Finished, GenParams, GenRequest, QueueFull,
                         Scheduler, ShuttingDown, Ticket)
from ..engine.weights import WEIGHTS
from ..text import reasoning, tools
from ..text.grammar import GrammarSpec
from . import anthropic, ollama, responses, schemas
from .dialect import OPENAI, Dialect
from .errors import APIError, bad_request, install_handlers, unauthorized, unavailable
from .metrics import CONTENT_TYPE, Metrics, StatusCounter
from .ui import mount_ui

log = logging.getLogger("ternlm.server")

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
                       "/slots", "/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens",
                       "/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/version", "/api/ps",
                       "/v1/responses"})
_MAX_OWNERS = 4096      # namespaces remembered for /slots scoping (least recently used dropped)
_POLL_S = 0.25          # how often a waiting non-stream request checks whether its client is still there


@dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"              # cpu.choose_dtype: resolved (and refused) at construction
    weights: str = "auto"            # weights.choose_weights: auto | gguf | bf16 | fp32
    kv_dtype: str = "auto"           # the KV cache's format: auto | float32 | float16 | q8_0 (kv/kvtype.py)
    prefix_reuse: bool = True
    min_reuse: int = 16
    slots: int = 4
    ctx: int | None = 8192
    chunk_size: int | None = None       # prefill rows a step; None: auto (Engine.load plans it)
    threads: int | None = None
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # API keys that also see every tenant's slots in /slots
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    max_queue: int = 64
    step_tokens: int = 16             # rows per batched step while some request decodes (scheduler)
    max_body_bytes: int = 4 << 20
    shutdown_grace_s: float = 5.0     # on SIGTERM/Ctrl-C, running requests get this long to finish
    cache_ram: int = 2 << 30          # bytes of KV blocks kept in host RAM after their slot is reused
    cache_dir: str | None = None      # disk tier directory (None: no disk tier)
    cache_disk: int = 20 << 30        # bytes of KV block files in cache_dir (0: no disk tier)
    cache_redis: str | None = None    # shared Redis/Valkey tier URL (None: none); kv/redis_tier.py
    cache_redis_ttl: int = 0          # seconds a block lives in Redis (0: until its maxmemory policy evicts it)
    cache_redis_timeout: float = 0.5  # Redis connect/read timeout (seconds)
    reasoning_format: str = "auto"    # reasoning.py: auto (split <think> out) | none (raw text)
    chat_template: str | None = None  # jinja source replacing the model's own template (--chat-template)
    expert_cache: str = "auto"        # mixture of experts: auto | resident | a size (models/moe.plan_expert_cache)
    draft_model: str | None = None    # a small model of the same tokenizer drafting for speculation (draft_model.py)
    activations: str = "auto"         # weights.py: what quantized weights multiply: auto | int8 | fp32
    speculative: bool = True          # draft and verify (sequence.py; lossless); requests may turn it off
    state_interval: int = 64          # hybrid models: recurrent snapshots every N positions (kv/recurrent.py)

    def __post_init__(self) -> None:
        choose_dtype(self.dtype, probe())    # one clear ValueError now, not a traceback from a layer later
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown weights {self.weights!r}; choose one of {', '.join(WEIGHTS)}")
        if self.kv_dtype not in KV_CHOICES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r}; choose {', '.join(KV_CHOICES)}")
        checks = [(self.slots >= 1, "slots must be >= 1"), (self.max_queue >= 0, "max_queue must be >= 0"),
                  (self.step_tokens >= 1, "step_tokens must be >= 1"),
                  (self.min_reuse >= 0, "min_reuse must be >= 0"), (self.chunk_size is None or self.chunk_size >= 1, "chunk must be >= 1"),
                  (self.ctx is None or self.ctx >= 2, "ctx must be >= 2"),
                  (self.threads is None or self.threads >= 1, "threads must be >= 1"),
                  (self.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
                  (self.shutdown_grace_s >= 0, "shutdown grace must be >= 0"),
                  (self.cache_ram >= 0 and self.cache_disk >= 0, "cache budgets must be >= 0"),
                  (all(k.strip() for k in self.api_keys + self.admin_keys), "API keys must not be empty")]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)
        if self.cache_redis is not None:
            from ..kv.redis_tier import check_url
            check_url(self.cache_redis)          # one clear line at startup, not a failed load later
        if self.reasoning_format not in reasoning.FORMATS:
            raise ValueError(f"unknown reasoning format {self.reasoning_format!r}; choose {', '.join(reasoning.FORMATS)}")
        if self.cache_redis_ttl < 0 or self.cache_redis_timeout <= 0:
            raise ValueError("--cache-redis-ttl must be >= 0 and --cache-redis-timeout > 0")


class ClientGone(Exception):
    """The HTTP client disconnected while its request was waiting or running."""


class Inbox:
    """One response's event queue ((choice index, Event) pairs). `post` runs on the worker thread;
    the rest on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._q: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._checked = time.monotonic()     # when we last asked whether the client is still there

    def post(self, event: tuple[int, Event]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, event)
        except RuntimeError:
            pass  # the event loop is closed (shutdown): nobody is listening any more

    async def get(self) -> tuple[int, Event]:
        return await self._q.get()

    async def get_or_gone(self, request: Request) -> tuple[int, Event]:
        """Next event; raises ClientGone if the client has disconnected. Checks at least every
        _POLL_S, whether events are flowing (a long non-stream answer) or not (queued, prefilling)."""
        while True:
            if time.monotonic() - self._checked >= _POLL_S:
                self._checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone()
            try:
                return await asyncio.wait_for(self._q.get(), _POLL_S)
            except asyncio.TimeoutError:
                continue

    async def first_output(self, request: Request) -> tuple[int, Event]:
        """The first (choice index, event) past admission: a Delta, or a choice's end."""
        while True:
            i, ev = await self.get_or_gone(request)
            if not isinstance(ev, Admitted):
                return i, ev


class ServerState:
    """Everything one app instance knows: config, load status, engine, scheduler, metrics, keys."""

    def __init__(self, config: ServeConfig, load_engine: Callable[[], Engine],
                 on_fatal: Callable[[str], None] | None):
        self.config = config
        self._load_engine = load_engine
        self._on_fatal = on_fatal
        self.status = "loading"            # loading | ready | failed | stopping
        self.error: str | None = None
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics(lambda: self.scheduler.state() if self.scheduler else None,
                               lambda: self.engine.store.snapshot() if self.engine and self.engine.store else {},
                               lambda: self.engine.expert_stats() if self.engine else None,
                               lambda: self.engine.kv_stats() if self.engine else None)
        self.model_id = Path(config.model).stem if config.model.endswith(".gguf") else Path(config.model).name
        self.aliases = {config.model, self.model_id}
        self.created = int(time.time())
        self.fingerprint = ""
        # sha256(key) -> the tenant salt for that key (its hex digest: never the key itself)
        self._keys = {hashlib.sha256(k.encode()).digest(): hashlib.sha256(k.encode()).hexdigest()
                      for k in config.api_keys + config.admin_keys}
        self._admins = {hashlib.sha256(k.encode()).hexdigest() for k in config.admin_keys}
        # cache namespace -> the tenant whose request last used it: /slots shows a tenant its own slots
        # only (bounded: cache_salt makes namespaces a client can mint at will)
        self._owners: OrderedDict[bytes, str] = OrderedDict()

    # ---- lifecycle -----------------------------------------------------------------------------
    def load(self) -> None:
        """Background thread: load the model, start the scheduler. Never raises."""
        try:
            if self.config.threads:
                import torch
                torch.set_num_threads(self.config.threads)
            engine = self._load_engine()
            sched = Scheduler(engine, max_queue=self.config.max_queue, step_tokens=self.config.step_tokens,
                              on_done=self.metrics.observe)
            sched.start()
            src = getattr(getattr(engine, "loaded", None), "source", None)
            if src is not None:
                self.aliases |= {Path(src).name, Path(src).stem}
            self.fingerprint = "fp_" + hashlib.sha256(engine.model_namespace).hexdigest()[:10]
            self.engine, self.scheduler = engine, sched
            if self.status == "loading":
                self.status = "ready"
                log.info("serving %s: %d slots, context %d, prefix reuse %s, %s", self.model_id,
                         engine.num_slots, engine.ctx, "on" if engine.prefix_reuse else "off",
                         cache_line(engine))
            else:
                sched.close()
        except BaseException as e:  # noqa: BLE001 - reported through /health and the exit code
            if isinstance(e, (LookupError, OSError, ValueError)):   # unknown model, missing file, bad file
                log.error("loading the model failed: %s", e)
            else:
                log.exception("loading the model failed")
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            if self._on_fatal is not None:
                self._on_fatal(self.error)

    def begin_shutdown(self) -> None:
        """Signal-handler safe: schedule the drain on the event loop (never take locks in a handler)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        if self.status != "failed":
            self.status = "stopping"
        if self.scheduler is not None:
            self.scheduler.close(self.config.shutdown_grace_s)

    def stop(self) -> None:
        """Lifespan shutdown (blocking): cut whatever still runs and wait for the worker."""
        if self.status != "failed":
            self.status = "stopping"
        if self.scheduler is not None:
            self.scheduler.close(0.0)
            if self.scheduler.join(10.0) and self.engine is not None:
                self._persist()

    def _persist(self) -> None:
        """Write live slots and the RAM tier down to the disk tier (the worker has ended: no request
        touches the slots any more). Never raises: a failed save costs a recompute, not the exit."""
        try:
            t0 = time.perf_counter()
            n = self.engine.persist_cache()
            if n:
                log.info("kv cache: %d blocks on disk after shutdown (%.2f s)", n, time.perf_counter() - t0)
        except Exception:
            log.exception("writing the KV cache down at shutdown failed")

    # ---- per request ---------------------------------------------------------------------------
    def tenant(self, request: Request) -> str:
        """The caller's tenant salt ("" without --api-key). Raises 401 for a missing/unknown key."""
        if not self._keys:
            return ""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            token = request.headers.get("x-api-key", "").strip()   # Anthropic's clients send the key here
            if not token:
                raise unauthorized()
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, salt in self._keys.items():   # compare against all: no early exit to time
            if hmac.compare_digest(digest, known):
                found = salt
        if found is None:
            raise unauthorized("Incorrect API key provided")
        return found

    def ready(self) -> tuple[Engine, Scheduler]:
        if self.status == "ready" and self.engine is not None and self.scheduler is not None:
            return self.engine, self.scheduler
        if self.status == "loading":
            raise unavailable("the model is still loading; retry shortly", "model_loading")
        if self.status == "stopping":
            raise unavailable("the server is shutting down", "shutting_down")
        raise APIError(500, f"the model failed to load: {self.error}", type="server_error", code="load_failed")

    def check_model(self, name: str) -> None:
        if name not in self.aliases:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def salt(self, tenant: str, cache_salt: str | None) -> str:
        """The request's cache-namespace salt. Side effect: remembers which tenant owns the namespace."""
        # JSON keeps the two parts unambiguous: no (tenant, salt) pair can spell another's
        salt = json.dumps([tenant, cache_salt or ""])
        if self._keys and self.engine is not None:
            ns = self.engine.namespace(salt)
            self._owners[ns] = tenant
            self._owners.move_to_end(ns)
            while len(self._owners) > _MAX_OWNERS:
                self._owners.popitem(last=False)
        return salt

    def sees_slot(self, tenant: str, namespace: bytes) -> bool:
        """/slots scoping: without keys everything; an admin key everything; a key its own slots."""
        return (not self._keys or tenant in self._admins
                or bool(namespace) and self._owners.get(namespace) == tenant)


def cache_line(engine: Engine) -> str:
    """How the tiers below the slots are set up, for the startup log."""
    store = engine.store
    if store is None:
        return "no KV tiers"
    from ..sizes import format_size
    ram = f"RAM tier {format_size(store.ram.budget)}"
    r = store.redis
    shared = "" if r is None else f", redis tier {r.url} ({'up' if r.up else 'down: ' + str(r.down_reason)})"
    d = store.disk
    if d is None:
        return ram + ", no disk tier" + shared
    state = f" (writes off: {d.write_disabled})" if d.write_disabled else ""
    return (f"{ram}, disk tier {d.root} {format_size(d.used_bytes)} of {format_size(d.budget)} "
            f"in {d.blocks} blocks{state}{shared}")


async def read_json(request: Request, limit: int) -> Any:
    """The decoded JSON body. 413 past `limit` bytes (checked while reading), 400 if malformed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(buf, parse_constant=no_constants)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:   # the decoder's own limit (~1,000 levels): a 400, never a 500
        raise bad_request(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    if _depth(body) > MAX_JSON_DEPTH:   # what reads it later (validators, templates) recurses too
        raise bad_request(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    return body


MAX_JSON_DEPTH = 64      # no API here needs more (a tool's JSON schema is the deepest, ~10)


def _depth(obj: Any) -> int:
    """Nesting depth of decoded JSON, without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def failure(ev: Failed) -> APIError:
    """The HTTP error for a request that ended with an error inside the engine."""
    if ev.reason == "shutdown":
        return unavailable(str(ev.error), "shutting_down")
    if isinstance(ev.error, ValueError):      # context overflow, bad ids, bad sampling values
        return bad_request(str(ev.error), code="invalid_request")
    return APIError(500, f"generation failed: {type(ev.error).__name__}: {ev.error}", type="server_error",
                    code="engine_error")


@dataclass(frozen=True)
class Choice:
    """One choice of a response. leader: the index of the choice whose prompt KV this one forks
    (choices 1..n-1 of an n > 1 request fork choice 0), or None; a choice without a leader is the
    first of its prompt and its prompt tokens count in `usage`."""
    gen: GenRequest
    leader: int | None = None


async def serve_request(st: ServerState, request: Request, choices: list[Choice], shape: schemas.Shape, *,
                        stream: bool, include_usage: bool, want_logprobs: bool,
                        return_tokens: bool = False, dialect: Dialect = OPENAI) -> Response:
    """Queue the generations of one response (n choices, batched prompts: all or none) and answer
    them, as one JSON body or one stream whose chunks carry each choice's `index`, in `dialect`'s
    shapes (OpenAI's by default; dialect.py)."""
    include_usage = include_usage or dialect.wants_usage
    _, sched = st.ready()
    inbox = Inbox(st.loop)
    try:
        tickets = sched.submit_many([c.gen for c in choices],
                                    [functools.partial(_tag, inbox, i) for i in range(len(choices))],
                                    [c.leader for c in choices])
    except QueueFull as e:
        raise APIError(429, str(e), type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
    except ShuttingDown as e:
        raise unavailable(str(e), "shutting_down") from None
    counted = [c.leader is None for c in choices]
    handed_off = False   # once the SSE generator owns the tickets, it cancels them on its own exit
    try:
        i, ev = await inbox.first_output(request)
        if stream and isinstance(ev, (Delta, Finished)):
            handed_off = True
            return StreamingResponse(_sse_events(tickets, inbox, (i, ev), shape, include_usage, return_tokens,
                                                 counted, dialect),
                                     media_type=dialect.media_type,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        deltas: list[list[Delta]] = [[] for _ in choices]
        done: dict[int, Completion] = {}
        while True:
            if isinstance(ev, Delta):
                deltas[i].append(ev)
            elif isinstance(ev, Finished):
                done[i] = ev.completion
                if len(done) == len(choices):
                    return JSONResponse(dialect.response(shape.response([done[j] for j in range(len(choices))],
                                                                        deltas, want_logprobs, return_tokens,
                                                                        counted)))
            elif isinstance(ev, Failed):
                raise failure(ev)
            elif isinstance(ev, Cancelled):
                return Response(status_code=499)
            i, ev = await inbox.get_or_gone(request)
    except ClientGone:
        return Response(status_code=499)       # nginx's "client closed request"; nobody reads it
    finally:
        if not handed_off:
            for t in tickets:
                t.cancel()                     # no-op after the end; stops the rest if we left early


def _tag(inbox: "Inbox", index: int, event: Event) -> None:
    """A ticket's sink: its events reach the response's one inbox tagged with the choice index."""
    inbox.post((index, event))


async def _sse_events(tickets: list[Ticket], inbox: Inbox, first: tuple[int, Event], shape: schemas.Shape,
                      include_usage: bool, return_tokens: bool, counted: list[bool], dialect: Dialect = OPENAI):
    """The stream's body (SSE for OpenAI; each dialect's own framing). If the client disconnects, Starlette cancels this generator: `finally` cancels the
    tickets and the worker closes their engine streams within one step."""
    done: dict[int, Completion] = {}
    try:
        for j in range(len(tickets)):
            head = shape.first_chunk(j, include_usage)
            if head is not None:
                yield dialect.chunk(head)
        i, ev = first
        while True:
            if isinstance(ev, Delta):
                chunk = shape.delta_chunk(i, ev, include_usage)
                if chunk is not None:
                    yield dialect.chunk(chunk)
            elif isinstance(ev, Finished):
                done[i] = ev.completion
                for chunk in shape.before_final(i, ev.completion, include_usage):
                    yield dialect.chunk(chunk)
                yield dialect.chunk(shape.final_chunk(i, ev.completion, include_usage, return_tokens))
                if len(done) == len(tickets):
                    if include_usage:
                        yield dialect.chunk(shape.usage_chunk([done[j] for j in range(len(tickets))], counted))
                    yield dialect.done()
                    return
            elif isinstance(ev, Failed):
                yield dialect.error(failure(ev))   # OpenAI clients raise on an "error" event
                return
            elif isinstance(ev, Cancelled):
                return
            i, ev = await inbox.get()
    finally:
        for t in tickets:
            t.cancel()                           # no-op for the finished ones


def choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: seed + j, so choice j of a seeded n > 1 request answers as a lone request with
    seed + j would (wrapped into torch's seed range [-2**63, 2**64))."""
    if seed is None or j == 0:
        return seed
    return (seed + j) % (1 << 64) if seed >= 0 else seed + j


def thinking_mode(engine: Engine, ids: list[int], fmt: str) -> bool | None:
    """reasoning.py's split for this prompt: None (no split: format none, or a template that never
    thinks), else whether the prompt already opened `<think>` (DeepSeek-R1 style). Reads the prompt's
    last tokens only."""
    if fmt == "none" or not reasoning.template_thinks(engine.chat_template):
        return None
    return reasoning.prompt_opens_thinking(engine.tokenizer.decode(ids[-16:]))


def _default_loader(config: ServeConfig) -> Callable[[], Engine]:
    def load() -> Engine:
        cache = CacheConfig(config.cache_ram, Path(config.cache_dir) if config.cache_dir else None,
                            config.cache_disk, config.cache_redis, config.cache_redis_ttl, config.cache_redis_timeout)
        return Engine.load(config.model, dtype=config.dtype, weights=config.weights, kv_dtype=config.kv_dtype,
                           prefix_reuse=config.prefix_reuse,
                           min_reuse=config.min_reuse, slots=config.slots, ctx=config.ctx,
                           chunk_size=config.chunk_size, cache=cache, chat_template=config.chat_template,
                           expert_cache=config.expert_cache, draft_model=config.draft_model,
                           activations=config.activations, speculative=config.speculative,
                           state_interval=config.state_interval)
    return load


def create_app(config: ServeConfig, *, load_engine: Callable[[], Engine] | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """A new app. The engine is built by `load_engine` (default: Engine.load from the config) in a
    background thread at startup; `on_fatal(message)` runs there if that fails."""
    st = ServerState(config, load_engine or _default_loader(config), on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st.loop = asyncio.get_running_loop()
        threading.Thread(target=st.load, name="ternlm-load", daemon=True).start()
        yield
        await asyncio.to_thread(st.stop)

    app = FastAPI(title="ternlm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ternlm = st
    install_handlers(app)
    app.add_middleware(StatusCounter, metrics=st.metrics, endpoints=ENDPOINTS)
    if config.cors_origins:
        # Outermost, so preflights are answered and every response (errors and SSE streams too) carries
        # the headers. No credentials mode: the API authenticates by an Authorization header the page
        # must hold itself, never by cookies, so "*" lends a page nothing it did not already have.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_credentials=False,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
                           max_age=600)
    _routes(app, st)
    mount_ui(app)
    return app


def _routes(app: FastAPI, st: ServerState) -> None:
    cfg = st.config

    def check_ids(engine: Engine, ids: list[int], param: str) -> None:
        vocab = min(engine.config.vocab_size, engine.tokenizer.vocab_size)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {ids[bad]} at position {bad} is outside the vocabulary "
                              f"[0, {vocab})", param, "invalid_token_id")

    def checked_bias(engine: Engine, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """logit_bias ({"token id": bias}, validated by the schema) as GenParams takes it; 400 for a token
        outside the vocabulary."""
        pairs = tuple(sorted((int(k), float(b)) for k, b in (bias or {}).items()))
        check_ids(engine, [t for t, _ in pairs], "logit_bias")
        return pairs

    async def check_grammar(engine: Engine, grammar: GrammarSpec | None, param: str = "response_format") -> None:
        if grammar is None:
            return
        try:   # builds the grammar tokenizer once (~0.2 s), then milliseconds: off the event loop
            await asyncio.to_thread(engine.grammars.check, grammar)
        except ValueError as e:
            raise bad_request(f"Invalid '{param}': {e}", param, "invalid_value") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, cfg.max_body_bytes)
        return await run_chat(request, raw, tenant)

    async def run_chat(request: Request, raw: Any, tenant: str, dialect: Dialect = OPENAI) -> Response:
        """A Chat Completions request (the decoded JSON body, validated here) answered in `dialect`:
        the one path every chat-shaped API takes (dialect.py)."""
        engine, _ = st.ready()
        req: schemas.ChatRequest = schemas.parse(schemas.ChatRequest, raw)
        st.check_model(req.model)
        await check_grammar(engine, req.response_format)
        # tools: through the template's own `tools` where it has them, else the documented fallback
        messages, extra = tools.prepare([m.for_template() for m in req.messages], req.tool_dicts,
                                        tools.supports_tools(engine.chat_template))
        extra = {**req.template_vars, **extra}      # chat_template_kwargs, reasoning_effort
        grammar = req.response_format
        forced, only = req.forced
        if forced:   # the answer must be calls: constrained (tools.call_grammar)
            grammar = tools.call_grammar(req.tool_dicts, only, req.parallel_tool_calls, engine.tokenizer)
            await check_grammar(engine, grammar, "tools")
        try:   # template + tokenizer reads only: safe beside the worker, kept off the event loop
            ids = await asyncio.to_thread(engine.apply_chat_template, messages, add_generation_prompt=True,
                                          **extra)
        except ValueError as e:  # ChatTemplateError (e.g. raise_exception: roles must alternate), no template
            raise bad_request(f"the chat template rejected the messages: {e}", "messages",
                              "invalid_messages") from None
        n, ctx = len(ids), engine.ctx
        max_new = req.max_new if req.max_new is not None else ctx - n   # OpenAI: up to the context
        if n + max(max_new, 1) > ctx:
            raise schemas.too_long(n, max(max_new, 1), ctx, "messages")
        salt = st.salt(tenant, req.cache_salt)
        bias, spec = checked_bias(engine, req.logit_bias), None if req.speculative else False   # None: --speculative
        choices = [Choice(GenRequest(ids, GenParams(max_new, req.temperature, req.top_k, req.top_p, req.min_p,
                                                    choice_seed(req.seed, j), tuple(req.stop), req.logprobs_k,
                                                    grammar, bias, spec, req.penalties), salt,
                                         None if j else req.affinity),
                          leader=0 if j else None) for j in range(req.n)]   # the pin follows choice 0
        shape = schemas.ChatShape(st.model_id, st.fingerprint, engine.tokenizer, tools=req.calling,
                                  thinking=thinking_mode(engine, ids, req.reasoning_format or cfg.reasoning_format))
        return await serve_request(st, request, choices, shape, stream=req.stream,
                                   include_usage=req.include_usage, want_logprobs=req.logprobs, dialect=dialect)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, cfg.max_body_bytes)
        return await run_completion(request, raw, tenant)

    async def run_completion(request: Request, raw: Any, tenant: str, dialect: Dialect = OPENAI) -> Response:
        """A (legacy) Completions request answered in `dialect` (raw prompts: no template)."""
        engine, _ = st.ready()
        req: schemas.CompletionRequest = schemas.parse(schemas.CompletionRequest, raw)
        st.check_model(req.model)
        await check_grammar(engine, req.response_format)
        prompts = []
        for p, prompt in enumerate(req.prompt):
            where = "prompt" if len(req.prompt) == 1 else f"prompt[{p}]"
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(engine.tokenizer.encode, prompt)
                if not ids:
                    raise bad_request(f"{where} tokenizes to no tokens", "prompt", "invalid_value")
            else:
                ids = list(prompt)
                check_ids(engine, ids, "prompt")
            if len(ids) + req.max_tokens > engine.ctx:
                raise schemas.too_long(len(ids), req.max_tokens, engine.ctx, "prompt")
            prompts.append(ids)
        salt = st.salt(tenant, req.cache_salt)
        bias, spec = checked_bias(engine, req.logit_bias), None if req.speculative else False   # None: --speculative
        # choice index = prompt * n + j, as OpenAI numbers them; choice j > 0 forks choice 0's prompt KV
        choices = [Choice(GenRequest(ids, GenParams(req.max_tokens, req.temperature, req.top_k, req.top_p,
                                                    req.min_p, choice_seed(req.seed, j), tuple(req.stop),
                                                    req.logprobs, req.response_format, bias, spec,
                                                    req.penalties), salt,
                                         req.affinity if p == j == 0 else None),
                          leader=p * req.n if j else None)
                   for p, ids in enumerate(prompts) for j in range(req.n)]
        shape = schemas.TextShape(st.model_id, st.fingerprint, engine.tokenizer)
        return await serve_request(st, request, choices, shape, stream=req.stream, include_usage=req.include_usage,
                                   want_logprobs=req.logprobs is not None, return_tokens=req.return_tokens,
                                   dialect=dialect)

    def model_card() -> dict:
        eng = st.engine
        meta = {"dtype": eng.dtype_choice.dtype if eng is not None else cfg.dtype,
                "kernel": eng.dtype_choice.kernel if eng is not None else None, "prefix_reuse": cfg.prefix_reuse,
                "weights": eng.weights_choice.mode if eng is not None else cfg.weights,
                "kv_dtype": eng.kv_dtype if eng is not None else cfg.kv_dtype,
                "kv_bytes_per_token": eng.kv_stats()["bytes_per_token"] if eng is not None else None,
                "slots": cfg.slots,
                "ctx": eng.ctx if eng is not None else cfg.ctx}
        return {"id": st.model_id, "object": "model", "created": st.created, "owned_by": "ternlm", "meta": meta}

    # the other client APIs, each a dialect of the same chat path (dialect.py)
    anthropic.add_routes(app, st, run_chat, read_json)
    ollama.add_routes(app, st, run_chat, run_completion, read_json)
    responses.add_routes(app, st, run_chat, read_json)

    @app.get("/v1/models")
    async def models(request: Request):
        st.tenant(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        st.tenant(request)
        st.check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
        if st.status == "ready":
            return {"status": "ok", "model": st.model_id}
        if st.status == "failed":
            return JSONResponse({"status": "error", "error": st.error}, status_code=500)
        return JSONResponse({"status": st.status}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/slots")
    async def slots(request: Request):
        """Slots the caller may see (its own tenant's; all with an admin key or without keys)."""
        tenant = st.tenant(request)
        _, sched = st.ready()
        s = sched.state()
        wall, mono = time.time(), time.monotonic()
        return {"queued": s.queued, "busy": s.busy, "idle": s.idle, "slots": [
            {"index": x.index, "busy": x.busy, "tokens": x.tokens,
             "last_used": round(wall - (mono - x.last_used), 3) if x.last_used else None,
             # a short hash of the namespace: tells slots apart, reveals no key, salt or text
             "namespace": hashlib.sha256(x.namespace).hexdigest()[:12] if x.namespace else None}
            for x in s.slots if st.sees_slot(tenant, x.namespace)]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        st.tenant(request)
        raw = await read_json(request, cfg.max_body_bytes)
        engine, _ = st.ready()
        req: schemas.TokenizeRequest = schemas.parse(schemas.TokenizeRequest, raw)
        ids = await asyncio.to_thread(engine.tokenizer.encode, req.content, add_special_tokens=req.add_special)
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        st.tenant(request)
        raw = await read_json(request, cfg.max_body_bytes)
        engine, _ = st.ready()
        req: schemas.DetokenizeRequest = schemas.parse(schemas.DetokenizeRequest, raw)
        check_ids(engine, req.tokens, "tokens")
        return {"content": engine.tokenizer.decode(req.tokens)}
