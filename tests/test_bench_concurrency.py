"""`ternlm bench multiturn --concurrency N`: the latency figures (pure) and the option end to end on a
fake server (fast): aggregate decode tok/s over the union of streaming time, ITL percentiles, and the
other streams' ITL during a cold prompt's prefill window."""
from __future__ import annotations

import json

import pytest

from fake_openai import FakeOpenAI
from ternlm.bench.latency import aggregate_decode_tok_s, gaps, pcts, split_gaps, union_length
from ternlm.cli.main import main


def test_union_and_aggregate():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4            # overlap counted once
    assert union_length([(0, 10), (2, 3)]) == 10
    # two streams of 5 tokens each over the same second: 8 tokens after the firsts in 1 s
    a = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert aggregate_decode_tok_s([a, list(a)]) == pytest.approx(8.0)
    # the same two streams one after the other: 8 tokens in 2 s
    assert aggregate_decode_tok_s([a, [t + 1.0 for t in a]]) == pytest.approx(4.0)
    assert aggregate_decode_tok_s([[1.0]]) is None                 # a single token has no decode time


def test_gaps_split_by_window():
    assert gaps([0.0, 0.1, 0.3]) == pytest.approx([0.1, 0.2])
    during, outside = split_gaps([[0.0, 0.1, 0.5, 0.6]], [(0.2, 0.55)])
    assert during == pytest.approx([0.4, 0.1]) and outside == pytest.approx([0.1])
    frozen, rest = split_gaps([[0.0, 0.1, 30.0, 30.1]], [(0.15, 29.0)])   # a stream frozen by the prefill
    assert frozen == pytest.approx([29.9]) and rest == pytest.approx([0.1, 0.1])
    p = pcts([0.1] * 99 + [1.0])
    assert p["p50"] == pytest.approx(0.1) and p["n"] == 100 and p["p99"] > 0.1
    assert pcts([]) == {"p50": None, "p99": None, "n": 0}


def test_concurrency_and_cold_prompt_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    with FakeOpenAI() as fake:
        rc = main(["bench", "multiturn", "--url", fake.url, "--label", "F", "--num-conversations", "3",
                   "--turns", "2", "--max-tokens", "8", "--concurrency", "3", "--cold-prompt-tokens", "200",
                   "--cold-prompt-delay", "0", "--out", str(out)])
        cold = [r for r in fake.requests if r["max_tokens"] == 1]
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["clients"] == 3 and res["settings"]["cold_prompt_tokens"] == 200
    s = res["summary"]["F"]
    assert s["itl_s"]["n"] > 0 and s["itl_s"]["p50"] is not None
    assert s["decode_tok_s_aggregate"] > 0
    assert len(cold) == 1 and len(cold[0]["messages"][0]["content"].split()) > 150   # one long, unrelated prompt
    c = res["cold_prompt"]["F"]
    assert len(c["prefill_s"]) == 1 and c["itl_outside_s"]["n"] > 0
    assert all(len(t["token_times"]) >= 1 for t in res["turns"])
    stdout = capsys.readouterr().out
    assert "streaming at concurrency 3" in stdout and "cold prompt of" in stdout
