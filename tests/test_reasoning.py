"""Reasoning models: thinking apart from the answer, thinking on/off per request, and the history case.

Pure parts first (reasoning.split and its streaming form, every split point of a text against the
whole). Then a real `ternlm serve` with the official openai client: smollm2-135m (not a reasoning
model) runs a Qwen3-style thinking template (tests/data/thinking.jinja via --chat-template) and a
regex forces its answers into the `<think>…</think>answer` shape, so the parser, the streaming, tool
calls after thinking and the next turn's reuse all run for real.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server_proc import openai_client, serving
from ternlm.text.reasoning import Split, Splitter, prompt_opens_thinking, split, template_thinks

TEMPLATE = Path(__file__).parent / "data" / "thinking.jinja"
THINK_THEN_ANSWER = {"type": "regex", "regex": r"<think>\n[a-z]{2,8}( [a-z]{2,8}){8,14}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){2,5}"}
ANSWER_ONLY = {"type": "regex", "regex": r"[a-z]{2,8}( [a-z]{2,8}){2,5}"}


# ---- pure -------------------------------------------------------------------------------------------

def test_split_cases():
    assert split("<think>\nhmm\n</think>\n\nYes.", started=False) == Split("hmm", "Yes.")
    assert split("<think>\n\n a\nb \n\n</think>x", started=False) == Split(" a\nb ", "x")   # newlines only
    assert split("  Plain answer", started=False) == Split(None, "  Plain answer")
    assert split("still thinking", started=True) == Split("still thinking", "")     # cut off by max_tokens
    assert split("r1 style</think>answer", started=True) == Split("r1 style", "answer")
    assert split("<think></think>", started=False) == Split("", "")
    assert split("<thin", started=False) == Split(None, "<thin")                   # never became a tag
    assert split("a <think> b", started=False) == Split(None, "a <think> b")      # only at the start


def test_template_and_prompt_detection():
    text = TEMPLATE.read_text()
    assert template_thinks(text) and not template_thinks("{{ messages[0].content }}") and not template_thinks(None)
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


@given(text=st.text(alphabet="<>/thinkab \n", max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8),
       started=st.booleans())
def test_streaming_equals_whole(text, cuts, started):
    """Any split of the text into deltas gives back exactly the whole answer's two fields."""
    s, r, c, at = Splitter(started), [], [], 0
    for cut in sorted(set(min(x, len(text)) for x in cuts)) + [len(text)]:
        a, b = s.feed(text[at:cut])
        r.append(a)
        c.append(b)
        at = cut
    a, b = s.finish()
    whole = split(text, started)
    assert "".join(c) + b == whole.content
    assert ("".join(r) + a if s.thought else None) == whole.reasoning


# ---- a real server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    yield from serving("-m", "smollm2-135m", "--dtype", "float32", "--threads", "1", "--slots", "2",
                       "--chat-template", str(TEMPLATE))


def ask(c, messages, fmt, **kw):
    return c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=120, temperature=0,
                                     response_format=fmt, **kw)


def test_thinking_apart_streamed_equals_whole(server):
    c = openai_client(server)
    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    r = ask(c, msgs, THINK_THEN_ANSWER)
    m = r.choices[0].message
    assert m.reasoning_content and "<think>" not in m.content and "</think>" not in m.content
    assert m.content and m.content == m.content.strip()
    assert r.usage.completion_tokens_details.reasoning_tokens > 8
    reasoning, content = [], []
    for chunk in c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=120, temperature=0,
                                           response_format=THINK_THEN_ANSWER, stream=True):
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            reasoning.append(d.get("reasoning_content") or "")
            content.append(d.get("content") or "")
    assert "".join(reasoning) == m.reasoning_content and "".join(content) == m.content
    first_content = next(i for i, x in enumerate(content) if x)
    assert not any(reasoning[first_content:]), "thinking streams before the answer"


def test_thinking_off_per_request_and_format_none(server):
    c = openai_client(server)
    msgs = [{"role": "user", "content": "Name a colour."}]
    off = ask(c, msgs, ANSWER_ONLY, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = ask(c, msgs, ANSWER_ONLY)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.prompt_tokens > on.usage.prompt_tokens, "the template pre-filled an empty thinking block"
    assert ask(c, msgs, ANSWER_ONLY, reasoning_effort="low").choices[0].message.content   # reaches the template
    raw = ask(c, msgs, THINK_THEN_ANSWER, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content.startswith("<think>")
    opened = ask(c, msgs, {"type": "regex", "regex": r"[a-z]{2,8}( [a-z]{2,8}){3,6}\n</think>\n\n[a-z]{2,8}"},
                 extra_body={"chat_template_kwargs": {"open_thinking": True}})
    m = opened.choices[0].message
    assert m.reasoning_content and "</think>" not in m.content, "the prompt opened <think>: DeepSeek-R1 style"
    bad = c.chat.completions.with_raw_response.create  # a reserved name is a 400, not a template surprise
    with pytest.raises(Exception) as err:
        bad(model="smollm2-135m", messages=msgs, extra_body={"chat_template_kwargs": {"messages": []}})
    assert getattr(err.value, "status_code", None) == 400


def test_next_turn_reuses_up_to_the_stripped_thinking(server):
    """The template drops the previous answer's thinking: reuse runs to the exact divergence (the
    start of the re-rendered answer) and says so; sent back with keep_thinking, reuse covers it."""
    c = openai_client(server)
    msgs = [{"role": "system", "content": "You are brief. " * 20}, {"role": "user", "content": "Why is grass green?"}]
    t1 = ask(c, msgs, THINK_THEN_ANSWER, extra_body={"prompt_cache_key": "history"})
    m1 = t1.choices[0].message
    follow = msgs + [{"role": "assistant", "content": m1.content}, {"role": "user", "content": "And the sea?"}]
    t2 = ask(c, follow, ANSWER_ONLY, extra_body={"prompt_cache_key": "history"})
    assert t2.usage.prompt_tokens_details.cached_tokens == t1.usage.prompt_tokens
    timings = t2.model_dump()["timings"]
    assert "(message 2): the template re-rendered the assistant turn" in timings["cache_reason"]
    assert timings["prompt_n"] == t2.usage.prompt_tokens - t1.usage.prompt_tokens   # answer + new message only
    # the same history with the thinking sent back and kept by the template: reuse runs into it
    kept = {"chat_template_kwargs": {"keep_thinking": True}, "prompt_cache_key": "kept"}
    t1 = ask(c, msgs, THINK_THEN_ANSWER, extra_body=kept)
    m1 = t1.choices[0].message
    follow = msgs + [{"role": "assistant", "content": m1.content, "reasoning_content": m1.reasoning_content},
                     {"role": "user", "content": "And the sea?"}]
    t2 = ask(c, follow, ANSWER_ONLY, extra_body=kept)
    assert t2.usage.prompt_tokens_details.cached_tokens > t1.usage.prompt_tokens + t1.usage.completion_tokens // 2


def test_tool_call_after_thinking_round_trips(server):
    c = openai_client(server)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = json.dumps({"name": "get_weather", "arguments": {"city": "paris"}})
    fmt = {"type": "regex", "regex": r"<think>\n[a-z]{2,8}( [a-z]{2,8}){4,8}\n</think>\n\n<tool_call>\n"
                                     + call.replace("{", r"\{").replace("}", r"\}") + r"\n</tool_call>"}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = ask(c, msgs, fmt, tools=tools)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.reasoning_content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [("get_weather", {"city": "paris"})]
    msgs += [{"role": "assistant", "content": m.content, "reasoning_content": m.reasoning_content,
              "tool_calls": [t.model_dump() for t in m.tool_calls]},
             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
    answer = ask(c, msgs, ANSWER_ONLY, tools=tools)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_cli_shows_thinking_apart_and_keeps_only_the_answer():
    """`ternlm chat`: thinking printed under its own header, the answer after it, the stats line counts
    the thinking's tokens, and the history keeps the answer alone (as templates do)."""
    import io

    from ternlm.cli.chat import Chat, Thinking, TurnStats

    class Backend:
        label = "fake"

        def stream(self, messages, *, max_tokens, temperature, seed=None):
            yield Thinking("the sky ")
            yield Thinking("scatters blue")
            yield "Rayleigh "
            yield "scattering."
            yield TurnStats(prompt_tokens=20, cached_tokens=0, completion_tokens=9, reasoning_tokens=5,
                            measured="engine")

    out = io.StringIO()
    chat = Chat(Backend(), out=out)
    chat.ask("Why is the sky blue?")
    text = out.getvalue()
    assert text.startswith("thinking: the sky scatters blue\n\nRayleigh scattering.\n")
    assert "thought 5 tok" in text
    assert chat.history[-1] == {"role": "assistant", "content": "Rayleigh scattering."}
