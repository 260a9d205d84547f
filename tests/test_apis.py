"""The other client APIs through a real `ternlm serve`, each with its ecosystem's own official client:
Anthropic Messages (`anthropic`), Ollama (`ollama`). Every answer must be the Chat Completions path's
answer (the same engine path: template, tools, grammar, reuse; for Ollama, with Ollama's default penalties
sent as llama.cpp's repeat_penalty / repeat_last_n), later turns of a conversation must
reuse the KV (cache_read_input_tokens / a prompt_eval_count below the prompt), errors come in each
API's own shape, and fuzzed bodies to every endpoint never get a 5xx.
"""
from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_proc import serving

KEY = "sk-apis-test"
MODEL = "smollm2-135m"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
T0 = {"temperature": 0}      # this SDK has no sampling parameters: sent as extra fields, as Anthropic accepts them
OLLAMA_DEFAULT = {"repeat_penalty": 1.1, "repeat_last_n": 64}   # Ollama's default penalties (llama.cpp's scope)
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a river there.", "How long is it?",
             "Thanks. One more fact?"]


@pytest.fixture(scope="module")
def server():
    yield from serving("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "2", "--api-key", KEY)


def openai_c(s):
    from openai import OpenAI
    return OpenAI(base_url=s.v1, api_key=KEY, max_retries=0, timeout=300)


def anthropic_c(s):
    import anthropic
    return anthropic.Anthropic(base_url=s.base, api_key=KEY, max_retries=0, timeout=300)   # sends x-api-key


def ollama_c(s):
    import ollama
    return ollama.Client(host=s.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


def chat_text(s, messages, max_tokens=24, **kw) -> str:
    r = openai_c(s).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                            **kw)
    return r.choices[0].message.content


# ---- Anthropic --------------------------------------------------------------------------------------

def test_anthropic_text_streamed_and_whole(server):
    c = anthropic_c(server)
    msgs = [{"role": "user", "content": "Say hello to the world."}]
    r = c.messages.create(model=MODEL, max_tokens=24, messages=msgs, system="Be brief.", extra_body=T0)
    assert r.type == "message" and r.role == "assistant" and r.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == chat_text(server, [{"role": "system", "content": "Be brief."}] + msgs)
    assert r.usage.output_tokens > 0 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 10
    with c.messages.stream(model=MODEL, max_tokens=24, messages=msgs, system="Be brief.", extra_body=T0) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.usage.output_tokens == r.usage.output_tokens
    count = c.messages.count_tokens(model=MODEL, messages=msgs, system="Be brief.")
    assert count.input_tokens == r.usage.input_tokens + r.usage.cache_read_input_tokens


def test_anthropic_conversation_reuses_and_matches_chat_completions(server):
    c = anthropic_c(server)
    msgs: list[dict] = []
    for i, q in enumerate(QUESTIONS):
        msgs.append({"role": "user", "content": q})
        r = c.messages.create(model=MODEL, max_tokens=16, messages=msgs, extra_body=T0)
        text = "".join(b.text for b in r.content if b.type == "text")
        assert text == chat_text(server, msgs, 16)
        if i:
            assert r.usage.cache_read_input_tokens > 0, f"turn {i} reused nothing"
        msgs.append({"role": "assistant", "content": text})


def test_anthropic_tool_round_trip(server):
    c = anthropic_c(server)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.messages.create(model=MODEL, max_tokens=60, messages=msgs, tools=[WEATHER], extra_body=T0,
                          tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and "city" in uses[0].input
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}]}]
    again = c.messages.create(model=MODEL, max_tokens=20, messages=msgs, tools=[WEATHER], extra_body=T0,
                              tool_choice={"type": "none"})
    assert again.content and again.usage.cache_read_input_tokens > 0
    with c.messages.stream(model=MODEL, max_tokens=60, messages=msgs[:1], tools=[WEATHER], extra_body=T0,
                           tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]


def test_anthropic_structured_output(server):
    c = anthropic_c(server)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    r = c.messages.create(model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "A city as JSON."}],
                          output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=T0)
    assert isinstance(json.loads(r.content[0].text)["city"], str)


def test_anthropic_structured_errors(server):
    import anthropic
    c = anthropic_c(server)
    with pytest.raises(anthropic.BadRequestError) as err:
        c.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="no-such-model", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])


# ---- Ollama -----------------------------------------------------------------------------------------

def test_ollama_chat_streamed_whole_and_options(server):
    c = ollama_c(server)
    msgs = [{"role": "user", "content": "Say hello to the world."}]
    opts = {"temperature": 0, "num_predict": 12, "seed": 1, "num_ctx": 4096}
    r = c.chat(model=MODEL, messages=msgs, options=opts, stream=False)
    assert r.done and r.message.role == "assistant" and r.eval_count <= 12
    assert r.message.content == chat_text(server, msgs, 12, extra_body=OLLAMA_DEFAULT)
    streamed = list(c.chat(model=f"{MODEL}:latest", messages=msgs, options=opts, stream=True))
    assert "".join(p.message.content for p in streamed) == r.message.content
    assert streamed[-1].done and streamed[-1].eval_count == r.eval_count
    js = c.chat(model=MODEL, messages=[{"role": "user", "content": "A JSON object with a name."}],
                format={"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                        "required": ["name"], "additionalProperties": False}, options={"temperature": 0, "num_predict": 40}, stream=False)
    assert isinstance(json.loads(js.message.content)["name"], str)


def test_ollama_conversation_reuses_and_tools(server):
    c = ollama_c(server)
    msgs: list[dict] = []
    for i, q in enumerate(QUESTIONS):
        msgs.append({"role": "user", "content": q})
        r = c.chat(model=MODEL, messages=msgs, options={"temperature": 0, "num_predict": 16}, stream=False)
        assert r.message.content == chat_text(server, msgs, 16, extra_body=OLLAMA_DEFAULT)
        prompt = openai_c(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1).usage.prompt_tokens
        if i:
            assert r.prompt_eval_count < prompt, f"turn {i} re-read its whole prompt"
        msgs.append({"role": "assistant", "content": r.message.content})
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}
    body = {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}], "tools": [tool],
        "options": {"temperature": 0, "num_predict": 12}}
    out = httpx.post(server.base + "/api/chat", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert out.status_code == 200 and out.json()["done"], out.text   # a call and its result in the history


def test_ollama_generate_tags_show_version_and_errors(server):
    import ollama
    c = ollama_c(server)
    g = c.generate(model=MODEL, prompt="The capital of France is", options={"temperature": 0, "num_predict": 8},
                   stream=False)
    assert g.done and g.response
    raw = c.generate(model=MODEL, prompt="The capital of France is", raw=True,
                     options={"temperature": 0, "num_predict": 8}, stream=False)
    ref = openai_c(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                              temperature=0, extra_body=OLLAMA_DEFAULT)
    assert raw.response == ref.choices[0].text
    assert [m.model for m in c.list().models] == [f"{MODEL}:latest"]
    shown = c.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama" and "completion" in shown.capabilities
    assert httpx.get(server.base + "/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert err.value.status_code == 404
    r = httpx.post(server.base + "/api/chat", json={"model": MODEL, "messages": [], "stream": False},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


# ---- hardening --------------------------------------------------------------------------------------

def test_deeply_nested_json_is_a_400(server):
    deep = "[" * 5000 + "]" * 5000
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat"):
        r = httpx.post(server.base + path, content=deep, headers={"Authorization": f"Bearer {KEY}",
                                                                  "Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text)
    nested = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {}}
    cur = nested["chat_template_kwargs"]
    for _ in range(100):
        cur["x"] = {}
        cur = cur["x"]
    r = httpx.post(server.v1 + "/chat/completions", json=nested, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=12)
_KEYS = ["model", "messages", "max_tokens", "stream", "tools", "tool_choice", "system", "options", "format", "prompt",
         "role", "content", "type", "text", "input", "stop_sequences", "temperature", "think", "raw", "name",
         "instructions", "previous_response_id", "max_output_tokens"]
_BODY = st.dictionaries(st.sampled_from(_KEYS), _JSON | st.just(MODEL) |
                        st.just([{"role": "user", "content": "hi"}]), max_size=6)
_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/api/chat",
          "/api/generate", "/api/show", "/v1/responses"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(_PATHS), body=_BODY)
def test_fuzzed_bodies_never_get_a_5xx(server, path, body):
    """Random JSON bodies (with real keys and a valid model/messages mixed in) to every POST endpoint:
    4xx or a bounded 200, never a 5xx. max_tokens is capped so a valid request stays short."""
    if isinstance(body.get("max_tokens"), int):
        body["max_tokens"] = min(max(body["max_tokens"], 1), 4)
    if path.startswith("/api/"):
        body.setdefault("options", {"num_predict": 4})
    elif path == "/v1/responses":
        body.setdefault("max_output_tokens", 4)
        if isinstance(body.get("max_output_tokens"), int):
            body["max_output_tokens"] = min(max(body["max_output_tokens"], 1), 4)
    else:
        body.setdefault("max_tokens", 4)
    r = httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])


def test_dialects_reshape_tool_calls_and_thinking():
    """The chat answer's tool calls and thinking in each API's own shape (pure: no server). A forced
    call through the server is in test_anthropic_tool_round_trip; Ollama's `format` cannot force one."""
    from ternlm.server.anthropic import MessagesDialect
    from ternlm.server.ollama import OllamaDialect
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "", "reasoning_content": "need weather", "tool_calls": [call]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 20}},
        "timings": {"prompt_n": 10, "prompt_ms": 5.0, "predicted_ms": 9.0}}
    o = OllamaDialect(MODEL).response(body)
    assert o["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": {"city": "paris"}}}]
    assert o["message"]["thinking"] == "need weather" and o["done"] and o["prompt_eval_count"] == 10
    a = MessagesDialect(MODEL).response(body)
    assert [b["type"] for b in a["content"]] == ["thinking", "tool_use"] and a["stop_reason"] == "tool_use"
    assert a["content"][1]["input"] == {"city": "paris"}
    assert a["usage"] == {"input_tokens": 10, "output_tokens": 9, "cache_read_input_tokens": 20,
                          "cache_creation_input_tokens": 0}
