"""Tool calling: the fallback prompt, the call parser, the streaming filter (pure), then round trips
through a real `ternlm serve` with the official openai client: smollm2-135m (no tools in its template:
the fallback) in the default suite, qwen2.5-coder-0.5b (its own template renders `tools`) under `slow`.

A round trip: the model is made to call (tool_choice required / a named function: grammar-forced),
the client sends the tool's result back with the whole history, the model answers; the follow-up must
reuse the KV of the first turn's prompt and into the call it generated (see round_trip).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from server_proc import ServerProc, openai_client, serving
from ternlm.text.tools import FALLBACK_HEADER, ContentFilter, parse_calls, prepare, supports_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


# ---- pure parts --------------------------------------------------------------------------------

def test_fallback_prompt_puts_tools_in_the_system_message_and_calls_in_text():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    out, extra = prepare(msgs, TOOLS, native=False)
    assert extra == {}
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(ADD) in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                                      '\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}
    out, _ = prepare(msgs[1:2], TOOLS, native=False)       # no system message: one is added
    assert out[0]["role"] == "system" and out[0]["content"].startswith(FALLBACK_HEADER[:20])
    native, extra = prepare(msgs, TOOLS, native=True)      # the template gets objects, not JSON text
    assert extra == {"tools": TOOLS} and native[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'   # input untouched


def test_supports_tools_reads_the_template():
    assert supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}")
    assert not supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not supports_tools(None)


def test_parse_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert calls[0].id.startswith("call_")
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_calls(bad) == (bad, [])                   # not a call: stays content
    assert parse_calls("plain") == ("plain", [])


def test_content_filter_streams_text_and_holds_calls():
    f = ContentFilter()
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"add\", ", "\"arguments\": {}}\n</tool_call>", " done"]
    streamed = "".join(f.feed(p) for p in pieces)
    assert streamed == "Sure. "
    tail, calls = f.finish()
    assert [c.name for c in calls] == ["add"] and tail == "done"
    g = ContentFilter()
    assert "".join(g.feed(p) for p in ["a <", "b"]) + g.finish()[0] == "a <b"   # a held '<' comes back


# ---- through a real server ---------------------------------------------------------------------

def flags(model: str) -> tuple[str, ...]:
    return ("-m", model, "--dtype", "float32", "--threads", "1", "--slots", "2")


@pytest.fixture(scope="module")
def smol():
    yield from serving(*flags("smollm2-135m"))


client = openai_client


def round_trip(c: OpenAI, model: str, tool_choice) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    first = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice=tool_choice,
                                      max_tokens=80, temperature=0, parallel_tool_calls=False)
    ch = first.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "add")
    spec = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    msgs += [ch.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, max_tokens=24, temperature=0)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    # The follow-up reuses the whole first prompt and reaches into the call the server generated. Not
    # always through all of it: a constrained model may spell a word in tokens the tokenizer would not
    # choose ('g' 'et' for "get"); the resent text then tokenizes differently from there on, and reuse
    # stops at that token (rightly: KV built from other ids would change the answer).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < cached <= first.usage.prompt_tokens + first.usage.completion_tokens, \
        (second.usage, first.usage)


def test_round_trip_required_reuses_the_call(smol):
    round_trip(client(smol), "smollm2-135m", "required")


def test_named_function_and_parallel_calls(smol):
    c = client(smol)
    r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Add 2 and 40."}],
                                  tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                  max_tokens=120, temperature=0.8, seed=1)
    calls = r.choices[0].message.tool_calls
    assert calls and all(k.function.name == "add" for k in calls) and r.choices[0].message.content is None
    for k in calls:
        jsonschema.validate(json.loads(k.function.arguments), ADD["function"]["parameters"])


def test_tool_calls_streamed(smol):
    c = client(smol)
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
              tool_choice="required", max_tokens=80, temperature=0, parallel_tool_calls=False)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
    got, finish, content = {}, None, ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                entry = got.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == "" and got[0]["id"]
    assert [(g["name"], g["arguments"]) for g in got.values()] == [(k.function.name, k.function.arguments)
                                                                    for k in whole]


def test_tool_choice_none_and_auto_answer_in_text(smol):
    c = client(smol)
    for choice in ("none", "auto"):
        r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say hello."}],
                                      tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0)
        if choice == "none":
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason != "tool_calls"
        assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_bad_tool_requests_are_400(smol):
    c = client(smol)
    base = dict(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    for kw in (dict(tool_choice="required"),                                      # no tools
               dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
               dict(tools=[WEATHER, WEATHER]),
               dict(tools=TOOLS, response_format={"type": "json_object"}),
               dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strng"}}}],
                    tool_choice="required")):
        with pytest.raises(BadRequestError):
            c.chat.completions.create(**base, **kw)


@pytest.mark.slow
def test_round_trip_qwen_native_template():
    with ServerProc(*flags("qwen2.5-coder-0.5b")) as s:
        round_trip(client(s), "qwen2.5-coder-0.5b", "required")
        round_trip(client(s), "qwen2.5-coder-0.5b", {"type": "function", "function": {"name": "get_weather"}})


def test_openai_parse_with_pydantic_function_tool(smol):
    import openai
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        city: str = Field(max_length=30)
        days: int = Field(ge=1, le=7)

    r = client(smol).beta.chat.completions.parse(
        model="smollm2-135m", messages=[{"role": "user", "content": "Forecast for Oslo, 3 days."}],
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
