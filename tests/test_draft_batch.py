"""Batched drafting with a draft model (issue 48): a step's drafting requests share the draft model's forwards (one
per draft position, not one per request), each still gets the answer of speculation off; a draft model that fails
costs the requests their drafts, never their answers.

Oracle: the same target engine with speculation off (alone, token for token and logits bit for bit). The forward
count is exact: Runner.step calls on the draft engine, counted around each target step.
"""
from __future__ import annotations

import pytest
import torch

from test_batching import alone
from test_draft_model import draft_engine, target
from test_reuse import assert_record_matches_kv
from ternlm.engine.spec.draft_batch import Lane, draft_together
from ternlm.engine.core import Engine
from ternlm.engine.scheduler import Failed, Finished, GenParams, GenRequest, Scheduler
from ternlm.server.metrics import Metrics
from ternlm.engine.step_plan import plan_step

# short prompts: every catch-up fits one chunk (16), so a step's draft forwards = its longest draft
REQS = [([5, 6, 7], 40), ([9, 8, 7, 6], 30), ([1, 2] * 5, 36), ([20, 21, 22, 23, 24], 28)]


@pytest.fixture(scope="module")
def engine():
    return target(draft_engine("near"))


class Counting:
    """Wraps a Runner's step: counts the calls (and optionally raises on call number `fail_at`)."""
    def __init__(self, runner, fail_at: int | None = None):
        self.step, self.calls, self.fail_at = runner.step, 0, fail_at

    def __call__(self, feeds):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected draft model failure")
        return self.step(feeds)


def _run_together(engine: Engine, reqs, **kw):
    """Every request opened at once (slot i + 1), one engine.step per round; per round: (draft forwards, the
    drafts the step handed out). Returns (completions, rounds)."""
    for s in engine.slots + engine.drafts.engine.slots:
        s.reset()
    seqs = [engine.open(p, max_tokens=m, keep_logits=True, ignore_eos=True, slot=i + 1, **kw)
            for i, (p, m) in enumerate(reqs)]
    small = engine.drafts.engine.runner
    done, rounds = {}, []
    while len(done) < len(seqs):
        live = [i for i in range(len(seqs)) if i not in done]
        counts = plan_step([engine.want(seqs[i]) for i in live], 64, engine.chunk_size)
        counter = small.step = Counting(small)
        try:
            outs = engine.step([(seqs[i], c) for i, c in zip(live, counts)])
        finally:
            del small.step                        # back to the class's method
        drafts = [len(seqs[i].pending) - 1 for i in live if not seqs[i].done]
        rounds.append((counter.calls, [d for d in drafts if d > 0]))
        for i, out in zip(live, outs):
            assert out.error is None, out.error
            done.update((i, ev) for ev in out.events if hasattr(ev, "token_ids"))
    return [done[i] for i in range(len(seqs))], rounds


def test_concurrent_requests_get_their_plain_answers_and_share_the_draft_forwards(engine):
    solo = [alone(engine, p, m, speculative=False)[0] for p, m in REQS]
    got, rounds = _run_together(engine, REQS, speculative=True)
    for i, (g, s) in enumerate(zip(got, solo)):
        assert g.token_ids == s.token_ids and g.text == s.text and torch.equal(g.logits, s.logits), i
        assert g.timings.drafted > 0 and not g.timings.draft_failed, i
        assert_record_matches_kv(engine, engine.slots[i + 1])
        small = engine.drafts.engine
        assert_record_matches_kv(small, small.slots[i + 1])
    for calls, drafts in rounds:                 # one draft forward per draft position, for all requests at once
        assert calls == max(drafts, default=0), (calls, drafts)
    shared = [(c, d) for c, d in rounds if len(d) >= 3]
    assert shared and all(c < sum(d) for c, d in shared)   # not vacuous: 3+ requests drafted in one step


def test_a_long_catch_up_goes_chunk_by_chunk_beside_the_others():
    """draft_together alone: a cold 40-token catch-up (chunk 16: 3 rounds) drafts after its last chunk while a
    1-token catch-up drafts from the first round; every round is one forward."""
    small = draft_engine("near", slots=2)
    for s in small.slots:
        s.reset()
    long, short = Lane(small.slots[0], list(range(3, 43)), 4), Lane(small.slots[1], [7], 5)
    rounds = draft_together(small.runner, [long, short], small.config.vocab_size, frozenset())
    assert rounds == 3 + 4 - 1 and len(long.out) == 4 and len(short.out) == 5
    assert small.slots[0].record.fed == list(range(3, 43)) + long.out[:-1]
    ref = [small.generate(list(range(3, 43)), max_tokens=4, ignore_eos=True, speculative=False).token_ids,
           small.generate([7], max_tokens=5, ignore_eos=True, speculative=False).token_ids]
    assert [long.out, short.out] == ref                        # greedy, as the small model decodes alone


@pytest.mark.parametrize("fail_at", [1, 5])
def test_a_failing_draft_model_falls_back_to_plain_decoding(engine, fail_at):
    """The draft model's forward raises once (its first batched draft, or mid-answer): no request fails, each gets
    its plain answer, the requests in that draft say draft_failed and their draft slots were reset; a request
    opened afterwards drafts again."""
    plain = [engine.generate(p, max_tokens=m, speculative=False).token_ids for p, m in REQS]   # stops at EOS
    small = engine.drafts.engine
    for s in engine.slots + small.slots:
        s.reset()
    counter = small.runner.step = Counting(small.runner, fail_at=fail_at)
    metrics = Metrics(lambda: None)
    sched = Scheduler(engine, step_tokens=64, on_done=metrics.observe)
    events: dict[int, list] = {i: [] for i in range(len(REQS))}
    for i, (p, m) in enumerate(REQS):
        sched.submit(GenRequest(p, GenParams(max_tokens=m)), events[i].append)
    try:
        while sched.run_once():
            pass
    finally:
        del small.runner.step
    assert counter.calls >= fail_at
    ends = [ev[-1] for ev in events.values()]
    assert not any(isinstance(e, Failed) for e in ends), ends
    for e, want in zip(ends, plain):
        assert isinstance(e, Finished) and e.completion.token_ids == want
    failed = [e.completion for e in ends if e.completion.timings.draft_failed]
    assert failed, "the injected failure reached no request"
    for c in failed:
        assert len(small.slots[c.slot].record) == 0           # reset, and never fed again
    body = metrics.render().decode()
    assert f"ternlm_spec_draft_failures_total {float(len(failed))}" in body
    again, _ = alone(engine, REQS[0][0], REQS[0][1], speculative=True)
    assert again.timings.drafted > 0 and not again.timings.draft_failed
    assert again.token_ids == alone(engine, REQS[0][0], REQS[0][1], speculative=False)[0].token_ids
