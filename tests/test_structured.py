"""Structured outputs through a real `ternlm serve` (smollm2-135m) and the official openai client.

Oracles: `json.loads` and `jsonschema` (Draft 2020-12) on every answer; the openai client's own
`beta.chat.completions.parse` with a pydantic model. Schemas cover nested objects, arrays, enums,
required fields, numbers with bounds, anyOf and $defs. Strings and arrays carry bounds (maxLength,
maxItems) as extraction schemas do: a 135M model at temperature 0 happily repeats an array item
forever, and an answer cut at max_tokens is not JSON whatever the grammar (finish_reason "length").
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

from server_proc import ServerProc, openai_client, serving

MODEL = "smollm2-135m"
S = {"type": "string", "maxLength": 24}

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
               "required": ["name", "age"], "additionalProperties": False},
    "enum_and_bool": {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["color", "bright"], "additionalProperties": False},
    "array_of_strings": {"type": "object", "properties": {
        "tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": S, "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["name", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "defs_and_anyof": {"$defs": {"pet": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "name": S}, "required": ["kind", "name"], "additionalProperties": False}},
        "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"},
                                         "note": {"anyOf": [{"type": "null"}, S]}},
        "required": ["pet", "note"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                        "minItems": 2, "maxItems": 4},
    "const_and_optional": {"type": "object", "properties": {
        "version": {"const": 2}, "title": S, "draft": {"type": "boolean"}},
        "required": ["version", "title"], "additionalProperties": False},
}
PROMPT = "Answer with JSON only. Describe something from everyday life."


@pytest.fixture(scope="module")
def server():
    yield from serving("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "4")


client = openai_client


def ask(c: OpenAI, schema: dict, name: str, **kw):
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_validate(server, temperature):
    c = client(server)
    jobs = [(name, schema, seed) for name, schema in SCHEMAS.items() for seed in ((0,) if temperature == 0 else (3, 4))]
    with ThreadPoolExecutor(4) as pool:   # 4 slots: the masks of 4 requests share every batched step
        outs = list(pool.map(lambda j: ask(c, j[1], j[0], temperature=temperature, seed=j[2]), jobs))
    for (name, schema, _), r in zip(jobs, outs):
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (name, ch.message.content)
        jsonschema.validate(json.loads(ch.message.content), schema)


def test_json_object_mode_streamed_and_not(server):
    c = client(server)
    # json_object bounds nothing: a prompt that names the keys keeps a 135M model from rambling
    msgs = [{"role": "user", "content": 'Reply with a JSON object with keys "name" and "age" for a cat.'}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=300, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"}, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == r.choices[0].message.content    # same request, same greedy answer, streamed


class Item(BaseModel):
    name: str = Field(max_length=20)
    price: float = Field(ge=0, le=1000)


class Order(BaseModel):
    customer: str = Field(max_length=20)
    items: list[Item] = Field(max_length=2)
    express: bool


def test_openai_parse_with_pydantic_model(server):
    c = client(server)
    r = c.beta.chat.completions.parse(model=MODEL, response_format=Order, max_tokens=200, temperature=0,
                                      messages=[{"role": "user", "content": "An order for two books, as JSON."}])
    order = r.choices[0].message.parsed
    assert isinstance(order, Order)
    assert r.usage.completion_tokens > 0 and r.choices[0].finish_reason == "stop"


def test_regex_and_grammar_extensions_on_completions(server):
    c = client(server)
    r = c.completions.create(model=MODEL, prompt="The date today is", max_tokens=20, temperature=0,
                             extra_body={"response_format": {"type": "regex", "regex": r"\d{4}-\d{2}-\d{2}"}})
    assert __import__("re").fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text), r.choices[0].text
    lark = 'start: "yes" | "no"'
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                  max_tokens=5, temperature=0.7, seed=3,
                                  extra_body={"response_format": {"type": "grammar", "grammar": lark}})
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}},                                     # a type that does not exist
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},   # no name
    {"type": "regex", "regex": "(unclosed"},
    {"type": "grammar", "grammar": "start: undefined_rule"},
    {"type": "xml"},
])
def test_bad_response_format_is_400(server, fmt):
    with pytest.raises(BadRequestError) as e:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, response_format=fmt)
    assert e.value.response.json()["error"]["param"] == "response_format"


def test_grammar_mask_touches_only_its_own_row_in_a_batch():
    """A constrained request batched with unconstrained ones: every request's tokens equal its
    tokens alone (the mask is per Sequence, applied to a copy of its own logits row)."""
    from ternlm.engine.core import Engine
    from ternlm.text.grammar import GrammarSpec
    from ternlm.engine.sequence import Completion
    from ternlm.engine.step_plan import plan_step
    e = Engine.load(MODEL, dtype="float32", slots=4, prefix_reuse=False)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["nested"]))
    prompts = [e.apply_chat_template([{"role": "user", "content": t}]) for t in
               (PROMPT, "Name three fruits.", "Count to five.", PROMPT)]
    kws = [{"grammar": spec}, {}, {"temperature": 0.8, "seed": 5}, {"grammar": spec, "temperature": 0.8, "seed": 7}]
    alone = [e.generate(p, max_tokens=40, slot=0, **kw).token_ids for p, kw in zip(prompts, kws)]
    seqs = [e.open(p, max_tokens=40, slot=i, **kw) for i, (p, kw) in enumerate(zip(prompts, kws))]
    done: dict[int, list[int]] = {}
    while len(done) < len(seqs):
        live = [i for i in range(len(seqs)) if i not in done]
        counts = plan_step([e.want(seqs[i]) for i in live], 64, e.chunk_size)
        work = [(i, c) for i, c in zip(live, counts) if c > 0]
        for (i, _), out in zip(work, e.step([(seqs[i], c) for i, c in work])):
            assert out.error is None, out.error
            done.update({i: ev.token_ids for ev in out.events if isinstance(ev, Completion)})
    assert [done[i] for i in range(len(seqs))] == alone
    jsonschema.validate(json.loads(e.tokenizer.decode(alone[0])), SCHEMAS["nested"])


def test_n_choices_each_constrained(server):
    r = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=200, temperature=0.9, seed=11, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:     # one grammar state per choice: forks share the prompt's KV, not the matcher
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMAS["person"])


@pytest.mark.slow
def test_json_schema_on_qwen():
    """The same schemas on qwen2.5-coder-0.5b (151k vocabulary, special tokens in the grammar tokenizer)."""
    s = ServerProc("-m", "qwen2.5-coder-0.5b", "--dtype", "float32", "--threads", "1", "--slots", "4")
    try:
        s.start().wait_ready()
        c = client(s)
        names = ["person", "nested", "array_of_objects", "defs_and_anyof"]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda n: c.chat.completions.create(
                model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": PROMPT}], max_tokens=200,
                temperature=0.7, seed=1,
                response_format={"type": "json_schema", "json_schema": {"name": n, "schema": SCHEMAS[n]}}), names))
        for n, r in zip(names, outs):
            assert r.choices[0].finish_reason == "stop", (n, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[n])
    finally:
        s.close()
