"""The OpenAI-compatible server and its scheduler.

Part 1, the scheduler on the tiny random model (tests/tiny.py), driven round by round through
`run_once` (no thread, no HTTP): queue and 429, interleaving, slot choice and affinity,
cancellation queued / mid-prefill / mid-decode with the record left exact, per-request errors.

Part 2, real `ternlm serve` processes with smollm2-135m (float32, greedy, short answers) talked to by
the official openai client (sync and async, streaming and not) and raw httpx: multi-turn reuse equal to
a --no-prefix-kv server, 8 concurrent conversations, a barrage of bad requests, disconnects, API keys,
the token-id channel, metrics, and a clean Ctrl-C.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx2 as httpx  # the HTTP library the openai client is built on
import pytest
from openai import APIStatusError, AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from server_proc import ServerProc
from ternlm.engine.core import Completion, Delta
from ternlm.engine.scheduler import (Admitted, Cancelled, Failed, Finished, GenParams, GenRequest, QueueFull,
                              Scheduler, ShuttingDown)
from tiny import tiny_engine


# =============================================================================================
# Part 1: scheduler unit tests (tiny engine, no HTTP)
# =============================================================================================

@pytest.fixture(scope="module")
def engines():
    """A 2-slot engine under test and a 1-slot cold twin (same weights, no reuse) as the oracle."""
    _, eng = tiny_engine("llama", seed=3, slots=2, min_reuse=4, chunk_size=8, ctx=256)
    _, cold = tiny_engine("llama", seed=3, slots=1, prefix_reuse=False, chunk_size=8, ctx=256)
    return eng, cold


@pytest.fixture
def eng(engines):
    eng, _ = engines
    for s in eng.slots:
        s.reset()
        s.last_used = 0.0
    return eng


class Sink:
    """Collects one request's events (the scheduler calls it on the worker thread)."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Finished, Failed, Cancelled)):
            self.done.set()

    @property
    def last(self):
        return self.events[-1]

    @property
    def deltas(self) -> list[Delta]:
        return [e for e in self.events if isinstance(e, Delta)]

    @property
    def completion(self) -> Completion:
        assert isinstance(self.last, Finished), self.events[-1:]
        return self.last.completion


def drain(sched: Scheduler, max_rounds: int = 10_000) -> None:
    for _ in range(max_rounds):
        if not sched.run_once():
            return
    raise AssertionError("scheduler did not settle")


def req(prompt, max_tokens=6, **kw) -> GenRequest:
    return GenRequest(list(prompt), GenParams(max_tokens=max_tokens), **kw)


def cold_tokens(cold, prompt, max_tokens=6) -> list[int]:
    cold.slots[0].reset()
    return cold.generate(list(prompt), max_tokens=max_tokens).token_ids


P1 = [(7 * i + 1) % 250 for i in range(40)]
P2 = [(11 * i + 5) % 250 for i in range(40)]
P3 = [(13 * i + 2) % 250 for i in range(40)]


def test_queue_limit_429_and_fifo(eng):
    sched = Scheduler(eng, max_queue=2)
    sinks = [Sink() for _ in range(4)]
    tickets = [sched.submit(req(P1[:10 + i]), s) for i, s in enumerate(sinks)]  # 2 free slots + 2 waiting
    with pytest.raises(QueueFull) as e:
        sched.submit(req(P2), Sink())
    assert e.value.retry_after_s >= 1
    sched.run_once()
    admitted = [i for i, s in enumerate(sinks) if any(isinstance(x, Admitted) for x in s.events)]
    assert admitted == [0, 1]                                   # FIFO: the first two got the slots
    assert sched.state().queued == 2 and sched.state().busy == 2
    drain(sched)
    assert all(isinstance(s.last, Finished) for s in sinks)
    assert [t.id for t in tickets] == sorted(t.id for t in tickets)
    assert sched.state().busy == 0 and sched.state().idle == 2


def test_steps_batch_every_running_request_into_one_forward(eng, engines, monkeypatch):
    """Continuous batching: each round is ONE forward pass holding rows of both requests (prefill
    chunks of 8 while both prefill, then one decode row each), and each answer equals a lone run."""
    _, cold = engines
    segments_per_forward = []
    real = eng.model.forward_batch

    def counting(x, segments):
        segments_per_forward.append(len(segments))
        return real(x, segments)
    monkeypatch.setattr(eng.model, "forward_batch", counting)
    sched = Scheduler(eng)
    a, b = Sink(), Sink()
    sched.submit(req(P1, max_tokens=8), a)
    sched.submit(req(P2, max_tokens=8), b)
    rounds = 0
    while not (a.deltas or b.deltas):
        sched.run_once()
        rounds += 1
    assert rounds == 5                         # 40-token prompts in 8-token chunks, side by side
    for n in range(1, 4):                      # then every round yields one token each
        assert len(a.deltas) == len(b.deltas) == n
        sched.run_once()
    assert segments_per_forward == [2] * (rounds + 3)
    drain(sched)
    assert a.completion.token_ids == cold_tokens(cold, P1, 8)
    assert b.completion.token_ids == cold_tokens(cold, P2, 8)
    assert a.completion.slot != b.completion.slot


def test_slot_choice_longest_prefix_then_lru(eng):
    sched = Scheduler(eng)
    a, b = Sink(), Sink()
    sched.submit(req(P1), a)
    drain(sched)
    sched.submit(req(P2), b)
    drain(sched)
    slot_a, slot_b = a.completion.slot, b.completion.slot
    assert slot_a != slot_b                                     # a miss took the LRU (empty) slot
    # follow-up turns find their own conversation's slot
    a2, b2 = Sink(), Sink()
    sched.submit(req(P2 + b.completion.token_ids + [1, 2, 3]), b2)
    sched.submit(req(P1 + a.completion.token_ids + [4, 5]), a2)
    drain(sched)
    assert a2.completion.slot == slot_a and a2.completion.cached_tokens >= len(P1)
    assert b2.completion.slot == slot_b and b2.completion.cached_tokens >= len(P2)
    # a newcomer with no usable prefix evicts the least recently used slot
    lru = min(eng.slots, key=lambda s: s.last_used).index
    c = Sink()
    sched.submit(req(P3), c)
    drain(sched)
    assert c.completion.slot == lru and c.completion.cached_tokens == 0
    assert c.last.slot_reset                                    # it discarded a warm slot's KV


def test_near_miss_below_min_reuse_takes_lru_not_the_warm_slot(eng):
    sched = Scheduler(eng)
    a, b = Sink(), Sink()
    sched.submit(req(P1), a)
    drain(sched)
    time.sleep(0.01)
    sched.submit(req(P2), b)
    drain(sched)
    # The next prompt shares 2 tokens (< min_reuse=4) with P1's slot and none with P2's: a miss.
    # engine.pick_slot alone would evict P1's warm slot for that useless overlap; the scheduler must
    # take the LRU slot instead, which we make P2's so the two choices differ.
    eng.slots[b.completion.slot].last_used = 0.0
    c = Sink()
    sched.submit(req(P1[:2] + P3), c)
    drain(sched)
    assert c.completion.slot == b.completion.slot and c.completion.cached_tokens == 0
    assert eng.slots[a.completion.slot].record.fed[:len(P1)] == P1   # the warm slot survived


def test_prompt_cache_key_pins_conversation_to_its_slot(eng):
    sched = Scheduler(eng)
    a = Sink()
    sched.submit(req(P1, affinity="conv-a"), a)
    drain(sched)
    pinned = a.completion.slot
    eng.slots[1 - pinned].last_used = 0.0                      # the other slot is the LRU one
    # a prompt with no usable prefix anywhere: without the pin it would go to the LRU slot
    b = Sink()
    sched.submit(req(P3, affinity="conv-a"), b)
    drain(sched)
    assert b.completion.slot == pinned
    # the same key under another tenant salt does not share the pin
    eng.slots[1 - pinned].last_used = 0.0
    c = Sink()
    sched.submit(req(P2, affinity="conv-a", salt="other-tenant"), c)
    drain(sched)
    assert c.completion.slot == 1 - pinned
    # a pin yields to a slot offering a longer usable prefix (the pinned slot was overwritten)
    d = Sink()
    sched.submit(req(P2 + c.completion.token_ids, affinity="conv-a", salt="other-tenant"), d)
    drain(sched)
    assert d.completion.slot == c.completion.slot and d.completion.cached_tokens > 0


def test_namespaces_never_share_kv(eng):
    sched = Scheduler(eng)
    a, b = Sink(), Sink()
    sched.submit(req(P1, salt="alice"), a)
    drain(sched)
    sched.submit(req(P1 + [9, 9], salt="bob"), b)
    drain(sched)
    assert b.completion.cached_tokens == 0
    c = Sink()
    sched.submit(req(P1 + [9, 9], salt="alice"), c)
    drain(sched)
    assert c.completion.cached_tokens >= len(P1) - 1


def test_cancel_queued_request_never_runs(eng):
    sched = Scheduler(eng, max_queue=4)
    sinks = [Sink() for _ in range(3)]
    tickets = [sched.submit(req(p), s) for p, s in zip((P1, P2, P3), sinks)]
    tickets[2].cancel()                                         # waiting behind the two slots
    drain(sched)
    assert isinstance(sinks[2].last, Cancelled) and sinks[2].last.where == "queued"
    assert not any(isinstance(e, (Admitted, Delta)) for e in sinks[2].events)
    assert all(isinstance(s.last, Finished) for s in sinks[:2])


def test_cancel_mid_decode_frees_slot_and_record_stays_exact(eng, engines):
    _, cold = engines
    sched = Scheduler(eng)
    s = Sink()
    t = sched.submit(req(P1, max_tokens=20), s)
    while len(s.deltas) < 3:                                    # prefill chunks, then 3 tokens
        sched.run_once()
    t.cancel()
    sched.run_once()                                            # acted on within one step
    assert isinstance(s.last, Cancelled) and s.last.where == "running"
    assert sched.state().busy == 0
    got = [d.token_id for d in s.deltas]
    slot = eng.slots[next(e.slot for e in s.events if isinstance(e, Admitted))]
    assert slot.record.fed == P1 + got[:-1]                     # the last sampled token was never fed
    # the next request on that state is still correct
    follow = P1 + got + [3, 1, 4]
    f = Sink()
    sched.submit(req(follow, max_tokens=6), f)
    drain(sched)
    assert f.completion.cached_tokens == len(P1) + len(got) - 1
    assert f.completion.token_ids == cold_tokens(cold, follow, 6)


class _CancelAfter:
    """A cancel flag that reads False `n` times, then True (cancellation arriving mid-prefill)."""

    def __init__(self, n):
        self.n = n

    def is_set(self):
        self.n -= 1
        return self.n < 0

    def set(self):
        self.n = -1


def test_cancel_mid_prefill_stops_after_a_chunk(eng, engines):
    _, cold = engines
    sched = Scheduler(eng)
    prompt = [(3 * i + 7) % 250 for i in range(60)]            # 8 chunks of 8
    s = Sink()
    t = sched.submit(req(prompt), s)
    t._cancel = _CancelAfter(2)     # checks: admission sweep, before the first step, then chunk 1 -> cancel
    drain(sched)
    assert isinstance(s.last, Cancelled) and not s.deltas
    slot = eng.slots[next(e.slot for e in s.events if isinstance(e, Admitted))]
    assert slot.record.fed == prompt[:8]                        # exactly the chunk that was written
    f = Sink()
    sched.submit(req(prompt), f)
    drain(sched)
    assert f.completion.cached_tokens == 8
    assert f.completion.token_ids == cold_tokens(cold, prompt)


def test_errors_end_one_request_not_the_worker(eng, engines):
    _, cold = engines
    sched = Scheduler(eng)
    sched.start()
    try:
        too_long, bad_id, good = Sink(), Sink(), Sink()
        sched.submit(req(list(range(250)) + list(range(10))), too_long)   # 260 >= ctx 256
        sched.submit(req([1, 2, 99_999]), bad_id)
        sched.submit(req(P1), good)
        for s in (too_long, bad_id, good):
            assert s.done.wait(60)
        assert isinstance(too_long.last, Failed) and isinstance(too_long.last.error, ValueError)
        assert "context" in str(too_long.last.error)
        assert isinstance(bad_id.last, Failed) and "vocabulary" in str(bad_id.last.error)
        assert good.completion.token_ids == cold_tokens(cold, P1)
    finally:
        sched.close()
        assert sched.join(10)


def test_sink_that_raises_is_cancelled_not_fatal(eng):
    sched = Scheduler(eng)

    def broken(ev):
        if isinstance(ev, Delta):
            raise RuntimeError("consumer bug")
    sched.submit(req(P1, max_tokens=10), broken)
    ok = Sink()
    sched.submit(req(P2), ok)
    drain(sched)
    assert isinstance(ok.last, Finished)
    assert sched.state().busy == 0


def test_worker_thread_close_with_grace_and_shutdown(eng):
    sched = Scheduler(eng, max_queue=8)
    running = [Sink() for _ in range(2)]
    waiting = Sink()
    for s in running:
        sched.submit(req(P1, max_tokens=200), s)
    sched.submit(req(P2), waiting)
    sched.start()
    deadline = time.monotonic() + 30
    while not all(s.deltas for s in running) and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.close(grace_s=0.0)
    assert sched.join(30)
    for s in running:
        assert isinstance(s.last, Failed) and s.last.reason == "shutdown"
    assert isinstance(waiting.last, Failed) and waiting.last.reason == "shutdown"
    with pytest.raises(ShuttingDown):
        sched.submit(req(P3), Sink())


# =============================================================================================
# Part 2: real `ternlm serve` processes, smollm2-135m, the official openai client
# =============================================================================================

MODEL = "smollm2-135m"
MAX = 16                    # answer length: short keeps the suite fast, long enough to diverge
KEYS = ("key-alpha", "key-beta")
COMMON = ("-m", MODEL, "--dtype", "float32", "--threads", "1")


@pytest.fixture(scope="module")
def servers():
    """Three processes, started together so their model loads overlap: `main` (reuse on, 4 slots),
    `cold` (--no-prefix-kv: the oracle), `keyed` (--api-key, 1 slot, queue of 1: isolation and 429)."""
    procs = {"main": ServerProc(*COMMON, "--slots", "4"),
             "cold": ServerProc(*COMMON, "--slots", "4", "--no-prefix-kv"),
             "keyed": ServerProc(*COMMON, "--slots", "1", "--max-queue", "1", "--shutdown-grace", "1",
                                "--api-key", *KEYS)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        yield procs
        for p in procs.values():
            p.stop()                                  # SIGTERM: must exit without a traceback
        for name, p in procs.items():
            assert "Traceback" not in p.log(), f"{name} server logged a traceback:\n{p.log()[-4000:]}"
    finally:
        for p in procs.values():
            p.close()


def client(server: ServerProc, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)   # no retries: see every error


def aclient(server: ServerProc) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def ask(c: OpenAI, messages, **kw):
    kw.setdefault("max_tokens", MAX)
    return c.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def conversation(c: OpenAI, turns: list[str], **kw):
    """Run a multi-turn chat; returns (transcript, responses)."""
    messages, out = [], []
    for t in turns:
        messages.append({"role": "user", "content": t})
        r = ask(c, messages, **kw)
        out.append(r)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return messages, out


def metrics(server: ServerProc) -> dict[tuple, float]:
    """{(sample name, sorted labels...): value} of one /metrics scrape."""
    text = httpx.get(server.base + "/metrics").text
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def slots(server: ServerProc, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.base + "/slots", headers=headers).json()


def wait_until(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


TURNS = ["Hi! Name one color.", "Why do people like it?", "Name a fruit of that color.", "Thanks!"]


def test_health_models_and_loading(servers):
    main = servers["main"]
    assert 503 in main.health_seen                  # /health said "loading" before the model was up
    r = httpx.get(main.base + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    ids = [m.id for m in client(main).models.list().data]
    assert ids == [MODEL]
    assert client(main).models.retrieve(MODEL).id == MODEL


def test_multi_turn_reuse_and_equal_to_no_reuse(servers):
    warm, ref = conversation(client(servers["main"]), TURNS, prompt_cache_key="mt")
    cold, ref_cold = conversation(client(servers["cold"]), TURNS)
    assert warm == cold                             # greedy answers identical with and without reuse
    prev = None
    for r, rc in zip(ref, ref_cold):
        u = r.usage
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert rc.usage.prompt_tokens_details.cached_tokens == 0
        assert r.choices[0].finish_reason in ("stop", "length")
        t = r.model_extra["timings"]
        assert t["prompt_n"] + t["cache_n"] == u.prompt_tokens and t["predicted_n"] == u.completion_tokens
        if prev is not None:
            # the whole previous turn's prompt came from KV, not just the shared system prompt
            assert u.prompt_tokens_details.cached_tokens >= prev.usage.prompt_tokens
        prev = r


def test_streaming_chat_matches_non_streaming(servers):
    c = client(servers["main"])
    messages = [{"role": "user", "content": "Say something about the sea."}]
    plain = ask(c, messages)
    chunks = list(ask(c, messages, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == plain.choices[0].message.content
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0      # the same prompt again
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    # without include_usage: no usage chunk; the raw stream ends with [DONE]
    with httpx.stream("POST", servers["main"].v1 + "/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(ln[6:]) for ln in lines[:-1])


def test_logprobs_and_stop(servers):
    c = client(servers["main"])
    messages = [{"role": "user", "content": "List three animals."}]
    r = ask(c, messages, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.logprob - 1e-4 for e in content)   # greedy takes the top
    text = r.choices[0].message.content
    stop = text[4:7]
    assert stop and text.index(stop) > 0
    s = ask(c, messages, stop=[stop, "zzzz"])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].message.content == text[:text.index(stop)]
    t = c.completions.create(model=MODEL, prompt="The cat sat on the", max_tokens=5, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == t.usage.completion_tokens
    assert all(len(d) <= 2 for d in lp.top_logprobs)


def test_concurrent_conversations(servers):
    """8 clients x 4 turns at once on 4 slots (so some wait in the queue); every conversation equals
    its sequential run on the no-reuse server, and reuses KV on a later turn."""
    n = 8
    turns = [[f"Hi, I am visitor number {i}. Name one color.", "Why that one?", "Name a food.", "Bye!"]
             for i in range(n)]

    async def one(ac: AsyncOpenAI, i: int):
        messages, cached = [], []
        for t in turns[i]:
            messages.append({"role": "user", "content": t})
            kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=MAX, prompt_cache_key=f"c{i}")
            if i % 2:   # half stream, half not
                text, usage = "", None
                async for ch in await ac.chat.completions.create(stream=True,
                                                                 stream_options={"include_usage": True}, **kw):
                    if ch.choices:
                        text += ch.choices[0].delta.content or ""
                    usage = ch.usage or usage
            else:
                r = await ac.chat.completions.create(**kw)
                text, usage = r.choices[0].message.content, r.usage
            cached.append(usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": text})
        return messages, cached

    async def watch(stop: asyncio.Event, seen: dict):
        async with httpx.AsyncClient(base_url=servers["main"].base) as h:
            while not stop.is_set():
                s = (await h.get("/slots")).json()
                seen["busy"] = max(seen["busy"], s["busy"])
                seen["queued"] = max(seen["queued"], s["queued"])
                await asyncio.sleep(0.05)

    async def run_all():
        seen, stop = {"busy": 0, "queued": 0}, asyncio.Event()
        watcher = asyncio.create_task(watch(stop, seen))
        ac = aclient(servers["main"])
        # the sequential oracle runs meanwhile in a thread against the other process
        oracle = asyncio.to_thread(lambda: [conversation(client(servers["cold"]), turns[i])[0] for i in range(n)])
        results, expected = await asyncio.gather(asyncio.gather(*(one(ac, i) for i in range(n))), oracle)
        stop.set()
        await watcher
        await ac.close()
        return results, expected, seen

    results, expected, seen = asyncio.run(run_all())
    for (messages, cached), want in zip(results, expected):
        assert messages == want
        assert any(c > 0 for c in cached[1:]), cached
    assert seen["busy"] == 4 and seen["queued"] >= 1      # all slots in use at once, and some waited


def _barrage():
    """(description, method, path, json body | raw bytes, headers, expected status, expected param)."""
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def chat(**kw):
        return {**good, **kw}

    def drop(key):
        return {k: v for k, v in good.items() if k != key}
    cpl = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    C, P = "/v1/chat/completions", "/v1/completions"
    return [
        ("malformed json", "POST", C, b'{"model": "x", "messages": [', {}, 400, None),
        ("body not an object", "POST", C, [1, 2], {}, 400, None),
        ("NaN constant", "POST", C, b'{"model":"smollm2-135m","messages":[],"temperature":NaN}', {}, 400, None),
        ("missing messages", "POST", C, drop("messages"), {}, 400, "messages"),
        ("missing model", "POST", C, drop("model"), {}, 400, "model"),
        ("null messages", "POST", C, chat(messages=None), {}, 400, "messages"),
        ("unknown model", "POST", C, chat(model="gpt-9"), {}, 404, "model"),
        ("empty messages", "POST", C, chat(messages=[]), {}, 400, "messages"),
        ("unknown role", "POST", C, chat(messages=[{"role": "wizard", "content": "x"}]), {}, 400, "messages[0].role"),
        ("tool role without tool_call_id", "POST", C, chat(messages=[{"role": "tool", "content": "x"}]), {}, 400,
         "messages[0]"),
        ("content not text", "POST", C, chat(messages=[{"role": "user", "content": 5}]), {}, 400,
         "messages[0].content"),
        ("image part", "POST", C, chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]), {}, 400, "messages[0].content"),
        ("message extra field", "POST", C, chat(messages=[{"role": "user", "content": "x", "name": "bob"}]), {},
         400, "messages[0].name"),
        ("temperature string", "POST", C, chat(temperature="hot"), {}, 400, "temperature"),
        ("max_tokens string", "POST", C, chat(max_tokens="16"), {}, 400, "max_tokens"),
        ("max_tokens zero", "POST", C, chat(max_tokens=0), {}, 400, "max_tokens"),
        ("max_tokens negative", "POST", C, chat(max_tokens=-5), {}, 400, "max_tokens"),
        ("temperature negative", "POST", C, chat(temperature=-1), {}, 400, "temperature"),
        ("temperature huge", "POST", C, chat(temperature=50), {}, 400, "temperature"),
        ("top_p zero", "POST", C, chat(top_p=0), {}, 400, "top_p"),
        ("min_p over 1", "POST", C, chat(min_p=1.5), {}, 400, "min_p"),
        ("top_k negative", "POST", C, chat(top_k=-1), {}, 400, "top_k"),
        ("top_logprobs 21", "POST", C, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
        ("top_logprobs without logprobs", "POST", C, chat(top_logprobs=2), {}, 400, None),
        ("five stops", "POST", C, chat(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
        ("n=0", "POST", C, chat(n=0), {}, 400, "n"),
        ("n=17", "POST", C, chat(n=17), {}, 400, "n"),
        ("tool name with a space", "POST", C, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), {},
         400, "tools[0].function.name"),
        ("tool_choice names no tool", "POST", C, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                                      tool_choice={"type": "function", "function": {"name": "g"}}),
         {}, 400, None),
        ("json_schema", "POST", C, chat(response_format={"type": "json_schema", "json_schema": {}}), {}, 400,
         "response_format"),
        ("frequency_penalty out of range", "POST", C, chat(frequency_penalty=2.5), {}, 400, "frequency_penalty"),
        ("repeat_last_n below -1", "POST", C, chat(repeat_last_n=-2), {}, 400, "repeat_last_n"),
        ("best_of", "POST", P, {**cpl, "best_of": 2}, {}, 400, "best_of"),
        ("unknown field", "POST", C, chat(foo=1), {}, 400, "foo"),
        ("stream_options without stream", "POST", C, chat(stream_options={"include_usage": True}), {}, 400, None),
        ("beyond context", "POST", C, chat(max_tokens=9000), {}, 400, "max_tokens"),
        ("completions logprobs 21", "POST", P, {**cpl, "logprobs": 21}, {}, 400, "logprobs"),
        ("completions empty prompt", "POST", P, {**cpl, "prompt": ""}, {}, 400, "prompt"),
        ("completions empty ids", "POST", P, {**cpl, "prompt": []}, {}, 400, "prompt"),
        ("completions batch with an empty prompt", "POST", P, {**cpl, "prompt": ["a", ""]}, {}, 400, "prompt"),
        ("completions batch of mixed types", "POST", P, {**cpl, "prompt": ["a", 5]}, {}, 400, "prompt"),
        ("completions batch too many choices", "POST", P, {**cpl, "prompt": ["a"] * 20, "n": 8}, {}, 400, None),
        ("completions id out of vocab", "POST", P, {**cpl, "prompt": [1, 2, 10 ** 6]}, {}, 400, "prompt"),
        ("completions negative id", "POST", P, {**cpl, "prompt": [-1, 2]}, {}, 400, "prompt"),
        ("completions ids too long", "POST", P, {**cpl, "prompt": [42] * 8200}, {}, 400, "prompt"),
        ("completions echo", "POST", P, {**cpl, "echo": True}, {}, 400, "echo"),
        ("completions return_tokens type", "POST", P, {**cpl, "return_tokens": "yes"}, {}, 400, "return_tokens"),
        ("body over 4 MiB", "POST", C, chat(messages=[{"role": "user", "content": "a" * (4 << 20)}]), {}, 413, None),
        ("unknown path", "GET", "/v1/nothing", None, {}, 404, None),
        ("wrong method", "GET", C, None, {}, 405, None),
    ]


def test_bad_requests_barrage_while_conversations_continue(servers):
    main = servers["main"]
    expected = conversation(client(servers["cold"]), TURNS)[0]
    got: dict = {}

    def good_conversation():
        got["messages"] = conversation(client(main), TURNS)[0]
    worker = threading.Thread(target=good_conversation)
    worker.start()
    failures = []
    with httpx.Client(base_url=main.base, timeout=60) as h:
        for round_ in range(2):
            for name, method, path, body, headers, status, param in _barrage():
                if isinstance(body, bytes):
                    r = h.request(method, path, content=body, headers={"Content-Type": "application/json", **headers})
                else:
                    r = h.request(method, path, json=body, headers=headers)
                try:
                    err = r.json()["error"]
                    ok = (r.status_code == status and set(err) == {"message", "type", "param", "code"}
                          and isinstance(err["message"], str) and err["message"]
                          and (param is None or err["param"] == param))
                except Exception:
                    ok, err = False, r.text[:200]
                if not ok:
                    failures.append((name, r.status_code, err))
                if name == "beyond context" and ok:
                    assert "8192" in err["message"] and "9000" in err["message"]
            # a good request with the harmless standard fields is accepted (model by its file name too)
            r = h.post("/v1/chat/completions", json={
                "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "developer", "content": "Be brief."},
                                                                    {"role": "user", "content": "hi"}],
                "max_tokens": 4, "n": 1, "frequency_penalty": 0, "presence_penalty": 0, "stream": False,
                "response_format": {"type": "text"}, "user": "u1", "seed": 7, "logit_bias": None,
                "stop": None, "top_p": None})
            assert r.status_code == 200, r.text
    worker.join(300)
    assert not failures, failures
    assert got["messages"] == expected
    assert httpx.get(main.base + "/health").status_code == 200


def test_disconnect_mid_stream_frees_slot(servers):
    main = servers["main"]
    messages = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    before = metrics(main)
    seen, busy = 0, None
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", main.v1 + "/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 500, "temperature": 0,
                            "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    assert ch["choices"][0]["finish_reason"] is None, "finished before we could disconnect"
                    seen += bool(ch["choices"][0]["delta"].get("content"))
                if seen == 2 and busy is None:
                    busy = slots(main)["busy"]           # while the stream is live
                if seen >= 3:
                    break                                # leaving the with-block drops the connection
    assert busy >= 1
    # the client is gone: within a step the worker closes the stream and frees the slot
    wait_until(lambda: slots(main)["busy"] == 0, 10, "the slot to be freed")
    after = metrics(main)
    key = ("ternlm_cancelled_requests_total", ("where", "running"))
    assert after[key] == before[key] + 1
    held = max(s["tokens"] for s in slots(main)["slots"])
    assert held > 0                                  # the record kept what was written
    # the next request on that state is correct (and reuses it)
    r = ask(client(main), messages)
    ref = ask(client(servers["cold"]), messages)
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    # a non-stream client that gives up mid-answer is noticed too
    outcome = {}

    def impatient():
        try:
            httpx.post(main.v1 + "/chat/completions", timeout=httpx.Timeout(60, read=3.0),
                       json={"model": MODEL, "messages": messages, "max_tokens": 500, "temperature": 0})
        except httpx.ReadTimeout as e:
            outcome["error"] = e
    t = threading.Thread(target=impatient)
    t.start()
    wait_until(lambda: slots(main)["busy"] >= 1, 10, "the non-stream request to run")
    t.join(30)
    assert isinstance(outcome.get("error"), httpx.ReadTimeout)
    wait_until(lambda: slots(main)["busy"] == 0, 10, "the slot to be freed after a non-stream disconnect")
    assert metrics(main)[key] == before[key] + 2


def test_token_id_channel(servers):
    main = servers["main"]
    c = client(main)
    text = "The three primary colors are"
    ids = httpx.post(main.base + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    by_text = c.completions.create(model=MODEL, prompt=text, max_tokens=MAX, temperature=0,
                                   extra_body={"return_tokens": True})
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=MAX, temperature=0,
                                  extra_body={"return_tokens": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    tokens = by_ids.choices[0].model_extra["tokens"]
    assert tokens == by_text.choices[0].model_extra["tokens"] and len(tokens) == by_ids.usage.completion_tokens
    assert httpx.post(main.base + "/detokenize", json={"tokens": tokens}).json()["content"] == by_ids.choices[0].text
    # continuing from the exact ids (no re-tokenisation) reuses everything that was fed
    more = c.completions.create(model=MODEL, prompt=ids + tokens, max_tokens=4, temperature=0)
    assert more.usage.prompt_tokens_details.cached_tokens >= len(ids) + len(tokens) - 2
    # streamed, return_tokens rides on the final chunk
    chunks = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=MAX, temperature=0, stream=True,
                                       extra_body={"return_tokens": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == by_ids.choices[0].text
    assert chunks[-1].choices[0].model_extra["tokens"] == tokens


def test_metrics_move(servers):
    main = servers["main"]
    before = metrics(main)
    c = client(main)
    _, rs = conversation(c, TURNS[:2])
    with pytest.raises(APIStatusError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    after = metrics(main)

    def delta(name, *labels):
        key = (name, *labels)
        return after.get(key, 0) - before.get(key, 0)
    chat = ("endpoint", "/v1/chat/completions")
    assert delta("ternlm_requests_total", chat, ("status", "200")) == 2
    assert delta("ternlm_requests_total", chat, ("status", "400")) == 1
    assert delta("ternlm_prompt_tokens_total") == sum(r.usage.prompt_tokens for r in rs)
    assert delta("ternlm_reused_tokens_total") == sum(r.usage.prompt_tokens_details.cached_tokens for r in rs) > 0
    assert delta("ternlm_completion_tokens_total") == sum(r.usage.completion_tokens for r in rs)
    for h in ("ternlm_prefill_seconds_count", "ternlm_decode_seconds_count", "ternlm_reuse_ratio_count",
              "ternlm_time_to_first_token_seconds_count", "ternlm_queue_wait_seconds_count"):
        assert delta(h) == 2, h
    assert after[("ternlm_slots_busy",)] + after[("ternlm_slots_idle",)] == 4
    assert ("ternlm_queue_length",) in after and ("ternlm_slot_resets_total",) in after
    meta = httpx.get(main.v1 + "/models").json()["data"][0]["meta"]           # the KV's format and size, both places
    assert after[("ternlm_kv_bytes_per_token", ("kv_dtype", meta["kv_dtype"]))] == meta["kv_bytes_per_token"] > 0
    assert after[("ternlm_kv_slot_bytes",)] >= 4 * 256 * meta["kv_bytes_per_token"]     # 4 slots, a block each


def test_api_keys_isolate_caches(servers):
    keyed = servers["keyed"]
    assert httpx.get(keyed.base + "/health").status_code == 200           # health needs no key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-alpha"}):
        r = httpx.post(keyed.v1 + "/chat/completions", headers=headers,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed.v1 + "/models").status_code == 401
    alice, bob = client(keyed, KEYS[0]), client(keyed, KEYS[1])
    with pytest.raises(APIStatusError) as e:
        ask(client(keyed, "nope"), [{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401
    history, _ = conversation(alice, TURNS[:1])
    prompt = history + [{"role": "user", "content": TURNS[1]}]
    a2 = ask(alice, prompt)
    assert a2.usage.prompt_tokens_details.cached_tokens > 0                # the same key reuses
    # one slot: bob's request lands on alice's KV, and must not reuse any of it
    b = ask(bob, prompt)
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert b.choices[0].message.content == a2.choices[0].message.content
    a3 = ask(alice, prompt)                 # the slot holds bob's KV now: alice's comes from the RAM tier
    assert a3.model_extra["timings"]["cache_slot_n"] == 0
    assert a3.model_extra["timings"]["cache_tier"] == "ram"                 # her own blocks, her namespace
    assert a3.choices[0].message.content == a2.choices[0].message.content
    assert ask(alice, prompt).usage.prompt_tokens_details.cached_tokens > 0
    salted = ask(alice, prompt, extra_body={"cache_salt": "other"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0           # cache_salt is its own namespace
    ns = slots(keyed, KEYS[0])["slots"][0]["namespace"]
    assert ns and len(ns) == 12 and KEYS[0] not in json.dumps(slots(keyed, KEYS[0]))


def test_queue_full_429(servers):
    keyed = servers["keyed"]                          # 1 slot, --max-queue 1
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 100."}],
            "max_tokens": 500, "temperature": 0, "stream": True}
    result = {}
    with httpx.Client(base_url=keyed.base, headers=auth, timeout=120) as h:
        with h.stream("POST", "/v1/chat/completions", json=long) as running:
            wait_until(lambda: slots(keyed, KEYS[0])["busy"] == 1, 30, "the slot to be busy")

            def waiter():
                r = httpx.post(keyed.v1 + "/chat/completions", headers=auth, timeout=120,
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4})
                result["status"] = r.status_code
            t = threading.Thread(target=waiter)
            t.start()
            wait_until(lambda: slots(keyed, KEYS[0])["queued"] == 1, 30, "a queued request")
            r = h.post("/v1/chat/completions", json={**long, "stream": False})
            assert r.status_code == 429
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
            assert running.status_code == 200
        # the stream was closed: the queued request gets the slot and completes
        t.join(120)
    assert result["status"] == 200


def test_ctrl_c_ends_streams_and_exits_cleanly(servers):
    """Last: takes the keyed server down. A running stream ends (its answer or an error event after the
    grace period), the process exits with no traceback."""
    keyed = servers["keyed"]
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    lines, sent = [], False
    try:
        with httpx.Client(base_url=keyed.base, headers=auth, timeout=60) as h:
            with h.stream("POST", "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 300."}],
                    "max_tokens": 2000, "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3 and not sent:
                        keyed.send_signal(signal.SIGINT)     # once: a second Ctrl-C means "force quit"
                        sent = True
    except httpx.TransportError as e:
        raise AssertionError(f"stream broken: {e!r}\n{lines[-2:]}\n{keyed.log()[-6000:]}") from None
    rc = keyed.proc.wait(30)
    last = json.loads(lines[-1][6:]) if lines[-1] != "data: [DONE]" else {}
    assert lines[-1] == "data: [DONE]" or last["error"]["code"] == "shutting_down"
    assert rc in (0, 130)
    assert "Traceback" not in keyed.log()


def test_load_failure_exits_with_status_1():
    p = ServerProc("-m", "/nonexistent/model.gguf").start()
    try:
        rc = p.proc.wait(120)
        assert rc == 1
        assert "loading the model failed" in p.log() and "Traceback" not in p.log()
    finally:
        p.close()
