"""The soak's client side: many conversations driven at once by asyncio over HTTP, each turn streamed.

A conversation behaves like a chat client: it resends the whole transcript every turn (the server's
answers included) and starts over with a new conversation after its last turn. What each request
carries beside the transcript (sampling fields, a seed, a json_schema response_format) is the mix's
(soak_mix.py). Each request is timed from the client (time to first content chunk, gaps between
content chunks) and its `usage` and `timings` are kept, so reuse and the tier that served it are known
per request.

Counting rules (the soak's targets rest on them; `Outcomes` holds the counts):
- back-pressure: a 429 whose Retry-After we honour (sleep, then resend the same request). Not a failure.
- retried during restart: a connection error, a stream cut short or a 503 while the planned restart is
  under way (or for a request sent to the server that was killed): backoff, then resend. Not a failure.
- failed: everything else that does not end in a complete answer (any other status, an error event,
  a connection error outside the restart, a stream without usage). The conversation is then abandoned
  (its transcript would lack an answer) and the worker starts a new one.
- a json turn's answer that does not parse and validate is a failure too; it is still an answer, so the
  conversation goes on with it (as a client would show it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx2 as httpx

from .common import synthetic_text
from .multiturn import Conversation, load_conversations, synthetic_conversations
from .soak_mix import Mix, json_problem, mix_named

GIVE_UP_S = 300.0      # a request still retrying after this long counts as failed (the restart hung)


class ConversationSource:
    """Endless conversations: synthetic conversation k is seeded by (seed, k), so a run is reproducible
    and no two conversations share text; a file's conversations are cycled (ids get a #round suffix)."""

    def __init__(self, *, path: Path | None, turns: int, system_words: int, user_words: int, seed: int):
        self.turns, self.system_words, self.user_words, self.seed = turns, system_words, user_words, seed
        self.from_file = load_conversations(path, 0, turns) if path else None
        self.k = 0

    def next(self) -> Conversation:
        """A new conversation. Side effect: advances the counter."""
        k, self.k = self.k, self.k + 1
        if self.from_file:
            c = self.from_file[k % len(self.from_file)]
            return dataclasses.replace(c, id=f"{c.id}#{k // len(self.from_file)}")
        [c] = synthetic_conversations(1, self.turns, self.system_words, self.user_words, self.seed * 1_000_003 + k)
        return dataclasses.replace(c, id=f"synthetic-{k}")


@dataclass
class ServerPhase:
    """What the clients know of the server's life: shared with the fault task on one event loop (no
    locks needed). `generation` counts restarts; `restarting` is True from just before the kill until
    the new process answers /health."""
    url: str                                  # .../v1
    model: str
    generation: int = 0
    restarting: bool = False


@dataclass
class Answer:
    """One answered request."""
    conversation: str
    turn: int                                 # 1-based
    generation: int                           # the server process that answered (0: before the kill)
    start_s: float                            # when the request was (last) sent, seconds since the soak began
    ttft_s: float                             # send -> first content chunk
    itl_s: list[float]                        # gaps between content chunks (about one token each)
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    cache_tier: str | None                    # where the reused prefix came from (server's timings)
    cache_disk_n: int
    messages: list[dict] | None = None        # the transcript sent (for the cold check; not in results.json)
    kind: str = "greedy"                      # the mix's kind of this request (soak_mix.py)
    fields: dict | None = None                # the body's sampling fields, seed, response_format (for the cold check)
    max_tokens: int | None = None             # as sent (a json turn's may exceed --max-tokens)
    invalid: str | None = None                # a json turn's answer that does not validate: why


@dataclass
class Outcomes:
    """Counts of what happened to requests, and the first few failures with their reasons."""
    sent: int = 0                             # HTTP requests sent, resends included
    answered: int = 0
    failed: int = 0
    back_pressure: int = 0                    # 429s honoured
    retried_during_restart: int = 0
    failures: list[dict] = field(default_factory=list)

    def fail(self, t_s: float, conversation: str, turn: int, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append({"t_s": round(t_s, 1), "conversation": conversation, "turn": turn, "why": why})


class BackPressure(Exception):
    def __init__(self, retry_after_s: float):
        self.retry_after_s = retry_after_s


class Unreachable(Exception):
    """The server cannot answer now: connection refused/reset, a stream cut short, a 503."""


class Failed(Exception):
    """A request that ended wrongly in a way no retry excuses."""


GREEDY_FIELDS = {"temperature": 0.0}


async def stream_once(client: httpx.AsyncClient, phase: ServerPhase, messages: list[dict], max_tokens: int,
                      fields: dict | None = None) -> tuple[float, list[float], str, dict, dict, str | None]:
    """One streamed chat completion; `fields` (sampling, seed, response_format; default greedy) join the
    body. Returns (ttft, inter-chunk gaps, text, usage, timings, finish reason); raises BackPressure,
    Unreachable or Failed."""
    body = {"model": phase.model, "messages": messages, "max_tokens": max_tokens,
            **(GREEDY_FIELDS if fields is None else fields),
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    pieces: list[str] = []
    stamps: list[float] = []
    usage = timings = None
    finish = None
    done = False
    try:
        async with client.stream("POST", phase.url + "/chat/completions", json=body) as r:
            if r.status_code == 429:
                await r.aread()
                raise BackPressure(float(r.headers.get("retry-after", "1")))
            if r.status_code == 503:
                await r.aread()
                raise Unreachable(f"HTTP 503: {r.text[:200]}")
            if r.status_code != 200:
                await r.aread()
                raise Failed(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise Failed(f"error event: {json.dumps(obj['error'])[:200]}")
                for ch in obj.get("choices") or []:
                    content = (ch.get("delta") or {}).get("content")
                    if content:
                        pieces.append(content)
                        stamps.append(time.perf_counter())
                    finish = ch.get("finish_reason") or finish
                usage = obj.get("usage") or usage
                timings = obj.get("timings") or timings
    except httpx.TransportError as e:
        raise Unreachable(f"{type(e).__name__}: {e}") from None
    if not done:
        raise Unreachable("stream ended without [DONE]")
    if usage is None:
        raise Failed("no usage in the stream")
    ttft = (stamps[0] if stamps else time.perf_counter()) - sent
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return ttft, gaps, "".join(pieces), usage, timings or {}, finish


async def ask(client: httpx.AsyncClient, phase: ServerPhase, outcomes: Outcomes, messages: list[dict],
              max_tokens: int, t0: float, conversation: str, turn: int, fields: dict | None = None,
              kind: str = "greedy") -> Answer | None:
    """Send one turn until it is answered, honouring 429s and riding out the restart. Returns None
    (and counts a failure) when it cannot be answered. `t0`: the soak's start (perf_counter); `fields`:
    the body's sampling fields (stream_once), kept on the Answer with `kind` and `max_tokens`."""
    backoff = 0.25
    first_sent = time.perf_counter()
    while True:
        generation = phase.generation
        start = time.perf_counter()
        outcomes.sent += 1
        try:
            ttft, gaps, text, usage, timings, finish = await stream_once(client, phase, messages, max_tokens, fields)
        except BackPressure as e:
            outcomes.back_pressure += 1
            await asyncio.sleep(max(0.05, e.retry_after_s))
            continue
        except Unreachable as e:
            if not (phase.restarting or phase.generation != generation):
                outcomes.fail(start - t0, conversation, turn, str(e))
                return None
            if time.perf_counter() - first_sent > GIVE_UP_S:
                outcomes.fail(start - t0, conversation, turn, f"still unreachable after {GIVE_UP_S:.0f} s: {e}")
                return None
            outcomes.retried_during_restart += 1
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))   # jitter: 32 clients do not resend in step
            backoff = min(2 * backoff, 2.0)
            continue
        except (Failed, ValueError) as e:       # ValueError: a data line that is not JSON
            outcomes.fail(start - t0, conversation, turn, str(e))
            return None
        outcomes.answered += 1
        details = usage.get("prompt_tokens_details") or {}
        # who answered: once `restarting` is set the old process is already dead (set and kill run
        # without an await between them), so an answer arriving then came from the new one
        answered_by = phase.generation + phase.restarting
        return Answer(conversation, turn, answered_by, start - t0, ttft, gaps, text, int(usage["prompt_tokens"]),
                      int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens") or 0), finish,
                      timings.get("cache_tier"), int(timings.get("cache_disk_n") or 0), kind=kind,
                      fields=GREEDY_FIELDS if fields is None else fields, max_tokens=max_tokens)


def resumed_history(conv: Conversation, turns: int) -> list[dict]:
    """The system prompt and the first `turns` user turns of `conv`, each followed by a seeded synthetic
    answer of about 24 words (what max_tokens 32 yields): a chat the user reopens mid-way."""
    rng = random.Random(conv.id)
    history = [{"role": "system", "content": conv.system}] if conv.system else []
    for user in conv.user_turns[:turns]:
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": synthetic_text(rng, 24)}]
    return history


async def converse(client: httpx.AsyncClient, phase: ServerPhase, outcomes: Outcomes, source: ConversationSource,
                   answers: list[Answer], *, max_tokens: int, t0: float, stop: Callable[[], bool],
                   resume_at: int = 0, mix: Mix | None = None) -> None:
    """One chat client: conversation after conversation until `stop()`. The first one is resumed after
    `resume_at` turns (clients given different values spread conversation lengths from the start, the
    steady state, instead of all growing in step for minutes). Each turn's request is the mix's
    (default: greedy) for (conversation, turn). Side effect: appends every answer to `answers`, with its
    transcript (a few hundred answers of a few kB: kept in memory); a json answer that does not validate
    is counted as failed (and kept: the chat goes on with it)."""
    mix = mix or mix_named("greedy")
    skip = resume_at
    while not stop():
        conv = source.next()
        skip = min(skip, len(conv.user_turns) - 1)
        history = resumed_history(conv, skip)
        for t, user in enumerate(conv.user_turns[skip:], skip + 1):
            if stop():
                return
            kind, content, fields, n = mix.request(conv.id, t, user, max_tokens)
            history.append({"role": "user", "content": content})
            a = await ask(client, phase, outcomes, list(history), n, t0, conv.id, t, fields, kind.name)
            if a is None:
                break                            # counted; a transcript without this answer is no chat
            a.messages = list(history)
            if kind.json:
                a.invalid = json_problem(a.text)
                if a.invalid:
                    outcomes.fail(a.start_s, conv.id, t, a.invalid)
            answers.append(a)
            # the next turn resends this answer as given: the cold check replays a.messages, so it
            # sends the same history, whatever the kind
            history.append({"role": "assistant", "content": a.text})
        skip = 0


async def model_id(url: str) -> str:
    """The id /v1/models lists first (what requests must name)."""
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url + "/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


async def replay_cold(url: str, model: str, answers: list[Answer], max_tokens: int,
                      transport: httpx.AsyncBaseTransport | None = None) -> list[dict]:
    """Send each answer's request once more (to a server without reuse): the same transcript, fields
    (sampling, seed, response_format) and max_tokens; greedy and seeded answers must come back text for
    text. Returns one row per answer: {conversation, turn, kind, cached_tokens, cache_tier, identical, soak,
    cold}. `max_tokens`: for answers that do not say theirs; `transport`: a test's stand-in for the network."""
    phase = ServerPhase(url, model)
    outcomes = Outcomes()
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), transport=transport) as client:
        for a in answers:
            cold = await ask(client, phase, outcomes, a.messages, a.max_tokens or max_tokens, time.perf_counter(),
                             a.conversation, a.turn, a.fields, a.kind)
            text = None if cold is None else cold.text
            rows.append({"conversation": a.conversation, "turn": a.turn, "kind": a.kind,
                         "seed": (a.fields or {}).get("seed"), "prompt_tokens": a.prompt_tokens,
                         "cached_tokens": a.cached_tokens, "cache_tier": a.cache_tier,
                         "cache_disk_n": a.cache_disk_n, "identical": text == a.text, "soak": a.text, "cold": text})
    return rows


def pick_for_cold_check(answers: list[Answer], n: int, kinds: list[str] | None = None) -> list[Answer]:
    """Up to `n` answers given by the last server process (after the restart, if there was one), one
    per conversation, taken in turn from each kind (`kinds`' order, then any other; every greedy or
    seeded kind: all compare text for text), within a kind those whose prefix came from the disk tier
    first (what survived the kill), then from RAM or a slot, then the rest; longest prompt first."""
    if n <= 0:
        return []
    last = max((a.generation for a in answers), default=0)
    after = [a for a in answers if a.messages is not None and a.generation == last]
    rank = {"disk": 0, "ram": 1, "slot": 2}
    after.sort(key=lambda a: (0 if a.cache_disk_n else 1, rank.get(a.cache_tier or "", 3), -a.prompt_tokens))
    order = list(kinds or []) + sorted({a.kind for a in after} - set(kinds or []))
    queues = {k: [a for a in after if a.kind == k] for k in order}
    out, seen = [], set()
    while len(out) < n and any(queues.values()):
        for k in order:
            q = queues[k]
            while q and q[0].conversation in seen:
                q.pop(0)
            if q and len(out) < n:
                a = q.pop(0)
                out.append(a)
                seen.add(a.conversation)
    return out
