"""Speculation under grammars, drawn by hypothesis (issue 48's done-when: >= 200 prompts with json_schema and with
tools, with prompt lookup and with a draft model, alone and batched). Oracle: the same engine with speculation off,
token for token and logits bit for bit; a rejected row must leave nothing in the slot's record (its KV equals a
fresh prefill of the record).

The models are tiny random llamas (tests/tiny.py) wearing smollm2-135m's real tokenizer (49,152 tokens), so
llguidance compiles real json_schema and tool-call grammars over a real vocabulary while a step costs a
millisecond: 200 examples a test fit in a minute or two. A random model answers nothing sensible, but under a
grammar its answer still walks the schema's forced tokens, which the prompt holds (lookup drafts them) and which
the draft model (the target's weights plus noise) mostly agrees on: drafts are taken and rejected (checked by
`test_drafts_are_taken_and_rejected_under_a_grammar`, so the property tests are not vacuous).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from test_batching import alone, together
from test_reuse import assert_record_matches_kv
from tiny import tiny_loaded
from ternlm.engine.spec.draft_model import DraftModel
from ternlm.engine.core import Engine
from ternlm.text.grammar import GrammarSpec
from ternlm.text.tools import call_grammar

KW = dict(dtype=torch.float32, min_reuse=1, chunk_size=16, slots=4)


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    from ternlm.text.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_gguf)


def _tiny(tokenizer, seed: int, noise: float = 0.0):
    _, loaded = tiny_loaded("llama", seed=seed, vocab=tokenizer.vocab_size)
    if noise:
        g = torch.Generator().manual_seed(0)
        for v in loaded.weights.values():
            v.add_(torch.randn(v.shape, generator=g) * noise * v.std())
    return dataclasses.replace(loaded, tokenizer=tokenizer, sha256=f"tiny-smollm2-tok:{seed}:{noise}")


@pytest.fixture(scope="module")
def engines(tokenizer):
    """{"lookup": prompt lookup drafts, "model": a near draft model drafts} on the same target weights."""
    draft = Engine(_tiny(tokenizer, 1, noise=0.02), **KW, speculative=False)
    return {"lookup": Engine(_tiny(tokenizer, 1), **KW),
            "model": Engine(_tiny(tokenizer, 1), **KW, draft=DraftModel(draft))}


def _same(engine: Engine, prompt: list[int], max_tokens: int, batched: bool, **kw):
    """Speculation off alone vs on (alone, or batched with a second stream that joins a step later and speculates
    under the same grammar): the same tokens, logits and finish; every used slot's record describes its KV."""
    off, _ = alone(engine, prompt, max_tokens, speculative=False, **kw)
    if batched:
        other = prompt[len(prompt) // 2:]
        on, _ = together(engine, [(prompt, max_tokens), (other, max_tokens)], [0, 1], budget=24,
                         speculative=True, **kw)
        slots = engine.slots[1:3]
    else:
        on, slot = alone(engine, prompt, max_tokens, speculative=True, **kw)
        slots = [slot]
    assert on.token_ids == off.token_ids and on.text == off.text and on.finish_reason == off.finish_reason
    assert torch.equal(on.logits, off.logits)
    for s in slots:
        assert_record_matches_kv(engine, s)
    if isinstance(engine.drafts, DraftModel):
        small = engine.drafts.engine
        for s in slots:
            assert_record_matches_kv(small, small.slots[s.index])
    return on


# ---- json_schema -----------------------------------------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "count": {"type": "integer"},
                                      "ok": {"type": "boolean"}},
     "required": ["unit", "count", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number"}, "maxItems": 6},
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},   # a free string
]
words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz XYZ019", max_size=12)


def _example(i: int, draw_name: str, draw_tags: list[str], n: int) -> str:
    """An instance of SCHEMAS[i] built from drawn parts: the prompt shows it twice, so lookup drafts it."""
    if i == 0:
        return json.dumps({"name": draw_name[:20], "tags": [t[:8] for t in draw_tags[:3]]})
    if i == 1:
        return json.dumps({"unit": ["celsius", "fahrenheit"][n % 2], "count": n, "ok": n % 3 == 0})
    if i == 2:
        return json.dumps([n, n / 4, -n][: 1 + n % 3])
    return json.dumps({"text": " ".join([draw_name] + draw_tags)})


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                            HealthCheck.function_scoped_fixture])


@PROPERTY
@given(which=st.integers(0, len(SCHEMAS) - 1), name=words, tags=st.lists(words, max_size=4),
       n=st.integers(0, 10_000), lead=words, drafter=st.sampled_from(["lookup", "model"]), batched=st.booleans(),
       temperature=st.sampled_from([0.0, 0.0, 0.8, 1.3]), seed=st.integers(0, 2**31), max_tokens=st.integers(1, 32))
def test_json_schema_any_prompt_same_answer(engines, tokenizer, which, name, tags, n, lead, drafter, batched,
                                            temperature, seed, max_tokens):
    example = _example(which, name, tags, n)
    prompt = tokenizer.encode(f"{lead}\nReturn this JSON: {example}\nAgain: {example}\n", add_special_tokens=False)
    _same(engines[drafter], prompt, max_tokens, batched,
          grammar=GrammarSpec("json_schema", json.dumps(SCHEMAS[which])), temperature=temperature, seed=seed)


# ---- tools -----------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


def _call(tool: int, city: str, n: int) -> str:
    args = {"city": city[:24], "unit": "celsius"} if tool == 0 else {"a": n, "b": n // 7}
    name = TOOLS[tool]["function"]["name"]
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@PROPERTY
@given(tool=st.integers(0, 1), city=words, n=st.integers(-500, 500), only=st.booleans(), parallel=st.booleans(),
       drafter=st.sampled_from(["lookup", "model"]), batched=st.booleans(),
       temperature=st.sampled_from([0.0, 0.0, 0.8]), seed=st.integers(0, 2**31), max_tokens=st.integers(1, 40))
def test_tool_calls_any_prompt_same_answer(engines, tokenizer, tool, city, n, only, parallel, drafter, batched,
                                           temperature, seed, max_tokens):
    """tool_choice "required" (any tool, parallel or not) or a named function: the call grammar masks every row."""
    call = _call(tool, city, n)
    prompt = tokenizer.encode(f"Call the tool like this: {call}\nNow again: {call}\n", add_special_tokens=False)
    grammar = call_grammar(TOOLS, TOOLS[tool]["function"]["name"] if only else None, parallel, tokenizer)
    _same(engines[drafter], prompt, max_tokens, batched, grammar=grammar, temperature=temperature, seed=seed)


def test_drafts_are_taken_and_rejected_under_a_grammar(engines, tokenizer):
    """Not vacuous: both drafters' drafts are verified under the grammar, some kept, some cut (summed over a few
    prompts and schemas 0 and 3). The draft model drafts without the grammar (draft_model.py), so where the
    grammar leaves the target few choices (schema 0's short strings) it is mostly rejected; in a free string
    (schema 3) it agrees often. Lookup drafts what the grammar forces first ([FORCED-DRAFT]), always taken here."""
    for drafter, engine in engines.items():
        drafted = accepted = 0
        for which in (0, 3):
            spec = GrammarSpec("json_schema", json.dumps(SCHEMAS[which]))
            for name in ["", "hello", "ternlm", "abc abc abc"]:
                example = _example(which, name, ["fast", "exact"], 0)
                prompt = tokenizer.encode(f"Return: {example}\nAgain: {example}\n", add_special_tokens=False)
                on = _same(engine, prompt, 40, False, grammar=spec)
                drafted, accepted = drafted + on.timings.drafted, accepted + on.timings.accepted
        assert drafted > accepted > 0, (drafter, drafted, accepted)


def test_forced_tokens_are_drafted_without_any_example(engines, tokenizer):
    """[FORCED-DRAFT] a prompt that holds no JSON at all: lookup has nothing to find, yet the schema's keys and
    punctuation are drafted (the grammar forces them) and taken; the answer is plain decoding's."""
    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer"},
                                               "weather_description": {"enum": ["sunny", "cloudy"]}},
              "required": ["temperature_celsius", "weather_description"], "additionalProperties": False}
    prompt = tokenizer.encode("What is the weather like today in the city by the sea?", add_special_tokens=False)
    on = _same(engines["lookup"], prompt, 30, False, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    assert on.timings.accepted >= 8, on.timings          # {"temperature_celsius": ... "weather_description": "
    assert on.timings.accepted <= on.timings.drafted


# ---- no grammar, text prompts, both drafters ------------------------------------------------------------
@PROPERTY
@given(head=words, seg=words, reps=st.integers(1, 4), drafter=st.sampled_from(["lookup", "model"]),
       batched=st.booleans(), temperature=st.sampled_from([0.0, 0.7, 1.5]), seed=st.integers(0, 2**31),
       max_tokens=st.integers(1, 40))
def test_text_any_prompt_same_answer(engines, tokenizer, head, seg, reps, drafter, batched, temperature, seed,
                                     max_tokens):
    prompt = tokenizer.encode(head + seg * reps + seg[:3], add_special_tokens=False) or [42]
    _same(engines[drafter], prompt, max_tokens, batched, temperature=temperature, seed=seed)
