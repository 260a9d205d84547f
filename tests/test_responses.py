"""OpenAI's Responses API through a real `ternlm serve`, with the official `openai` client.

Every answer must be the Chat Completions path's answer for the same messages (one engine path); a
conversation chained by previous_response_id sends only its new input and reuses the stored
conversation's KV (cached_tokens covers the previous turn's whole input); stored responses belong to
their API key (another key gets 404) and do not survive a restart (stated in responses.py). Every
body the server sends must parse as the SDK's own types (Response, ResponseStreamEvent).
"""
from __future__ import annotations

import json
import time

import httpx2 as httpx
import pytest
from pydantic import TypeAdapter

from server_proc import ServerProc, serving
from ternlm.server.responses import ResponseStore, Stored, to_chat

K1, K2 = "sk-resp-one", "sk-resp-two"
MODEL = "smollm2-135m"
ARGS = ("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "2", "--api-key", K1, K2)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a river there.", "How long is it?",
             "Which sea does it reach?", "Name a fish in it.", "Is it tasty?", "How is it cooked?",
             "What wine goes with it?", "Thanks. One more fact?"]


@pytest.fixture(scope="module")
def server():
    yield from serving(*ARGS)


def client(s, key=K1):
    from openai import OpenAI
    return OpenAI(base_url=s.v1, api_key=key, max_retries=0, timeout=300)


def chat_text(s, messages, max_tokens) -> str:
    r = client(s).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def check_response(body: dict) -> None:
    """The body parses as the SDK's Response, strictly (not the SDK's lenient construct)."""
    from openai.types.responses import Response
    Response.model_validate(body)


def streamed(c, **kw):
    """(text deltas, the final response) of `create(stream=True)`: the last event's response, whether
    response.completed or response.incomplete (the SDK's stream helper only finishes on the former)."""
    deltas, last = [], None
    for e in c.responses.create(stream=True, **kw):
        if e.type == "response.output_text.delta":
            deltas.append(e.delta)
        last = e
    assert last.type in ("response.completed", "response.incomplete")
    return deltas, last.response


def raw_events(s, body: dict) -> list[tuple[str, dict]]:
    """A streamed response as (event name, data) pairs, read off the wire."""
    out, name = [], None
    with httpx.stream("POST", s.v1 + "/responses", json={**body, "stream": True}, timeout=300,
                      headers={"Authorization": f"Bearer {K1}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
                name = None
    return out


# ---- pure parts: the store and the request mapping ----------------------------------------------

def _stored(rid: str, tenant: str = "", text: str = "x") -> Stored:
    return Stored(tenant, {"id": rid, "text": text}, [{"role": "user", "content": text}], rid)


def test_store_bounds_count_bytes_expiry_and_tenants():
    s = ResponseStore(max_items=3, max_bytes=10_000, ttl_s=60)
    for i in range(4):
        s.put(_stored(f"r{i}"))
    assert s.get("", "r0") is None and s.get("", "r1") is not None        # oldest dropped at the count bound
    s.put(_stored("r4"))                                                   # r1 was just used: r2 goes
    assert s.get("", "r2") is None and s.get("", "r1") is not None
    s.put(_stored("big", text="y" * 20_000))                              # larger than the whole budget
    assert s.get("", "big") is None and s.get("", "r1") is not None
    s.put(_stored("mine", tenant="a"))
    assert s.get("b", "mine") is None and not s.delete("b", "mine") and s.get("a", "mine") is not None
    assert s.delete("a", "mine") and s.get("a", "mine") is None
    s.ttl_s = 0.05
    time.sleep(0.1)
    assert s.get("", "r1") is None                                         # expired


def test_request_mapping():
    plan = to_chat({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"}],
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "max_output_tokens": 9}, None, "resp_a", "m")
    assert plan.chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert plan.history == plan.chat["messages"][1:]                    # instructions are not stored
    assert plan.chat["response_format"] == {"type": "json_schema",
                                            "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True}}
    assert plan.chat["max_completion_tokens"] == 9 and plan.chat["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert plan.chat["prompt_cache_key"].endswith("resp_a") and plan.root == "resp_a"
    prev = Stored("", {"id": "resp_a"}, plan.history, "resp_a")
    nxt = to_chat({"model": "m", "input": "more"}, prev, "resp_b", "m")
    assert nxt.chat["messages"] == plan.history + [{"role": "user", "content": "more"}]
    assert nxt.root == "resp_a" and nxt.chat["prompt_cache_key"] == plan.chat["prompt_cache_key"]


# ---- through the server -------------------------------------------------------------------------

def test_text_whole_and_streamed(server):
    c = client(server)
    kw = dict(model=MODEL, instructions="Be brief.", input="Say hello to the world.", max_output_tokens=24,
              temperature=0)
    r = c.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat_text(server, [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Say hello to the world."}], 24)
    u = r.usage
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens > 10
    assert r.instructions == "Be brief." and r.max_output_tokens == 24 and r.store is True
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 24
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    check_response(got.model_dump(mode="json", by_alias=True, exclude_unset=True))

    deltas, final = streamed(c, **kw)
    assert "".join(deltas) == r.output_text == final.output_text and final.status == r.status
    assert final.usage.output_tokens == u.output_tokens and final.output[0].status == r.output[0].status
    assert c.responses.retrieve(final.id).output_text == r.output_text       # a streamed one is stored too

    events = raw_events(server, {**kw, "max_output_tokens": 12})
    from openai.types.responses import ResponseStreamEvent
    adapter = TypeAdapter(ResponseStreamEvent)
    for i, (name, data) in enumerate(events):
        assert name == data["type"] and data["sequence_number"] == i
        adapter.validate_python(data)
    kinds = [d["type"] for _, d in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    last = events[-1][1]["response"]
    check_response(last)
    assert last["output"][0]["content"][0]["text"] == "".join(
        d["delta"] for _, d in events if d["type"] == "response.output_text.delta")


def test_function_tool_round_trip(server):
    c = client(server)
    forced = {"type": "function", "name": "get_weather"}
    r = c.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                           tool_choice=forced, max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments) and calls[0].call_id and calls[0].status == "completed"
    assert r.tool_choice.name == "get_weather" and r.tools[0].name == "get_weather"
    again = c.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                               input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                       "output": "sunny, 21 C"}], max_output_tokens=20, temperature=0)
    assert again.output_text and again.previous_response_id == r.id
    assert again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    with c.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                            tool_choice=forced, max_output_tokens=60, temperature=0) as stream:
        argument_deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [o.arguments for o in streamed] == [calls[0].arguments] == ["".join(argument_deltas)]


def test_structured_output(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    r = client(server).responses.create(model=MODEL, input="A city as JSON.", max_output_tokens=40, temperature=0,
                                        text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                         "strict": True}})
    assert isinstance(json.loads(r.output_text)["city"], str) and r.text.format.type == "json_schema"


def test_ten_turn_chain_sends_only_new_input_and_matches_chat_completions(server):
    """previous_response_id carries the conversation; `instructions` is sent each turn because OpenAI
    does not carry it over (a turn without it continues the conversation without a system message)."""
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}]
    prev = None
    for i, q in enumerate(QUESTIONS):
        kw = dict(model=MODEL, instructions="Be brief.", input=q, max_output_tokens=16, temperature=0,
                  previous_response_id=prev.id if prev else None)
        if i == 5:                               # one streamed turn: stored and continued like the others
            r = streamed(c, **kw)[1]
        else:
            r = c.responses.create(**kw)
        msgs.append({"role": "user", "content": q})
        assert r.output_text == chat_text(server, msgs, 16), f"turn {i} differs from Chat Completions"
        if prev is not None:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached >= prev.usage.input_tokens, f"turn {i}: cached {cached} < previous input"
            # prefilled: the previous answer's tail and this question with its template framing only
            assert r.usage.input_tokens - cached <= prev.usage.output_tokens + 40
        msgs.append({"role": "assistant", "content": r.output_text})
        prev = r
    assert c.responses.retrieve(prev.id).output_text == prev.output_text


def test_instructions_are_not_carried_over(server):
    c = client(server)
    first = c.responses.create(model=MODEL, instructions="Answer in French.", input="Name a colour.",
                               max_output_tokens=12, temperature=0)
    nxt = c.responses.create(model=MODEL, previous_response_id=first.id, input="Another one?",
                             max_output_tokens=12, temperature=0)
    assert nxt.instructions is None
    assert nxt.output_text == chat_text(server, [{"role": "user", "content": "Name a colour."},
                                                 {"role": "assistant", "content": first.output_text},
                                                 {"role": "user", "content": "Another one?"}], 12)


def test_get_delete_store_false_and_other_keys(server):
    import openai
    c, other = client(server), client(server, K2)
    r = c.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
    assert c.responses.retrieve(r.id).id == r.id
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.create(model=MODEL, input="more", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert c.responses.retrieve(r.id).id == r.id                 # another key's delete did nothing
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    assert err.value.param == "previous_response_id"
    unstored = c.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").responses.retrieve(r.id)


def test_unsupported_fields_are_clean_400s(server):
    import openai
    c = client(server)
    cases = [(dict(tools=[{"type": "web_search"}]), "tools[0].type"),
             (dict(extra_body={"conversation": "conv_1"}), "conversation"),
             (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
              "input[0].content[0]"),
             (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
             (dict(extra_body={"frobnicate": 1}), "frobnicate"),
             (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
             (dict(tool_choice={"type": "file_search"}), "tool_choice")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **kw})
        assert err.value.param == param and err.value.body["type"] == "invalid_request_error", (kw, err.value.body)


def test_a_restarted_server_forgets_stored_responses():
    """The store is in memory (responses.py): after a restart an old id is a 404; the client resends
    the conversation instead."""
    import openai
    s = ServerProc(*ARGS)
    try:
        s.start().wait_ready()
        r = client(s).responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
        assert client(s).responses.retrieve(r.id).id == r.id
        s.stop()
        s.start().wait_ready()
        with pytest.raises(openai.NotFoundError):
            client(s).responses.retrieve(r.id)
        assert "Traceback" not in s.log()
    finally:
        s.close()


# ---- reasoning: smollm2 under a Qwen3-style thinking template, a regex forcing <think>…</think>answer ----

TEMPLATE = __import__("pathlib").Path(__file__).parent / "data" / "thinking.jinja"
THINK_THEN_ANSWER = {"type": "regex",
                     "regex": r"<think>\n[a-z]{2,8}( [a-z]{2,8}){8,14}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){2,5}"}


def test_reasoning_items_whole_streamed_and_continued():
    with ServerProc("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "1",
                    "--chat-template", str(TEMPLATE)) as s:
        c = client(s, "unused")
        long = "You are brief. " * 20          # past --min-reuse: the next turn's reuse shows
        kw = dict(model=MODEL, instructions=long, input="Why is the sky blue?", max_output_tokens=120,
                  temperature=0, text={"format": THINK_THEN_ANSWER})
        r = c.responses.create(**kw)
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
        thought = r.output[0].content[0].text
        assert thought and "<think>" not in r.output_text and r.usage.output_tokens_details.reasoning_tokens > 8
        events = [e for e in c.responses.create(stream=True, **kw)]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        final = events[-1].response
        assert [o.type for o in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == thought
        body = final.model_dump(mode="json", by_alias=True, exclude_unset=True, warnings=False)
        check_response({**body, "text": {"format": {"type": "text"}}})    # the regex format is ternlm's own
        nxt = c.responses.create(model=MODEL, instructions=long, previous_response_id=final.id,
                                 input="And at night?", max_output_tokens=40, temperature=0)
        # the template drops an old turn's thinking: reuse runs to the re-rendered answer, all of the last input
        assert nxt.usage.input_tokens_details.cached_tokens == final.usage.input_tokens
        assert "Traceback" not in s.log()
