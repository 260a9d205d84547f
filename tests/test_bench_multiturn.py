"""`ternlm bench multiturn`: end to end against real servers, and the identical-output check.

1. The real thing, tiny: smollm2-135m (float32, the server's default sampling: temperature 1, seeded per
   turn), 2 synthetic conversations x 2 turns, 8 tokens, 2 concurrent clients; the bench starts `ternlm
   serve` with reuse on and off, plus a fake --url contender that answers differently. It must print the
   tables, write results.json and a PNG, find reuse on == reuse off (required: the seeded draw) and report
   the fake as different without failing the run.
2. The check itself, on fake servers only (fast): two contenders required identical that differ ->
   exit 1, MISMATCH printed, the first difference located in results.json; the same two answering
   alike -> exit 0 (so the check can fail both ways).
3. Conversation files: MT-Bench questions (tests/data, Apache-2.0) and OpenAI chats.
4. What the requests carry: no temperature unless asked (the server's default, as vLLM's client), the
   sampling flags when given, and one seed per conversation and turn, the same for every contender.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fake_openai import FakeOpenAI
from ternlm.bench.multiturn import load_conversations, synthetic_conversations, turn_seed
from ternlm.cli.main import main

from conftest import TEST_DATA


def test_end_to_end_real_servers(tmp_path):
    out = tmp_path / "out"
    with FakeOpenAI() as fake:
        cmd = [sys.executable, "-m", "ternlm.cli.main", "bench", "multiturn", "-m", "smollm2-135m", "--dtype", "float32",
               "--threads", "1", "--num-conversations", "2", "--turns", "2", "--max-tokens", "8",
               "--system-words", "30", "--user-words", "12", "--clients", "2",
               "--url", fake.url, "--label", "fake", "--out", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, COLUMNS="200"))
        assert p.returncode == 0, p.stdout + p.stderr
        assert len(fake.requests) == 1 + 2 * 2                         # warm-up + 2 conversations x 2 turns
        second = [r["messages"] for r in fake.requests if sum(m["role"] == "user" for m in r["messages"]) == 2]
        assert len(second) == 2 and all(m[2]["content"].startswith("Answer number 1") for m in second)

    for text in ("TTFT p50", "time to first token by turn", "ternlm-reuse", "ternlm-no-reuse", "fake",
                 "identical output ternlm-reuse vs ternlm-no-reuse: 4/4 turns (required identical)",
                 "the server's default sampling (no temperature sent)",
                 "differs ternlm-reuse vs fake"):
        assert text in p.stdout, p.stdout

    res = json.loads((out / "results.json").read_text())
    assert res["all_required_identical"] is True
    assert res["settings"]["sampling"] == {} and res["settings"]["temperature"] is None
    comps = {(c["a"], c["b"]): c for c in res["comparisons"]}
    assert comps[("ternlm-reuse", "ternlm-no-reuse")]["required"] is True
    assert comps[("ternlm-reuse", "fake")]["identical"] is False
    assert comps[("ternlm-reuse", "fake")]["required"] is False

    turns = {(r["contender"], r["conversation"], r["turn"]): r for r in res["turns"]}
    assert len(turns) == 3 * 2 * 2
    for conv in ("synthetic-0", "synthetic-1"):
        on1, on2 = turns[("ternlm-reuse", conv, 1)], turns[("ternlm-reuse", conv, 2)]
        off2 = turns[("ternlm-no-reuse", conv, 2)]
        assert on2["cached_tokens"] >= on1["prompt_tokens"] - 4     # turn 2 reuses turn 1's KV
        assert off2["cached_tokens"] == 0 and off2["prompt_tokens"] == on2["prompt_tokens"]
        assert on2["measured"] == "server" and on2["ttft_s"] > 0 and on2["decode_tok_s"] > 0
        assert turns[("fake", conv, 2)]["measured"] == "client"   # no usage/timings: timed client-side
    assert res["summary"]["ternlm-reuse"]["reuse_fraction"] > 0
    assert res["summary"]["ternlm-no-reuse"]["reuse_fraction"] == 0
    assert res["summary"]["fake"]["reuse_fraction"] is None
    assert set(res["ttft_by_turn"]["ternlm-reuse"]) == {"1", "2"}
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "logs" / "ternlm-reuse.log").exists()


def _bench_fakes(tmp_path, capsys, answer_b, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / "out"
    with FakeOpenAI() as a, FakeOpenAI(answer_b) as b:
        rc = main(["bench", "multiturn", "--url", a.url, b.url, "--label", "A", "B", "--require-identical", "A,B",
                   "--num-conversations", "3", "--turns", "3", "--max-tokens", "8", "--out", str(out), *extra])
    return rc, json.loads((out / "results.json").read_text()), capsys.readouterr().out


def test_required_pair_that_differs_fails(tmp_path, capsys):
    def answer_b(messages):   # agrees on turn 1, differs from turn 2 on: a divergence mid-conversation
        users = [m for m in messages if m["role"] == "user"]
        return f"Answer number 1 to {users[-1]['content'][:12]!r}." if len(users) == 1 else "Something else."
    rc, res, stdout = _bench_fakes(tmp_path, capsys, answer_b, "--clients", "3")
    assert rc == 1
    assert res["all_required_identical"] is False
    [c] = res["comparisons"]
    assert (c["a"], c["b"], c["required"], c["identical"]) == ("A", "B", True, False)
    assert c["turns_compared"] == 9 and c["turns_equal"] == 3
    assert c["first_mismatch"]["turn"] == 2 and c["first_mismatch"]["B"] == "Something else. "
    assert "MISMATCH A vs B" in stdout


def test_required_pair_that_agrees_passes(tmp_path, capsys):
    from fake_openai import count_answer
    rc, res, stdout = _bench_fakes(tmp_path, capsys, count_answer)
    assert rc == 0 and res["all_required_identical"] is True
    assert res["comparisons"][0]["turns_equal"] == 9
    assert "identical output A vs B: 9/9 turns (required identical)" in stdout


def test_conversation_sources(tmp_path):
    convs = load_conversations(TEST_DATA / "mt_bench_question.jsonl", 5, 6)
    assert len(convs) == 5 and all(len(c.user_turns) == 2 and c.system is None for c in convs)
    assert convs[0].id == "81"
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                                              {"role": "assistant", "content": "a1"},
                                              {"role": "user", "content": "u2"}]}) + "\n"
                     + json.dumps([{"role": "user", "content": "only"}]) + "\n")
    c1, c2 = load_conversations(chats, 0, 6)
    assert (c1.system, c1.user_turns) == ("S", ("u1", "u2")) and c2.user_turns == ("only",)
    assert load_conversations(chats, 0, 1)[0].user_turns == ("u1",)
    a = synthetic_conversations(2, 3, 20, 10, seed=1)
    assert a == synthetic_conversations(2, 3, 20, 10, seed=1) != synthetic_conversations(2, 3, 20, 10, seed=2)
    assert all(len(c.user_turns) == 3 and c.system for c in a)
    with pytest.raises(ValueError):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"foo": 1}\n')
        load_conversations(bad, 0, 6)


def _bodies(tmp_path, *extra: str) -> tuple[list[dict], list[dict], dict]:
    """The replayed turns' request bodies each of two fakes saw (the warm-up left out), and results.json."""
    out = tmp_path / "out"
    with FakeOpenAI() as a, FakeOpenAI() as b:
        assert main(["bench", "multiturn", "--url", a.url, b.url, "--label", "A", "B", "--num-conversations", "2",
                     "--turns", "2", "--max-tokens", "8", "--seed", "3", "--out", str(out), *extra]) == 0
        return a.requests[1:], b.requests[1:], json.loads((out / "results.json").read_text())


def test_requests_send_the_servers_default_sampling_unless_told(tmp_path):
    a, b, res = _bodies(tmp_path)
    assert len(a) == len(b) == 4
    assert not any(k in r for r in a + b for k in ("temperature", "top_p", "presence_penalty"))
    users = lambda r: sum(m["role"] == "user" for m in r["messages"])          # noqa: E731
    seeds = {(r["messages"][1]["content"], users(r)): r["seed"] for r in a}     # (first user turn, turn number)
    assert len(set(seeds.values())) == 4                                         # one seed a conversation and turn
    assert seeds == {(r["messages"][1]["content"], users(r)): r["seed"] for r in b}   # the same for every contender
    assert sorted(seeds.values()) == sorted(turn_seed(3, f"synthetic-{c}", t) for c in (0, 1) for t in (1, 2))
    assert res["settings"]["sampling_text"] == "the server's default sampling (no temperature sent)"

    a, b, res = _bodies(tmp_path, "--temperature", "0.7", "--top-p", "0.95", "--presence-penalty", "0.5")
    assert all((r["temperature"], r["top_p"], r["presence_penalty"]) == (0.7, 0.95, 0.5) for r in a + b)
    assert res["settings"]["sampling"] == {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.5}
    a, _, res = _bodies(tmp_path, "--temperature", "0")
    assert all(r["temperature"] == 0 and "top_p" not in r for r in a) and res["settings"]["sampling_text"] == "greedy"
