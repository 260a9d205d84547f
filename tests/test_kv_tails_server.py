"""Issue 17 as a new user met it: five multi-turn conversations against `ternlm serve --slots 4`
(RAM tier on by default), through a real server and the official openai client. Between turns a
conversation's slot goes to another one; its last partial block goes down a tier with its whole
blocks (a tail entry), so every turn after the first reuses its prefix, even in a chat shorter than
one block. The oracle is a `--no-prefix-kv` server: greedy answers must be identical.
"""
from __future__ import annotations

import threading

import httpx2 as httpx

from server_proc import ServerProc
from test_kv_tiers_server import COMMON, cold, system_prompt, turn  # noqa: F401  (cold: the oracle fixture)

CONVERSATIONS = [
    (None, ["Hi!", "What is two plus two?", "And times three?", "Thanks!"]),   # shorter than one block
    ("You are terse.", ["Name a color.", "Another one?", "And a third?", "Which is warmest?"]),
    ("You are a poet.", ["Write two words about rain.", "Now about snow.", "And fog?", "Which is best?"]),
    (system_prompt(1)[:400], ["What is a prime number?", "Give an example.", "A larger one?", "Why?"]),
    (system_prompt(2), ["Why is the sky blue?", "And sunsets?", "Shorter, please.", "Thanks."]),
]


def start(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system else []


def test_five_conversations_on_four_slots_reuse_every_turn(cold):  # noqa: F811
    server = ServerProc(*COMMON, "--slots", "4").start().wait_ready()
    try:
        convs = [start(system) for system, _ in CONVERSATIONS]
        # turns 1 and 2 in turn order: five conversations on four LRU slots, so every turn finds its
        # slot taken by another conversation and its prefix only in the RAM tier
        prev_prompt: dict[int, int] = {}
        for t in range(2):
            for i, (conv, (_, questions)) in enumerate(zip(convs, CONVERSATIONS)):
                usage, timings = turn(server, cold, conv, questions[t])
                cached = usage.prompt_tokens_details.cached_tokens
                if t:
                    assert cached > 0 and timings["cache_tier"] == "ram", (i, usage, timings)
                    assert cached == timings["cache_ram_n"]
                    # as much as a slot hit gives: the previous prompt whole, not only its whole blocks
                    assert cached >= prev_prompt[i], (i, cached, prev_prompt[i])
                prev_prompt[i] = usage.prompt_tokens
        # turns 3 and 4 concurrently: slots change hands in whatever order the requests arrive
        errors: list[BaseException] = []
        results: list[tuple[int, object, dict]] = []

        def drive(i: int) -> None:
            try:
                for t in (2, 3):
                    usage, timings = turn(server, cold, convs[i], CONVERSATIONS[i][1][t])
                    results.append((i, usage, timings))
            except BaseException as e:   # reported below
                errors.append(e)
        threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(convs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        assert not errors, errors
        assert len(results) == 2 * len(convs)
        for i, usage, timings in results:
            assert usage.prompt_tokens_details.cached_tokens > 0, (i, usage, timings)
        metrics = httpx.get(server.base + "/metrics").text
        assert 'ternlm_kv_tier_tail_entries{tier="ram"}' in metrics
    finally:
        server.close()
