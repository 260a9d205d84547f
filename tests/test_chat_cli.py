"""`ternlm chat` driven as a person would: through a pseudo-terminal with pexpect (typing, Ctrl-C).

1. In-process smollm2-135m: two turns (the second reuses the first's KV, shown on its stats line),
   /stats, /reset (the next prompt is short again), a multi-line message interrupted with Ctrl-C during
   its answer (back at the prompt, the chat still works), /quit exits 0.
2. --url against a real `ternlm serve`: the stats line comes from the server's usage/timings.
3. --url against a fake server that streams forever: Ctrl-C mid-answer closes the HTTP stream (the
   server sees the disconnect), the partial answer stays in the history that is resent next turn, and
   a server without usage/timings gets a client-side stats line.

The chat is started as `python -m ternlm.cli.chat`, the same parser and loader `ternlm chat` uses.
"""
from __future__ import annotations

import os
import re
import sys
import time

import pexpect
import pytest

from fake_openai import FakeOpenAI
from server_proc import ServerProc

PROMPT = "you> "
STATS = re.compile(r"reused (\d+)/(\d+) · prefill (\d+) tok in [\d.]+ s · (?:\d+ tok/s · )?first token [\d.]+ s")


def spawn(*args: str, timeout: float = 120) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "ternlm.cli.chat", *args], encoding="utf-8", timeout=timeout,
                         dimensions=(50, 400), env=dict(os.environ, PYTHONUNBUFFERED="1", TERM="xterm"))


def turn(child: pexpect.spawn, text: str) -> tuple[int, int]:
    """Type a message, wait for the answer's stats line and the next prompt. Returns (reused, prompt)."""
    child.sendline(text)
    child.expect(STATS)
    reused, prompt = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact(PROMPT)
    return reused, prompt


def quit_(child: pexpect.spawn) -> int:
    child.sendline("/quit")
    child.expect(pexpect.EOF, timeout=30)
    child.close()
    return child.exitstatus


def test_in_process_two_turns_reset_ctrl_c_quit():
    child = spawn("-m", "smollm2-135m", "--dtype", "float32", "--max-tokens", "16", "--temperature", "0",
                  "--threads", "1")
    try:
        child.expect_exact(PROMPT, timeout=180)                      # model loaded
        r1, p1 = turn(child, "My name is Ada. What is the capital of France?")
        r2, p2 = turn(child, "And what is my name?")
        assert p2 > p1
        assert r2 > 0, "the second turn must reuse the first turn's KV"
        assert r2 >= p1 - 4          # at least the first prompt (the template may re-render its tail)
        child.sendline("/stats")
        child.expect(r"turns 2 · reused (\d+)/(\d+) prompt tokens")
        assert int(child.match.group(1)) == r1 + r2 and int(child.match.group(2)) == p1 + p2
        child.expect_exact(PROMPT)

        child.sendline("/reset")
        child.expect_exact("history cleared: 4 messages")
        child.expect_exact(PROMPT)
        _, p3 = turn(child, "Hi.")
        assert p3 < p1               # the transcript starts over

        # A long multi-line message (backslash continues), so Ctrl-C lands while it is being answered.
        lines = [f"Line {i}: the river and the mountain and the garden of the city by the ocean." for i in range(40)]
        for line in lines[:-1]:
            child.sendline(line + " \\")
            child.expect_exact("...> ")
        child.sendline(lines[-1] + " Summarise.")
        time.sleep(0.5)
        child.sendintr()
        child.expect(r"\(interrupted\)( \(question dropped\))?")
        dropped = bool(child.match.group(1))
        child.expect_exact(PROMPT)
        r4, p4 = turn(child, "Thanks!")                              # still chatting after Ctrl-C
        if dropped:      # Ctrl-C before any text: the question is gone from the history
            assert p4 < 200
        else:            # the partial answer stays, and the interrupted prefill's KV is reused
            assert p4 > 500 and r4 > 500
        assert quit_(child) == 0
    finally:
        child.close(force=True)


@pytest.fixture(scope="module", autouse=True)
def real_server(request):
    """A real `ternlm serve`, started when the module starts (if its test is selected) so that it loads
    while the in-process test runs."""
    if not any(item.name == "test_url_against_real_server" for item in request.session.items):
        yield None
        return
    server = ServerProc("-m", "smollm2-135m", "--dtype", "float32", "--slots", "1", "--threads", "1").start()
    yield server
    server.close()


def test_url_against_real_server(real_server):
    real_server.wait_ready()
    child = spawn("--url", real_server.v1, "--max-tokens", "16", "--temperature", "0")
    try:
        child.expect_exact(PROMPT, timeout=60)
        r1, p1 = turn(child, "My name is Ada. What is the capital of France?")
        assert r1 < p1
        r2, p2 = turn(child, "And what is my name?")
        assert r2 > 0 and p2 > p1
        assert "timed client-side" not in child.before        # prefill/decode from the server's timings
        assert quit_(child) == 0
    finally:
        child.close(force=True)


def test_url_ctrl_c_closes_the_stream_and_keeps_the_partial_answer():
    def answer(messages):
        return None if "forever" in messages[-1]["content"] else "fine."
    with FakeOpenAI(answer, delay_s=0.05) as fake:
        child = spawn("--url", fake.url, "--system", "Be brief.", timeout=30)
        try:
            child.expect_exact(PROMPT)
            child.sendline("Talk forever.")
            child.expect_exact("tick tick tick")
            child.sendintr()
            child.expect_exact("(interrupted)")
            child.expect_exact(PROMPT)
            deadline = time.monotonic() + 5
            while fake.disconnects < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert fake.disconnects == 1, "Ctrl-C must close the HTTP stream"

            child.sendline("Now stop.")
            child.expect_exact("fine.")
            child.expect(r"first token [\d.]+ s · timed client-side")  # no usage/timings from this server
            child.expect_exact(PROMPT)
            sent = fake.requests[-1]["messages"]
            assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
            assert sent[2]["content"].startswith("tick tick tick")
            assert fake.requests[-1]["stream_options"] == {"include_usage": True}

            child.sendline("/system")
            child.expect_exact("system prompt cleared")
            child.sendline("/nonsense")
            child.expect_exact("unknown command /nonsense")
            child.sendeof()                                           # Ctrl-D leaves too
            child.expect(pexpect.EOF)
            child.close()
            assert child.exitstatus == 0
        finally:
            child.close(force=True)


def test_cli_registers_chat():
    """`ternlm chat` exists once src/ternlm/cli/main.py calls add_chat_parser."""
    from ternlm.cli.main import main
    with pytest.raises(SystemExit) as e:
        main(["chat", "--help"])
    assert e.value.code == 0


def test_stats_line_names_the_tier_the_prefix_came_from():
    from types import SimpleNamespace

    from ternlm.cli.chat import TurnStats, _fill
    usage = SimpleNamespace(prompt_tokens=900, completion_tokens=5,
                            prompt_tokens_details=SimpleNamespace(cached_tokens=768))
    for tier, shown in (("disk", "reused 768/900 from disk"), ("ram", "reused 768/900 from ram"),
                        ("slot", "reused 768/900 ·")):
        st = TurnStats()
        _fill(st, usage, {"prompt_n": 132, "prompt_ms": 80.0, "predicted_n": 5, "predicted_ms": 100.0,
                          "cache_tier": tier}, 5, 1.0, 2.0)
        assert shown in st.line()
