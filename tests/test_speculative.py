"""Speculative decoding (issue 48): prompt lookup drafts, verified as ordinary rows, can cost time but never change
an answer. Oracle: the same engine with speculation off (plain one-token decoding, itself tested against
transformers elsewhere), token for token and logits bit for bit, greedy and seeded sampling; the slot's record
after a run must describe exactly its KV (a fresh prefill of the record gives the same KV), so rejected draft rows
leave nothing a later turn could reuse.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from test_batching import alone, together
from test_reuse import assert_record_matches_kv
from tiny import tiny_engine
from ternlm.engine.spec.drafter import MAX_DRAFT, PromptLookup
from ternlm.engine.core import Engine
from ternlm.text.grammar import GrammarSpec
from ternlm.kv.store import CacheConfig
from ternlm.engine.sampling import Penalties


# the KV formats: auto (fp32 here) and q8_0 (int8 codes + fp16 scales; its rows need a head_dim that is a
# multiple of 32, hence head_dim 32, and seed 5: a model whose looping answer takes most drafts, as seed 1's
# does with head_dim 16). Speculation on and off, and every oracle engine, use the same format and model.
KVS = {"auto": dict(seed=1), "q8_0": dict(seed=5, kv_dtype="q8_0", head_dim=32)}


def _kv(engine) -> dict:
    """tiny_engine's arguments for another engine with `engine`'s KV format (and model)."""
    return KVS["q8_0"] if engine.kv_dtype == "q8_0" else KVS["auto"]


@pytest.fixture(scope="module", params=list(KVS))
def engine(request):
    e = tiny_engine("llama", dtype=torch.float32, min_reuse=1, chunk_size=16, slots=6, **KVS[request.param])[1]
    assert e.kv_dtype == {"auto": "float32"}.get(request.param, request.param)
    return e


def _looping(engine, n: int = 40) -> list[int]:
    """A prompt whose greedy answer repeats it: the tiny random model's own answer to [5, 6, 7], then [5, 6, 7]
    again (drafts are found and accepted: the property tests are not vacuous)."""
    base = engine.generate([5, 6, 7], max_tokens=n, ignore_eos=True, speculative=False).token_ids
    return [5, 6, 7] + base + [5, 6, 7]


# ---- the drafter alone ------------------------------------------------------------------------------
def test_lookup_drafts_what_followed_the_latest_earlier_occurrence():
    d = PromptLookup([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 8])
    d.extend([1, 2, 3])
    assert d.draft(3) == [5, 6, 7]            # the latest earlier "1 2 3" (not the first one, not itself)
    assert d.draft(0) == [] and PromptLookup([4, 4]).draft(5) == []   # no room; a 1-gram is too weak a guess
    d.extend([42, 43])
    assert d.draft(8) == []                   # nothing to look up


def test_draft_length_adapts_and_pauses_after_misses():
    d = PromptLookup(list(range(100)) * 2)
    first = len(d.draft(100))
    d.verified(first, first)
    assert len(d.draft(100)) == min(MAX_DRAFT, 2 * first)   # taken whole: twice as long
    d.verified(8, 2)
    assert len(d.draft(100)) == 3                           # one more than what was taken
    for _ in range(3):
        d.verified(3, 0)
    assert d.draft(100) == []                               # three misses in a row: a pause
    d.extend(list(range(8)))
    assert d.draft(100) != []                               # ... for a few tokens only


# ---- lossless, alone and batched -------------------------------------------------------------------
def _both(engine, prompt, max_tokens, **kw):
    off, _ = alone(engine, prompt, max_tokens, speculative=False, **kw)
    on, slot = alone(engine, prompt, max_tokens, speculative=True, **kw)
    assert on.token_ids == off.token_ids and on.text == off.text and on.finish_reason == off.finish_reason
    assert torch.equal(on.logits, off.logits)
    assert_record_matches_kv(engine, slot)
    return on, off


# every penalty, in both scopes (sampling.Penalties): a verify row counts exactly the tokens before its position
PENALTIES = {"repetition": Penalties(repetition=1.3), "frequency": Penalties(frequency=0.6),
             "presence": Penalties(presence=0.8), "llama.cpp": Penalties(1.1, 0.2, 0.3, last_n=16)}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 11},
                                      {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "seed": 3},
                                      *({"penalties": p} for p in PENALTIES.values()),
                                      *({"penalties": p, "temperature": 0.8, "top_p": 0.95, "seed": 5}
                                        for p in PENALTIES.values())],
                         ids=["greedy", "seeded", "filtered", *(f"greedy-{k}" for k in PENALTIES),
                              *(f"seeded-{k}" for k in PENALTIES)])
def test_same_answer_on_and_off_and_drafts_are_taken(engine, sampling):
    on, off = _both(engine, _looping(engine), 60, **sampling)
    assert off.timings.drafted == 0
    if not sampling:       # greedy on a repeating answer: most drafts are the model's own tokens
        assert on.timings.accepted >= 20 and on.timings.accepted <= on.timings.drafted
    if "penalties" in sampling:   # not vacuous: the penalty changed the answer, and drafts were verified
        plain = {k: v for k, v in sampling.items() if k != "penalties"}
        assert alone(engine, _looping(engine), 60, speculative=False, **plain)[0].token_ids != on.token_ids
        if "seed" not in sampling:   # (sampled answers with a penalty rarely repeat: nothing to look up)
            assert on.timings.drafted > 0


segments = st.lists(st.integers(3, 255), min_size=2, max_size=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(head=segments, seg=segments, reps=st.integers(1, 4), temperature=st.sampled_from([0.0, 0.7, 1.5]),
       seed=st.integers(0, 2**31), max_tokens=st.integers(1, 40),
       penalty=st.sampled_from([None, *PENALTIES]))
def test_any_prompt_any_temperature_same_answer(engine, head, seg, reps, temperature, seed, max_tokens, penalty):
    """Prompts with repeated segments (so lookup finds drafts), answers of any length (drafts cut by
    max_tokens), greedy and seeded sampling, with and without each penalty."""
    _both(engine, head + seg * reps + seg[:1], max_tokens, temperature=temperature, seed=seed,
          penalties=PENALTIES[penalty] if penalty else None)


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalized_streams_batched_and_speculating_answer_as_alone_and_plain(engine, penalty):
    """Penalties in a batch where lookup drafts (greedy: a sampled answer with a penalty rarely repeats, and the
    property test above covers seeded ones): each answer equals its plain decode alone."""
    loop = _looping(engine)
    reqs = [(loop, 40), (list(range(3, 60)), 12), (loop[:20] + loop, 30)]
    kw = {"penalties": PENALTIES[penalty]}
    solo = [alone(engine, p, m, speculative=False, **kw)[0] for p, m in reqs]
    batched = together(engine, reqs, [0, 1, 3], budget=24, speculative=True, **kw)
    assert sum(b.timings.drafted for b in batched) > 0
    for i, (b, a) in enumerate(zip(batched, solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i


def test_batched_with_other_streams_same_answers(engine):
    """Speculating streams batched with plain ones and prefills give each one's answer alone, spec off."""
    loop = _looping(engine)
    reqs = [(loop, 40), (list(range(3, 60)), 12), (loop[:20] + loop, 30), ([9, 8, 7] * 9, 25)]
    solo = [alone(engine, p, m, speculative=False)[0] for p, m in reqs]
    batched = together(engine, reqs, [0, 1, 1, 4], budget=24, speculative=True)
    assert sum(b.timings.accepted for b in batched) > 0
    for i, (b, a) in enumerate(zip(batched, solo)):
        assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits), i
        assert_record_matches_kv(engine, engine.slots[i + 1])


def test_the_next_turn_reuses_exactly_what_was_kept(engine):
    """After a speculative answer, the next turn (prompt + answer + more) reuses the record and answers as a
    cold engine would: rejected rows were never recorded."""
    cold = tiny_engine("llama", dtype=torch.float32, prefix_reuse=False, chunk_size=16, **_kv(engine))[1]
    prompt = _looping(engine)
    engine.slots[0].reset()
    one = engine.generate(prompt, max_tokens=30, ignore_eos=True, slot=0, speculative=True)
    assert one.timings.drafted > one.timings.accepted      # some rows were rejected and cut
    nxt = prompt + one.token_ids + [7, 7, 7]
    two = engine.generate(nxt, max_tokens=20, ignore_eos=True, slot=0, keep_logits=True)
    ref = cold.generate(nxt, max_tokens=20, ignore_eos=True, keep_logits=True, speculative=False)
    assert two.cached_tokens == len(prompt) + len(one.token_ids) - 1
    assert two.token_ids == ref.token_ids and torch.equal(two.logits, ref.logits)


@pytest.mark.parametrize("kv", list(KVS))
def test_restart_from_the_disk_tier_same_answer(tmp_path, kv):
    """A prefix served from the disk tier after a restart, speculation on: the answer of a cold engine, off."""
    cache = CacheConfig(ram_bytes=1 << 20, disk_dir=tmp_path / "kv", disk_bytes=64 << 20)
    kw = dict(dtype=torch.float32, min_reuse=1, chunk_size=16, cache=cache, **KVS[kv])
    first = tiny_engine("llama", **kw)[1]
    prompt = _looping(first, 90)
    first.generate(prompt, max_tokens=4, ignore_eos=True)
    assert first.persist_cache() > 0
    first.store.close(10)
    second = tiny_engine("llama", **kw)[1]
    try:
        on = second.generate(prompt + [5, 6], max_tokens=40, ignore_eos=True, keep_logits=True, speculative=True)
        assert on.restored.disk >= 64
        off = tiny_engine("llama", dtype=torch.float32, prefix_reuse=False, **KVS[kv])[1].generate(
            prompt + [5, 6], max_tokens=40, ignore_eos=True, keep_logits=True, speculative=False)
        assert on.token_ids == off.token_ids and torch.equal(on.logits, off.logits)
    finally:
        second.store.close(10)


# ---- logit_bias -----------------------------------------------------------------------------------
def test_logit_bias_applies_on_every_row_and_is_the_same_on_and_off(engine):
    prompt = _looping(engine)
    plain, _ = alone(engine, prompt, 30, speculative=False)
    banned = plain.token_ids[3]
    on, off = _both(engine, prompt, 30, logit_bias={banned: -100.0})
    assert banned not in on.token_ids
    forced, _ = alone(engine, prompt, 5, logit_bias={17: 100.0}, speculative=True)
    assert forced.token_ids == [17] * 5
    with pytest.raises(ValueError, match="vocabulary"):
        engine.open(prompt, logit_bias={10**6: 1.0})
    with pytest.raises(ValueError, match="-100, 100"):
        engine.open(prompt, logit_bias={3: 101.0})


# ---- a real model: grammar masks on every verify row, and what lookup buys on code -------------------
@pytest.fixture(scope="module")
def smollm2():
    return Engine.load("smollm2-135m", min_reuse=1)    # what users run: GGUF blocks, int8 activations, layer.c


CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return area(self.width, self.height)
"""


def test_code_editing_on_a_real_model_same_text(smollm2):
    """smollm2 asked to repeat a file with a rename: its answer quotes the file, lookup drafts from it; the text
    is plain decoding's, greedy and sampled. (How much this buys: `ternlm bench spec`.)"""
    e = smollm2
    msgs = [{"role": "user", "content": "Repeat this code exactly, renaming Rectangle to Box:\n\n" + CODE}]
    ids = list(e.apply_chat_template(msgs, add_generation_prompt=True))
    on, _ = _both(e, ids, 120)
    assert on.timings.accepted > 0, on.timings
    _both(e, ids, 80, temperature=0.7, seed=2)


def test_json_schema_mask_on_every_verify_row(smollm2):
    e = smollm2
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                        "maxItems": 3}},
              "required": ["name", "tags"], "additionalProperties": False}
    example = json.dumps({"name": "ternlm", "tags": ["fast", "exact"]})
    msgs = [{"role": "user", "content": f"Return this JSON object again: {example}\nAnd once more: {example}"}]
    ids = list(e.apply_chat_template(msgs, add_generation_prompt=True))
    for sampling in ({}, {"temperature": 0.8, "seed": 5}):
        on, off = _both(e, ids, 60, grammar=GrammarSpec("json_schema", json.dumps(schema)), **sampling)
        if on.finish_reason == "stop":
            json.loads(on.text)


def test_tool_call_grammar_on_every_verify_row(smollm2):
    """tool_choice "required"'s grammar (tools.call_grammar: a Hermes-style <tool_call> holding a JSON call) masks
    every verify row: speculation on == off, greedy and seeded; the prompt shows the call twice, so lookup drafts
    it and the grammar judges drafted rows."""
    from ternlm.text.tools import call_grammar, prepare, supports_tools
    e = smollm2
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    msgs = [{"role": "user", "content": f"Call the tool like this: {call}\nNow do it again for Paris: {call}"}]
    native = supports_tools(e.chat_template)
    rendered, extra = prepare(msgs, tools, native)
    ids = list(e.apply_chat_template(rendered, add_generation_prompt=True, **extra))
    grammar = call_grammar(tools, None, False, e.tokenizer)
    for sampling in ({}, {"temperature": 0.8, "seed": 7}):
        on, _ = _both(e, ids, 60, grammar=grammar, **sampling)
        if not sampling:
            assert on.timings.drafted > 0, on.timings


# ---- through the server, with the official client ----------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from server_proc import serving
    yield from serving("-m", "smollm2-135m", "--threads", "1", "--slots", "2")


def test_server_speculates_by_default_same_text_and_reports_it(server):
    import httpx
    from openai import BadRequestError
    from server_proc import openai_client
    c = openai_client(server)
    msgs = [{"role": "user", "content": "Repeat this code exactly, renaming Rectangle to Box:\n\n" + CODE}]
    on = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=60, temperature=0)
    off = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=60, temperature=0,
                                    extra_body={"speculative": False})
    assert on.choices[0].message.content == off.choices[0].message.content
    t_on, t_off = on.model_extra["timings"], off.model_extra["timings"]
    assert t_on["draft_n"] >= t_on["draft_n_accepted"] > 0 and t_off["draft_n"] == 0
    forced = c.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logit_bias={"28": 100})   # OpenAI's form: {"token id": bias}
    assert forced.choices[0].text == "," * 6 and forced.usage.completion_tokens == 6   # token 28 is ","
    with pytest.raises(BadRequestError) as bad:
        c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=2, logit_bias={"99999999": 1})
    assert bad.value.body["param"] == "logit_bias"
    with pytest.raises(BadRequestError):
        c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=2, logit_bias={"28": 500})
    text = httpx.get(server.base + "/metrics").text
    assert "ternlm_spec_drafted_tokens_total" in text and "ternlm_spec_accepted_tokens_total" in text


def test_serve_flags_reach_the_engine(server):
    """`ternlm serve --speculative off --activations int8`: no request drafts, and the fingerprint (the KV
    namespace: activations are part of it) differs from the default server's (fp32 activations: auto's choice for
    this 135M model, weights.py [SMALL-FP32])."""
    from server_proc import ServerProc, openai_client
    with ServerProc("-m", "smollm2-135m", "--threads", "1", "--slots", "1",
                    "--speculative", "off", "--activations", "int8") as off:
        msgs = [{"role": "user", "content": "Repeat this code exactly:\n\n" + CODE}]
        a = openai_client(off).chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=40,
                                                      temperature=0)
        b = openai_client(server).chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=40,
                                                         temperature=0)
        assert a.model_extra["timings"]["draft_n"] == 0 and b.model_extra["timings"]["draft_n"] > 0
        assert a.system_fingerprint != b.system_fingerprint
        assert "Traceback" not in off.log()
