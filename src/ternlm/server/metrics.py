"""Prometheus metrics for one app instance, in its own CollectorRegistry (no process-global registry:
two apps in one process, e.g. in tests, never share or double-register counters).

What is measured and where:
- request counts by endpoint and HTTP status: an ASGI middleware that sees every response start
  (streams included; 499 = the client went away before the answer);
- tokens, reuse, timings, slot resets, cancellations: the scheduler's terminal events, observed on
  the worker thread (prometheus_client is thread-safe), so a request counts even if its client left;
- queue length and busy/idle slots: gauges that read the scheduler's state at scrape time;
- KV tiers (RAM, disk, Redis): hits, misses, bytes, evictions, load seconds, damaged files: a collector that
  reads the store's counters at scrape time (the store counts on the worker thread; a scrape may see
  a value one block old, never a torn one: each is one int/float attribute);
- mixture-of-experts store (issue 36): hits, misses, bytes read from the model file, evictions, and
  the cache's bytes and budget: a collector over Engine.expert_stats() at scrape time (absent for a
  dense model).
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.scheduler import Cancelled, Event, Failed, Finished, SchedulerState, Ticket

CONTENT_TYPE = CONTENT_TYPE_LATEST
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_RATIO = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


# (snapshot field, metric suffix, help, is_counter)
_TIER_FIELDS = [("hits", "hits", "blocks found in the tier", True),
                ("misses", "misses", "blocks looked for and not found in the tier", True),
                ("evictions", "evictions", "blocks dropped from the tier to stay within its budget", True),
                ("load_seconds", "load_seconds", "seconds spent reading (and verifying) hits", True),
                ("damaged", "damaged", "block files found damaged or foreign, deleted and recomputed", True),
                ("writes", "writes", "block files written", True),
                ("write_errors", "write_errors", "block writes that failed", True),
                ("bytes", "bytes", "bytes of KV blocks held now", False),
                ("budget_bytes", "budget_bytes", "byte budget of the tier", False),
                ("blocks", "blocks", "KV blocks held now (tail entries included)", False),
                ("tails", "tail_entries", "tail entries (a conversation's last partial block) held now", False),
                ("write_disabled", "writes_disabled", "1 when writes are off (e.g. disk full)", False),
                ("outages", "outages", "times the tier turned itself off after an error (redis)", True),
                ("write_dropped", "write_dropped", "blocks not written because the write queue was full", True),
                ("up", "up", "1 while the tier is reachable and used, 0 while off and reconnecting (redis)", False)]


class TierCollector:
    """Exports the store's per-tier counters at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, dict[str, float]]]):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot() or {}
        for field, suffix, doc, counter in _TIER_FIELDS:
            name = f"ternlm_kv_tier_{suffix}"
            fam = CounterMetricFamily(name, doc, labels=["tier"]) if counter else \
                GaugeMetricFamily(name, doc, labels=["tier"])
            for tier in ("ram", "disk", "redis"):
                if field in snap.get(tier, {}):
                    fam.add_metric([tier], float(snap[tier][field]))
            yield fam


# (Engine.expert_stats key, metric name, help, is_counter)
_EXPERT_FIELDS = [("hits", "ternlm_expert_cache_hits", "expert fetches served from memory", True),
                  ("misses", "ternlm_expert_cache_misses", "expert fetches that read the expert from the file", True),
                  ("bytes_read", "ternlm_expert_cache_bytes_read", "bytes of expert weights read from the file", True),
                  ("evictions", "ternlm_expert_cache_evictions", "experts dropped to stay within the budget", True),
                  ("resident_bytes", "ternlm_expert_cache_bytes", "bytes of converted experts held now", False),
                  ("budget", "ternlm_expert_cache_budget_bytes", "the expert cache's byte budget (streamed only)", False)]


class ExpertCollector:
    """Exports a mixture of experts' store counters at scrape time; nothing for a dense model."""

    def __init__(self, snapshot: Callable[[], dict | None]):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        if not snap:
            return
        for key, name, doc, counter in _EXPERT_FIELDS:
            if snap.get(key) is None:
                continue
            fam = CounterMetricFamily(name, doc) if counter else GaugeMetricFamily(name, doc)
            fam.add_metric([], float(snap[key]))
            yield fam


class SlotKVCollector:
    """The slots' KV at scrape time: its format and bytes a token (labelled by format), and the bytes the
    slots' caches hold now; nothing while the model loads."""

    def __init__(self, snapshot: Callable[[], dict | None]):
        self.snapshot = snapshot

    def collect(self):
        snap = self.snapshot()
        if not snap:
            return
        per = GaugeMetricFamily("ternlm_kv_bytes_per_token", "bytes of K and V a token takes in a slot (and in "
                                "every tier), by KV format (--kv-dtype)", labels=["kv_dtype"])
        per.add_metric([snap["kv_dtype"]], float(snap["bytes_per_token"]))
        yield per
        held = GaugeMetricFamily("ternlm_kv_slot_bytes", "bytes the slots' K and V caches hold now (allocated)")
        held.add_metric([], float(snap["slot_bytes"]))
        yield held


class Metrics:
    def __init__(self, state: Callable[[], SchedulerState | None],
                 cache: Callable[[], dict[str, dict[str, float]]] = dict,
                 experts: Callable[[], dict | None] = lambda: None,
                 kv: Callable[[], dict | None] = lambda: None):
        """state: the scheduler's snapshot, or None while the model loads. cache: the KV store's
        per-tier snapshot ({} without tiers). experts: Engine.expert_stats (None: dense or loading).
        kv: Engine.kv_stats (None while loading)."""
        self.registry = r = CollectorRegistry()
        r.register(TierCollector(cache))
        r.register(ExpertCollector(experts))
        r.register(SlotKVCollector(kv))
        self.reused_by_tier = Counter("ternlm_reused_tokens_by_tier",
                                      "prompt tokens reused, by where they came from", ["tier"], registry=r)
        for tier in ("slot", "ram", "disk", "redis"):
            self.reused_by_tier.labels(tier)
        self.requests = Counter("ternlm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ternlm_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.reused_tokens = Counter("ternlm_reused_tokens",
                                     "prompt tokens served from reused KV (cached_tokens)", registry=r)
        self.completion_tokens = Counter("ternlm_completion_tokens", "generated tokens", registry=r)
        self.drafted_tokens = Counter("ternlm_spec_drafted_tokens",
                                      "speculative decoding: drafted tokens verified", registry=r)
        self.accepted_tokens = Counter("ternlm_spec_accepted_tokens",
                                       "speculative decoding: drafted tokens the model produced itself (kept)",
                                       registry=r)
        self.draft_failures = Counter("ternlm_spec_draft_failures",
                                      "speculative decoding: requests whose drafter failed (a draft model's error); "
                                      "they went on without drafts, same answer", registry=r)
        self.reuse_ratio = Histogram("ternlm_reuse_ratio", "per request: cached_tokens / prompt_tokens",
                                     buckets=_RATIO, registry=r)
        self.prefill_seconds = Histogram("ternlm_prefill_seconds", "prefill time per request",
                                         buckets=_SECONDS, registry=r)
        self.decode_seconds = Histogram("ternlm_decode_seconds", "decode time per request",
                                        buckets=_SECONDS, registry=r)
        self.ttft_seconds = Histogram("ternlm_time_to_first_token_seconds",
                                      "queue wait + prefill until the first sampled token", buckets=_SECONDS,
                                      registry=r)
        self.queue_seconds = Histogram("ternlm_queue_wait_seconds", "time waiting for a slot",
                                       buckets=_SECONDS, registry=r)
        self.slot_resets = Counter("ternlm_slot_resets", "requests that discarded a slot's whole KV",
                                   registry=r)
        self.cancelled = Counter("ternlm_cancelled_requests", "requests cancelled (client gone)",
                                 ["where"], registry=r)
        self.failed = Counter("ternlm_failed_requests", "requests ended by an error", ["reason"], registry=r)
        for where in ("queued", "running"):   # export zeros from the start: rate() needs a baseline
            self.cancelled.labels(where)
        for reason in ("error", "shutdown"):
            self.failed.labels(reason)

        def read(attr: str) -> Callable[[], float]:
            def value() -> float:
                s = state()
                return float(getattr(s, attr)) if s is not None else 0.0
            return value

        Gauge("ternlm_queue_length", "requests waiting for a slot", registry=r).set_function(read("queued"))
        Gauge("ternlm_slots_busy", "slots running a request", registry=r).set_function(read("busy"))
        Gauge("ternlm_slots_idle", "slots free", registry=r).set_function(read("idle"))

    def observe(self, ticket: Ticket, event: Event) -> None:
        """Scheduler on_done hook (worker thread): account one request's terminal event."""
        if isinstance(event, Finished):
            c = event.completion
            t = c.timings
            self.prompt_tokens.inc(c.prompt_tokens)
            self.reused_tokens.inc(c.cached_tokens)
            for tier in ("slot", "ram", "disk", "redis"):
                n = getattr(c.restored, tier)
                if n:
                    self.reused_by_tier.labels(tier).inc(n)
            self.completion_tokens.inc(len(c.token_ids))
            self.drafted_tokens.inc(t.drafted)
            self.accepted_tokens.inc(t.accepted)
            if t.draft_failed:
                self.draft_failures.inc()
            self.reuse_ratio.observe(c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0)
            self.prefill_seconds.observe(t.prefill_s)
            self.decode_seconds.observe(t.decode_s)
            self.ttft_seconds.observe(event.queued_s + t.ttft_s)
            self.queue_seconds.observe(event.queued_s)
            if event.slot_reset:
                self.slot_resets.inc()
        elif isinstance(event, Cancelled):
            self.cancelled.labels(event.where).inc()
        elif isinstance(event, Failed):
            self.failed.labels(event.reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware: count each HTTP response by (endpoint, status). Unknown paths share one label
    so a scanner cannot blow up the label set."""

    def __init__(self, app, metrics: Metrics, endpoints: frozenset[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        counted = False

        async def counting_send(message):
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not counted:   # the outer error middleware will answer 500 outside this middleware
                self.metrics.requests.labels(endpoint, "500").inc()
            raise
