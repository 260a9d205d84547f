"""n > 1 choices and batched prompts.

Part 1, the scheduler on the tiny random model: choices 1..n-1 wait for choice 0's prefill, fork its
KV (one prefill for n choices: each follower feeds only the prompt's last token) and answer bit for bit
as a lone request with the same seed would; a follower whose leader is gone opens normally.
Part 2, a real `ternlm serve` (smollm2-135m) through the official openai client: n choices with
seeds seed + j equal to n separate requests, streamed with `index`; /v1/completions with a list of
prompts (text and token ids) equal to one request per prompt, choices indexed prompt * n + j.
"""
from __future__ import annotations

import httpx2 as httpx
import pytest

from server_proc import ServerProc, openai_client, serving
from ternlm.engine.scheduler import Cancelled, Failed, Finished, GenParams, GenRequest, Scheduler
from tiny import tiny_engine

PROMPT = [(7 * i + 1) % 250 for i in range(40)]


class Sink:
    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def completion(self):
        assert isinstance(self.events[-1], Finished), self.events[-1:]
        return self.events[-1].completion


def drain(sched: Scheduler) -> None:
    for _ in range(10_000):
        if not sched.run_once():
            return
    raise AssertionError("scheduler did not settle")


def sampled(seed: int, max_tokens: int = 8) -> GenRequest:
    return GenRequest(list(PROMPT), GenParams(max_tokens=max_tokens, temperature=0.9, seed=seed))


@pytest.fixture
def engine():
    _, eng = tiny_engine("llama", seed=3, slots=4, min_reuse=4, chunk_size=8, ctx=256)
    return eng


def lone(engine, r: GenRequest):
    for s in engine.slots:
        s.reset()
    p = r.params
    return engine.generate(list(r.prompt), max_tokens=p.max_tokens, temperature=p.temperature, seed=p.seed)


def test_followers_fork_the_leaders_prefill_and_answer_as_alone(engine):
    reqs = [sampled(10 + j) for j in range(4)]
    expected = [lone(engine, r).token_ids for r in reqs]
    for s in engine.slots:
        s.reset()
    sched = Scheduler(engine, step_tokens=64)
    sinks = [Sink() for _ in reqs]
    sched.submit_many(reqs, sinks, [None, 0, 0, 0])
    drain(sched)
    got = [s.completion for s in sinks]
    assert [c.token_ids for c in got] == expected
    n = len(PROMPT)
    assert got[0].cached_tokens == 0 and got[0].timings.prefill_tokens == n
    for c in got[1:]:   # [0, n-1) copied from choice 0's slot | [n-1, n) fed: fresh logits
        assert c.cached_tokens == n - 1 and c.restored.sibling == n - 1 and c.timings.prefill_tokens == 1
    assert len({c.slot for c in got}) == 4
    for c in got:       # every slot's record is its own prompt + answer, minus the unfed last token
        assert engine.slots[c.slot].record.fed == PROMPT + c.token_ids[:-1]


def test_more_choices_than_slots_and_a_leader_gone(engine):
    # 6 choices on 4 slots: the last two wait for a free slot; by then their leader has finished,
    # so they open normally and reuse a finished choice's slot prefix
    reqs = [sampled(20 + j, max_tokens=3) for j in range(6)]
    expected = [lone(engine, r).token_ids for r in reqs]
    for s in engine.slots:
        s.reset()
    sched = Scheduler(engine, step_tokens=64)
    sinks = [Sink() for _ in reqs]
    sched.submit_many(reqs, sinks, [None] + [0] * 5)
    drain(sched)
    assert [s.completion.token_ids for s in sinks] == expected
    assert all(s.completion.cached_tokens == len(PROMPT) - 1 for s in sinks[1:])


def test_cancelled_leader_leaves_followers_to_an_ordinary_open(engine):
    sched = Scheduler(engine, step_tokens=64)
    sinks = [Sink() for _ in range(3)]
    tickets = sched.submit_many([sampled(1), sampled(2), sampled(3)], sinks, [None, 0, 0])
    tickets[0].cancel()
    drain(sched)
    assert isinstance(sinks[0].events[-1], Cancelled)
    assert all(isinstance(s.events[-1], Finished) for s in sinks[1:])
    assert not any(isinstance(e, Failed) for s in sinks for e in s.events)


# ---- Part 2: a real server -------------------------------------------------------------------

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    yield from serving("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "4")


client = openai_client


MSGS = [{"role": "system", "content": "You are a helpful assistant who writes short poems."},
        {"role": "user", "content": "Write a two-line poem about the sea."}]


def test_n_choices_equal_separate_seeded_requests(server):
    c = client(server)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=12, temperature=0.9)
    r = c.chat.completions.create(n=3, seed=42, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    singles = [c.chat.completions.create(seed=42 + j, **kw) for j in range(3)]
    assert [ch.message.content for ch in r.choices] == [s.choices[0].message.content for s in singles]
    assert len({ch.message.content for ch in r.choices}) > 1       # sampled: the choices differ
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counted once
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_choices_streamed_with_index(server):
    c = client(server)
    kw = dict(model=MODEL, messages=MSGS, max_tokens=10, temperature=0.9, seed=7, n=2)
    whole = c.chat.completions.create(**kw)
    text, finish = {0: "", 1: ""}, {}
    usage = None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for ch in chunk.choices:
            text[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        usage = chunk.usage or usage
    assert [text[0], text[1]] == [ch.message.content for ch in whole.choices]
    assert set(finish) == {0, 1} and usage.completion_tokens == whole.usage.completion_tokens


def test_batched_prompts_in_order(server):
    c = client(server)
    ids = httpx.post(server.base + "/tokenize", json={"content": "The capital of Italy is"}).json()["tokens"]
    prompts = ["Once upon a time", "The sky is", ids]
    r = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    singles = [c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    assert [ch.text for ch in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    # with n: choice index = prompt * n + j
    r = c.completions.create(model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=0.9, seed=3, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    one = c.completions.create(model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0.9, seed=4)
    assert r.choices[3].text == one.choices[0].text


def test_batched_prompts_streamed(server):
    c = client(server)
    prompts = ["Once upon a time", "The sky is"]
    whole = c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    text = {0: "", 1: ""}
    for chunk in c.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0, stream=True):
        for ch in chunk.choices:
            text[ch.index] += ch.text
    assert [text[0], text[1]] == [ch.text for ch in whole.choices]
