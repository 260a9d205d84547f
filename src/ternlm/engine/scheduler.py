"""Scheduler: one worker thread owns the engine; requests wait FIFO for a slot; every step batches
all running requests into one forward pass (continuous batching).

Why this shape:
- The engine is not thread-safe and its work is CPU-bound torch calls, so exactly one thread (the
  worker) ever touches slots or calls the model. Other threads talk to it only through `submit` (a
  lock-guarded FIFO) and `Ticket.cancel` (a flag); results leave through each request's `sink`.
- One round (`run_once`) = admit, drop the cancelled, then ONE engine step: every decoding request
  feeds its next token and prefilling requests feed chunks of their prompt within `step_tokens`
  (step_plan.plan_step, pure). Linears run once over all those rows, so eight streams cost little
  more than one, and a 4,000-token cold prompt advances a chunk per step beside the decodes instead
  of freezing them. A request's bits do not depend on its neighbours ([BATCH-INVARIANT]).
- Slot choice is the engine's (longest common prefix in the request's namespace) over the FREE slots,
  with refinements: a prefix the engine would not reuse (below min_reuse, other namespace) is a
  miss, and a miss takes the least recently used free slot instead of evicting a warm one for nothing;
  a `prompt_cache_key` pins a conversation to the slot it used last while that slot is free and
  still holds that conversation (a pinned slot taken over by another conversation is not evicted
  for a prompt that shares nothing with it either).
- Cancellation is a flag checked before every step (a step feeds at most one chunk per request), so
  a request ends after the step it was in, with its slot's record exact.
- Errors inside one request (context overflow, bad sampling parameters, a failing hook) end that
  request with a `Failed` event; the others in the batch go on; the worker itself never dies of them.
"""
from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from .core import Completion, Delta, Engine, Sequence
from ..text.grammar import GrammarSpec
from .sampling import Penalties
from ..invariants import check
from .step_plan import plan_step

log = logging.getLogger("ternlm.engine.scheduler")

MAX_LOGPROBS = 20


# ---- what a request asks for ------------------------------------------------------------------

@dataclass(frozen=True)
class GenParams:
    """Sampling and stopping for one request (validated here; the HTTP layer validates first, with
    friendlier messages)."""
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # None: none; k >= 0: the sampled token's logprob + top k
    grammar: GrammarSpec | None = None   # structured output: every sampled token must fit it
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit) on every choice
    speculative: bool | None = None  # draft and verify (lossless); None: the engine's default
    penalties: Penalties = Penalties()   # repetition / frequency / presence and their scope (sampling.py)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")


@dataclass(frozen=True)
class GenRequest:
    prompt: list[int]                # token ids (an engine ChatIds keeps its divergence diagnostics)
    params: GenParams = field(default_factory=GenParams)
    salt: str = ""                   # cache-namespace salt (tenant + cache_salt); engine.stream's cache_salt
    affinity: str | None = None      # prompt_cache_key: prefer the slot this key used last


# ---- what comes back (posted to the request's sink, in order) ---------------------------------

@dataclass(frozen=True)
class Admitted:
    """The request got a slot; generation starts with its next step."""
    slot: int
    queued_s: float


@dataclass(frozen=True)
class Finished:
    """Terminal: the engine's Completion. `slot_reset`: the slot held KV that this request discarded."""
    completion: Completion
    queued_s: float
    slot_reset: bool


@dataclass(frozen=True)
class Failed:
    """Terminal: the request ended with an error. reason: "error" (inside the request) | "shutdown"."""
    error: BaseException
    reason: str


@dataclass(frozen=True)
class Cancelled:
    """Terminal: the request was cancelled (client gone). where: "queued" | "running"."""
    where: str


Event = Admitted | Delta | Finished | Failed | Cancelled
Sink = Callable[[Event], None]       # called on the worker thread; must be quick and must not block
TERMINAL = (Finished, Failed, Cancelled)


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows. retry_after_s: a rough wait estimate."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are already waiting for a slot; try again later")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    """The server is shutting down and takes no more work."""


class Ticket:
    """A submitted request. `cancel()` is thread-safe; the worker acts on it within one step.
    `leader`: for choice i > 0 of an n > 1 request, choice 0's ticket: this one waits until the
    leader's prompt is prefilled, then forks its KV instead of prefilling the same prompt again."""

    def __init__(self, ident: int, request: GenRequest, sink: Sink, submitted: float,
                 leader: "Ticket | None" = None):
        self.id = ident
        self.request = request
        self.sink = sink
        self.submitted = submitted
        self.leader = leader
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class _Running:
    ticket: Ticket
    slot: int
    held: int                        # tokens the slot's record held at admission (for slot_reset)
    queued_s: float
    started: float
    seq: Sequence | None = None      # opened on the worker right after admission


@dataclass(frozen=True)
class SlotState:
    index: int
    busy: bool
    tokens: int                      # positions the slot's KV holds (len of its record)
    last_used: float                 # time.monotonic() of its last use; 0.0 = never
    namespace: bytes


@dataclass(frozen=True)
class SchedulerState:
    queued: int
    busy: int
    idle: int
    slots: list[SlotState]


class Scheduler:
    """Owns the engine from `start()` on. Use `submit` from any thread; everything else about the
    engine happens on the worker thread (or in `run_once`, which tests call directly instead of
    starting the thread)."""

    def __init__(self, engine: Engine, *, max_queue: int = 64, affinity_size: int = 4096,
                 step_tokens: int = 16, on_done: Callable[[Ticket, Event], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """step_tokens: rows one step may feed while some request decodes (decodes + prefill chunks);
        smaller keeps running streams smooth while a long prompt prefills, larger prefills faster."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.engine = engine
        self.max_queue = max_queue
        self.step_tokens = step_tokens
        self.on_done = on_done           # observer of terminal events (metrics); worker thread
        self._clock = clock
        self._cv = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self._running: list[_Running] = []
        self._busy: set[int] = set()
        # (salt, prompt_cache_key) -> slot index it used last; bounded, oldest forgotten first
        self._affinity: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._affinity_size = affinity_size
        self._owner: dict[int, tuple[str, str] | None] = {}   # slot -> key of the request that ran there last
        self._ids = itertools.count(1)
        self._closing = False
        self._deadline: float | None = None   # when closing: active requests are cut at this time
        self._service_s = 1.0                 # moving average of request service time (Retry-After)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the worker thread (daemon: a hung model call never blocks interpreter exit)."""
        if self._thread is not None:
            raise RuntimeError("scheduler already started")
        self._thread = threading.Thread(target=self._loop, name="ternlm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest, sink: Sink) -> Ticket:
        """Queue a request. Raises QueueFull when more than max_queue requests would be waiting
        beyond the free slots, ShuttingDown after close(). Events go to `sink` on the worker thread."""
        return self.submit_many([request], [sink])[0]

    def submit_many(self, requests: list[GenRequest], sinks: list[Sink],
                    leaders: list[int | None] | None = None) -> list[Ticket]:
        """Queue several requests at once, in order, all or none (QueueFull, ShuttingDown as submit).
        leaders[i]: index (< i) of the request whose prompt request i shares and forks from (n > 1
        choices), or None. Events of request i go to sinks[i]."""
        leaders = leaders or [None] * len(requests)
        check(len(sinks) == len(requests) == len(leaders)
              and all(j is None or 0 <= j < i for i, j in enumerate(leaders)), "submit_many: bad arguments")
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            free = self.engine.num_slots - len(self._busy)
            if len(self._queue) + len(requests) > self.max_queue + max(free, 0):
                raise QueueFull(len(self._queue), self._retry_after())
            now, tickets = self._clock(), []
            for r, sink, j in zip(requests, sinks, leaders):
                tickets.append(Ticket(next(self._ids), r, sink, now, tickets[j] if j is not None else None))
            self._queue.extend(tickets)
            self._cv.notify()
        return tickets

    def close(self, grace_s: float = 0.0) -> None:
        """Stop taking work. Waiting requests fail now (ShuttingDown); running ones get `grace_s`
        to finish, then are cut with ShuttingDown. Non-blocking; see join()."""
        with self._cv:
            if not self._closing:
                self._closing = True
                self._deadline = self._clock() + grace_s
            self._cv.notify()
        if self._thread is None:
            self._fail_queued()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to end (after close()). Returns True when it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def state(self) -> SchedulerState:
        """A snapshot for /slots and the gauges (engine.slot_info: single attribute reads, good
        enough for reporting without the worker's help)."""
        with self._cv:
            busy = set(self._busy)
            queued = len(self._queue)
        slots = [SlotState(s.index, s.index in busy, s.tokens, s.last_used, s.namespace)
                 for s in self.engine.slot_info()]
        return SchedulerState(queued, len(busy), len(slots) - len(busy), slots)

    # ---- slot choice (pure: reads slots, modifies nothing) --------------------------------------
    def choose_slot(self, request: GenRequest, free: list[int]) -> int:
        """The free slot this request should run in: its pinned slot (prompt_cache_key) unless another
        free slot offers more reusable prefix, or the pinned slot now holds another conversation and
        offers nothing; else the longest usable prefix; else the LRU slot."""
        eng = self.engine
        ns = eng.namespace(request.salt)
        best = eng.pick_slot(request.prompt, ns, among=free)
        if request.affinity is not None:
            key = (request.salt, request.affinity)
            pin = self._affinity.get(key)
            if pin in free:
                usable = eng.usable_prefix(pin, request.prompt, ns)
                ours = self._owner.get(pin) == key      # nobody else ran there since
                if usable >= eng.usable_prefix(best, request.prompt, ns) and (usable > 0 or ours):
                    return pin
        return best

    # ---- worker thread -------------------------------------------------------------------------
    def run_once(self) -> bool:
        """One scheduling round: admit waiting requests into free slots, end the cancelled ones, then
        one engine step over every running request (one forward pass). Returns whether anything is
        left to do."""
        self._admit()
        for run in list(self._running):
            if run.ticket.cancelled:
                self._end(run, Cancelled("running"))
            elif self._past_deadline():
                self._end(run, Failed(ShuttingDown("the server shut down mid-request"), "shutdown"))
        self._step()
        with self._cv:
            return bool(self._queue or self._running)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._running or self._closing):
                    self._cv.wait()
                closing = self._closing
            if closing:
                self._fail_queued()
                if self._deadline is not None and self._clock() >= self._deadline:
                    for run in list(self._running):
                        self._end(run, Failed(ShuttingDown("the server shut down mid-request"), "shutdown"))
                with self._cv:
                    if not self._running:
                        return
            try:
                self.run_once()
            except Exception:  # a bug in the scheduler itself: log it, keep serving the others
                log.exception("scheduler round failed")

    def _admit(self) -> None:
        started: list[_Running] = []
        dropped: list[Ticket] = []
        with self._cv:
            if self._closing:
                return
            for t in [t for t in self._queue if t.cancelled]:
                self._queue.remove(t)
                dropped.append(t)
            info = {s.index: s for s in self.engine.slot_info()} if self._queue else {}
            while self._queue and len(self._busy) < self.engine.num_slots:
                if self._waits_for_leader(self._queue[0]):
                    break                    # FIFO: the head forks its leader's prompt once prefilled
                ticket = self._queue.popleft()
                free = [i for i in info if i not in self._busy]
                slot = self.choose_slot(ticket.request, free)
                self._busy.add(slot)
                key = None
                if ticket.request.affinity is not None:
                    key = (ticket.request.salt, ticket.request.affinity)
                    self._affinity[key] = slot
                    self._affinity.move_to_end(key)
                    while len(self._affinity) > self._affinity_size:
                        self._affinity.popitem(last=False)
                self._owner[slot] = key
                now = self._clock()
                run = _Running(ticket, slot, info[slot].tokens, now - ticket.submitted, now)
                self._running.append(run)
                started.append(run)
        for t in dropped:
            self._done(t, Cancelled("queued"))
        for run in started:
            self._post(run.ticket, Admitted(run.slot, run.queued_s))
            self._open(run)

    def _leader_run(self, ticket: Ticket) -> _Running | None:
        lead = ticket.leader
        return next((r for r in self._running if r.ticket is lead), None) if lead is not None else None

    def _waits_for_leader(self, ticket: Ticket) -> bool:
        """A follower waits while its leader runs and has not finished prefilling the shared prompt
        (a leader that ended, or never ran, leaves it to an ordinary open: prefix reuse still applies)."""
        run = self._leader_run(ticket)
        return run is not None and (run.seq is None or (run.seq.prefilling and not run.seq.done))

    def _open(self, run: _Running) -> None:
        """Validate and place the request (engine.open); a bad request ends here with Failed.
        A follower forks the KV of its leader's slot (engine.open's fork_from)."""
        p, r = run.ticket.request.params, run.ticket.request
        lead = self._leader_run(run.ticket)
        fork = lead.slot if lead is not None and lead.seq is not None else None
        try:
            run.seq = self.engine.open(r.prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                       top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
                                       stop=list(p.stop) or None, cache_salt=r.salt, slot=run.slot,
                                       logprobs=p.logprobs, grammar=p.grammar, fork_from=fork,
                                       logit_bias=dict(p.logit_bias), speculative=p.speculative,
                                       penalties=p.penalties)
        except Exception as e:  # one request's error (e.g. context overflow) ends that request only
            log.warning("request %d failed: %s", run.ticket.id, e)
            self._end(run, Failed(e, "error"))

    def _step(self) -> None:
        """One engine step over every running request, then each one's events to its sink."""
        runs = [r for r in self._running if r.seq is not None and not r.seq.done]
        if not runs:
            return
        counts = plan_step([self.engine.want(r.seq) for r in runs], self.step_tokens, self.engine.chunk_size)
        chosen = [(r, c) for r, c in zip(runs, counts) if c > 0]
        outcomes = self.engine.step([(r.seq, c) for r, c in chosen])
        for (run, _), out in zip(chosen, outcomes):
            if out.error is not None:
                log.warning("request %d failed: %s", run.ticket.id, out.error)
                self._end(run, Failed(out.error, "error"))
                continue
            for ev in out.events:
                if isinstance(ev, Completion):
                    elapsed = self._clock() - run.started
                    self._service_s = 0.8 * self._service_s + 0.2 * elapsed
                    self._end(run, Finished(ev, run.queued_s, slot_reset=run.held > 0 and ev.cached_tokens == 0))
                else:
                    self._post(run.ticket, ev)

    def _end(self, run: _Running, event: Event) -> None:
        """Close the request (its slot's record is already exact), free the slot, post the last event."""
        if run.seq is not None:
            run.seq.close()
        with self._cv:
            self._busy.discard(run.slot)
            if run in self._running:
                self._running.remove(run)
        self._done(run.ticket, event)

    def _fail_queued(self) -> None:
        with self._cv:
            waiting = list(self._queue)
            self._queue.clear()
        for t in waiting:
            self._done(t, Failed(ShuttingDown("the server is shutting down"), "shutdown"))

    def _past_deadline(self) -> bool:
        return self._deadline is not None and self._clock() >= self._deadline

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: a rough estimate, clamped to [1, 60]."""
        rounds = (len(self._queue) + 1) / max(self.engine.num_slots, 1)
        return int(min(60, max(1, math.ceil(self._service_s * rounds))))

    def _done(self, ticket: Ticket, event: Event) -> None:
        self._post(ticket, event)
        if self.on_done is not None:
            try:
                self.on_done(ticket, event)
            except Exception:
                log.exception("on_done observer failed")

    def _post(self, ticket: Ticket, event: Event) -> None:
        try:
            ticket.sink(event)
        except Exception:  # a broken consumer must not stop the worker; treat it as gone
            log.exception("sink of request %d failed; cancelling it", ticket.id)
            ticket.cancel()
