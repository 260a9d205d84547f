"""`ternlm bench soak`: the real thing, tiny; and the counting rules its targets rest on.

1. End to end: smollm2-135m (float32, one thread), 4 conversations on 2 slots for 24 s with a kill -9
   at 12 s, a 1 MiB RAM tier (so blocks reach the disk tier as soon as a slot changes hands). The bench
   owns its servers (the soak's, its restart, the cold one) and must leave none running. Asserted:
   the structure of results.json, the PNG, and the correctness outcomes (no failed request, every
   cache file verifies, the answers after the restart equal the cold server's). Never timings, and
   not the RSS verdict either: 2 s of warm-up and 3 samples of a restarted server measure how fast
   its working set fills on the host (CI read +5.0%, 954 -> 1002 MiB; three runs on the same host
   +3.1% to +6.8% on an AVX2 host: RESULTS.md, Soak), not an outcome. The exit status must agree with
   whatever was missed. The request mix is the default (users): the cold check must have compared a
   seeded sampled answer, and every json answer validated (it would be a failed request otherwise).
2. Counting rules, in-process against a mock transport (fast): a 429 honoured is back-pressure, a
   connection error during the restart is retried, the same error outside it or a 500 is a failure.
3. The request mix, against a recording mock transport: the bodies carry each kind's fields, the seed
   of (conversation, turn), the json_schema response_format; the transcript resends the server's
   answers; a json answer that does not validate is a failure; the cold replay resends each answer's
   own request (fields, seed, max_tokens, transcript) and compares sampled answers too.
4. The pure arithmetic: per-bin rows, RSS growth per server process, the verdicts and the exit status.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx2 as httpx

from ternlm.bench.multiturn import turn_seed
from ternlm.bench.soak_client import (Answer, ConversationSource, Outcomes, ServerPhase, ask, converse,
                                      pick_for_cold_check, replay_cold)
from ternlm.bench.soak_mix import JSON_ASK, JSON_MAX_TOKENS, SCHEMA, USERS, json_problem, mix_named
from ternlm.bench.soak_report import by_kind, missed, per_bin, rss_growth, verdicts


def test_soak_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ternlm.cli.main", "bench", "soak", "-m", "smollm2-135m", "--dtype", "float32",
           "--threads", "1", "--duration", "24", "--kill-at", "12", "--clients", "4", "--slots", "2",
           "--turns", "3", "--max-tokens", "8", "--system-words", "30", "--user-words", "12",
           "--cache-ram", "1MiB", "--warmup", "2", "--rss-every", "2", "--bin", "8", "--cold-check", "3",
           "--out", str(out)]
    # The bench stops its own servers in try/finally. Its own session, killed whole at the end, so that
    # even a bench that hangs (timeout) or dies leaves no server behind.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, COLUMNS="200"))
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    # 0: every target met; 1: a target missed (results.json says which); anything else, or no
    # results.json (a crash also exits 1), the bench broke.
    assert proc.returncode in (0, 1), stdout[-4000:] + stderr[-4000:]
    assert (out / "results.json").exists(), stdout[-4000:] + stderr[-4000:]
    for text in ("soak · 4 conversations · 2 slots", "TTFT p50 ms", "ITL p99 ms", "targets",
                 "failed requests = 0", "answers after restart = cold server's", "kill -9 at",
                 "mix users", "request mix: users", "json_schema answers parse and validate"):
        assert text in stdout, stdout

    res = json.loads((out / "results.json").read_text())
    assert res["command"].endswith(" ".join(cmd[3:]))
    assert [m for m in res["missed"] if not m.startswith("RSS growth after warm-up")] == [], stdout[-4000:]
    assert proc.returncode == (1 if res["missed"] else 0), res["missed"]
    r = res["requests"]
    assert r["failed"] == 0 and r["answered"] > 0 and r["failures"] == []
    assert r["sent"] >= r["answered"] + r["back_pressure"] + r["retried_during_restart"]
    assert 0 <= res["overall"]["reuse_fraction"] <= 1
    assert [b["from_s"] for b in res["per_bin"]] == [0, 8, 16]
    assert sum(b["answered"] for b in res["per_bin"]) == r["answered"]
    assert {"ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "reuse_fraction"} <= set(res["per_bin"][0])

    f = res["fault"]
    assert f["killed_at_s"] >= 12 and f["ready_at_s"] > f["killed_at_s"]
    assert {s["generation"] for s in res["rss"]["samples"]} == {0, 1}
    assert [g["generation"] for g in res["rss"]["growth"]] == [0, 1]
    assert all(s["rss_mib"] > 50 for s in res["rss"]["samples"])

    after_kill, at_end = res["cache_verify"]["after_kill"], res["cache_verify"]["at_end"]
    assert after_kill["dry_run"] and after_kill["rc"] == 0 and after_kill["damaged"] == 0
    assert at_end["rc"] == 0 and at_end["damaged"] == 0 and at_end["files"] > 0 and at_end["good"] == at_end["files"]

    cold = res["cold_check"]
    assert cold["skipped"] is None and 1 <= len(cold["rows"]) <= 3
    assert all(row["identical"] and row["soak"] == row["cold"] for row in cold["rows"])
    # taken in turn from each kind, the sampled ones first (chat, default, ...): a seeded sampled answer
    # given after the restart came back the same from a cold server
    assert any(row["kind"] != "greedy" and row["seed"] is not None for row in cold["rows"]), cold["rows"]
    mix = res["mix"]
    assert mix["name"] == res["settings"]["mix"] == "users" and [k["kind"] for k in mix["kinds"]] == \
        [k.name for k in USERS]
    assert sum(k["answered"] for k in mix["by_kind"].values()) == r["answered"]
    assert sum(k["cold_compared"] for k in mix["by_kind"].values()) == len(cold["rows"])
    assert mix["by_kind"]["json"]["json_invalid"] == 0 and mix["by_kind"]["chat"]["json_invalid"] is None
    assert len({a["kind"] for a in res["answers"]}) >= 3
    assert all(a["generation"] == 1 for a in res["answers"] if a["start_s"] > f["ready_at_s"])

    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"serve-0.log", "serve-1.log"} <= {q.name for q in (out / "logs").iterdir()}
    assert (out / "logs" / "cold" / "serve-0.log").exists()
    # every server this bench started exited: their logs end with uvicorn's shutdown (or the kill)
    assert "Finished server process" in (out / "logs" / "serve-1.log").read_text()
    assert "Finished server process" in (out / "logs" / "cold" / "serve-0.log").read_text()


# ---- counting rules ------------------------------------------------------------------------------

def _sse_answer(text: str = "Hi there") -> httpx.Response:
    chunks = [{"choices": [{"delta": {"content": w}, "finish_reason": None}]} for w in text.split(" ")]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"cache_tier": "ram"}})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 6}}})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def _ask(handler, phase: ServerPhase) -> tuple[Answer | None, Outcomes]:
    outcomes = Outcomes()

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await ask(client, phase, outcomes, [{"role": "user", "content": "x"}], 8, 0.0, "c", 1)
    return asyncio.run(go()), outcomes


def test_429_is_back_pressure_not_failure():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) < 3:
            return httpx.Response(429, json={"error": {}}, headers={"Retry-After": "0"})
        return _sse_answer()
    a, o = _ask(handler, ServerPhase("http://x/v1", "m"))
    assert a is not None and a.text == "Hithere" and (a.prompt_tokens, a.cached_tokens) == (10, 6)
    assert a.cache_tier == "ram" and len(a.itl_s) == 1
    assert (o.sent, o.answered, o.back_pressure, o.failed, o.retried_during_restart) == (3, 1, 2, 0, 0)


def test_connection_errors_retried_only_during_the_restart():
    phase = ServerPhase("http://x/v1", "m", restarting=True)
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) < 3:
            raise httpx.ConnectError("refused")
        phase.restarting = False
        return _sse_answer()
    a, o = _ask(handler, phase)
    assert a is not None and (o.retried_during_restart, o.failed) == (2, 0)

    def refused(request):
        raise httpx.ConnectError("refused")
    a, o = _ask(refused, ServerPhase("http://x/v1", "m"))
    assert a is None and (o.failed, o.retried_during_restart) == (1, 0) and "ConnectError" in o.failures[0]["why"]

    a, o = _ask(lambda r: httpx.Response(500, text="boom"), ServerPhase("http://x/v1", "m"))
    assert a is None and o.failed == 1 and o.failures[0]["why"].startswith("HTTP 500")

    cut = "data: " + json.dumps({"choices": [{"delta": {"content": "a"}}]}) + "\n\n"      # no [DONE]
    a, o = _ask(lambda r: httpx.Response(200, text=cut), ServerPhase("http://x/v1", "m"))
    assert a is None and o.failed == 1 and "without [DONE]" in o.failures[0]["why"]


# ---- the request mix -----------------------------------------------------------------------------

def _sse_for(request, texts: dict) -> httpx.Response:
    """An SSE answer to `request`: a valid SCHEMA instance for a json turn, else `answer-<seed>-<n>`
    (n: the request's position), so a test can find it again in the next turn's transcript."""
    body = json.loads(request.content)
    texts["n"] = texts.get("n", 0) + 1
    if "response_format" in body:
        text = texts.get("json", '{"topic": "cats", "mood": "neutral", "confidence": 7}')
    else:
        text = f"answer-{body.get('seed')}-{texts['n']}"
    return _sse_answer(text)


def _converse(requests: int, json_text: str | None = None):
    """converse() with the users' mix against a recording mock server until `requests` were sent."""
    bodies, answers, outcomes = [], [], Outcomes()
    texts = {} if json_text is None else {"json": json_text}

    def handler(request):
        bodies.append(json.loads(request.content))
        return _sse_for(request, texts)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            source = ConversationSource(path=None, turns=4, system_words=10, user_words=6, seed=5)
            await converse(client, ServerPhase("http://x/v1", "m"), outcomes, source, answers, max_tokens=16,
                           t0=0.0, stop=lambda: len(bodies) >= requests, mix=mix_named("users", 5))
    asyncio.run(go())
    return bodies, answers, outcomes


def test_users_mix_requests_carry_the_fields():
    bodies, answers, o = _converse(96)
    mix = mix_named("users", 5)
    assert o.failed == 0 and len(answers) == len(bodies) == 96
    seen = set()
    for body, a in zip(bodies, answers):
        kind = mix.kind_of(a.conversation, a.turn)
        seen.add(kind.name)
        assert a.kind == kind.name and body["stream"] is True and body["model"] == "m"
        sent = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens", "stream",
                                                             "stream_options")}
        expected = dict(kind.fields)
        if kind.seeded:
            expected["seed"] = turn_seed(5, a.conversation, a.turn)
        if kind.json:
            expected["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "summary", "schema": SCHEMA, "strict": True}}
        assert sent == expected == a.fields, (kind.name, sent)
        assert body["max_tokens"] == a.max_tokens == (JSON_MAX_TOKENS if kind.json else 16)
        assert body["messages"][-1]["content"].endswith(JSON_ASK) == kind.json
        assert body["messages"] == a.messages
    assert seen == {k.name for k in USERS}
    # the literal fields of each kind, as clients send them
    by = {a.kind: b for b, a in zip(bodies, answers)}
    assert {k: by["chat"][k] for k in ("temperature", "top_p", "presence_penalty")} == \
        {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.5}
    assert "temperature" not in by["default"] and isinstance(by["default"]["seed"], int)
    assert by["rep"]["repetition_penalty"] == 1.1 and "repeat_penalty" not in by["rep"]
    assert by["llama"]["repeat_penalty"] == 1.1 and "repetition_penalty" not in by["llama"]
    assert by["greedy"]["temperature"] == 0.0 and "seed" not in by["greedy"]
    # the transcript resends the server's answers: turn t+1 carries turn t's answer as given
    for prev, nxt in zip(answers, answers[1:]):
        if nxt.conversation == prev.conversation and nxt.turn == prev.turn + 1:
            assert nxt.messages[-2] == {"role": "assistant", "content": prev.text}


def test_invalid_json_answer_is_a_failure_and_the_chat_goes_on():
    bodies, answers, o = _converse(40, json_text='{"topic": "cats", "mood": "sleepy"}')
    bad = [a for a in answers if a.kind == "json"]
    assert bad and o.failed == len(bad) and all("does not validate" in a.invalid for a in bad)
    assert all("does not validate" in f["why"] for f in o.failures)
    assert len(answers) == len(bodies) == 40            # kept: the next turn resends them
    assert json_problem("not json").startswith("json_schema answer is not JSON")
    assert json_problem('{"topic": "x", "mood": "neutral", "confidence": 3}') is None


def test_cold_replay_resends_each_answers_own_request():
    _, answers, _ = _converse(48)
    for a in answers:
        a.generation = 1
    picked = pick_for_cold_check(answers, 6, [k.name for k in USERS])
    # in turn from each kind, one answer per conversation
    assert [a.kind for a in picked] == [k.name for k in USERS]
    assert len({a.conversation for a in picked}) == 6
    sent = []

    def cold(request):
        body = json.loads(request.content)
        sent.append(body)
        a = picked[len(sent) - 1]
        return _sse_answer(a.text if a.kind != "rep" else "something else")   # one sampled answer differs

    rows = asyncio.run(replay_cold("http://cold/v1", "m", picked, 16, transport=httpx.MockTransport(cold)))
    for a, body, row in zip(picked, sent, rows):
        assert body["messages"] == a.messages and body["max_tokens"] == a.max_tokens
        assert {k: body[k] for k in a.fields} == a.fields and ("seed" in body) == (a.kind != "greedy")
        assert row["kind"] == a.kind and row["seed"] == a.fields.get("seed")
        assert row["identical"] == (a.kind != "rep")
    kinds = by_kind(answers, rows, mix_named("users"))
    assert kinds["rep"]["cold_identical"] == 0 and kinds["chat"] == {
        "answered": sum(a.kind == "chat" for a in answers), "completion_tokens": 2 * kinds["chat"]["answered"],
        "json_invalid": None, "cold_compared": 1, "cold_identical": 1}
    result = {"requests": {"failed": 0}, "rss": {"growth": []}, "cache_verify": {},
              "cold_check": {"skipped": None, "rows": rows}, "mix": {"by_kind": kinds}}
    v = {x["target"]: x for x in verdicts(result)}
    assert v["answers after restart = cold server's"]["met"] is False
    assert "5/6 identical (chat 1/1, default 1/1, rep 0/1, llama 1/1, greedy 1/1, json 1/1)" == \
        v["answers after restart = cold server's"]["value"]
    assert v["json_schema answers parse and validate"]["met"] is True


def test_mix_names():
    assert [k.name for k in mix_named("greedy").kinds] == ["greedy"]
    t1 = mix_named("t1", 3)
    kind, _, fields, _ = t1.request("c", 2, "u", 8)
    assert fields == {"temperature": 1.0, "top_p": 1.0, "seed": turn_seed(3, "c", 2)}
    try:
        mix_named("hot")
    except ValueError as e:
        assert "hot" in str(e)
    else:
        raise AssertionError("no ValueError")


# ---- arithmetic ----------------------------------------------------------------------------------

def _answer(start_s: float, gen: int, prompt: int, cached: int) -> Answer:
    return Answer("c", 1, gen, start_s, 0.5, [0.1, 0.2], "t", prompt, cached, 2, "length", "ram", 0)


def test_bins_rss_and_verdicts():
    answers = [_answer(1, 0, 100, 50), _answer(61, 0, 100, 100), _answer(125, 1, 200, 0)]
    rows = per_bin(answers, 60, 150)
    assert [(r["from_s"], r["to_s"], r["answered"]) for r in rows] == [(0, 60, 1), (60, 120, 1), (120, 150, 1)]
    assert [r["reuse_fraction"] for r in rows] == [0.5, 1.0, 0.0] and rows[2]["generations"] == [1]

    samples = [{"t_s": t, "generation": g, "rss_mib": m} for t, g, m in
               ((0, 0, 500), (10, 0, 1000), (20, 0, 1010), (30, 0, 1100), (40, 1, 600), (55, 1, 900))]
    g0, g1 = rss_growth(samples, {0: 0.0, 1: 40.0}, warmup_s=10)
    assert (g0.first_mib, g0.last_mib, g0.samples_after_warmup) == (1000, 1100, 3)
    assert abs(g0.growth - 0.10) < 1e-9 and g1.growth is None        # one sample after its warm-up

    result = {"requests": {"failed": 0},
              "rss": {"growth": [{"generation": g.generation, "growth": g.growth, "peak_growth": g.peak_growth,
                                  "first_mib": g.first_mib, "last_mib": g.last_mib} for g in (g0, g1)]},
              "cache_verify": {"after_kill": {"rc": 0, "files": 3, "good": 3, "damaged": 0}, "at_end": None},
              "cold_check": {"skipped": None, "rows": [{"identical": True}, {"identical": True}]}}
    result["verdicts"] = verdicts(result)
    assert [v["met"] for v in result["verdicts"]] == [True, False, None, True, True]
    assert missed(result) == ["RSS growth after warm-up <= 5% (server process 0)"]
    result["cold_check"] = {"skipped": "no answers after the restart to compare", "rows": []}
    result["verdicts"] = verdicts(result)
    assert "answers after restart = cold server's (not checked)" in missed(result)
