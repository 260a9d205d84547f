"""Penalties through the HTTP APIs: OpenAI's frequency/presence, vLLM's repetition_penalty, llama.cpp's
repeat_penalty / repeat_last_n, Ollama's options.

The sampler's arithmetic is tested against transformers and OpenAI's formula elsewhere (test_sampling*);
here: each API's fields reach it in the right scope. A unit part (no server) checks the Penalties each
request form builds, the conflict and range errors, and the Ollama mapping; a real `ternlm serve`
(smollm2-135m, greedy, short answers) is then talked to by the official `openai` and `ollama` clients. A
penalty that never reached the sampler fails here: on prompts that make smollm2 repeat itself, a strong
penalty must change the greedy answer, and two spellings of one penalty must give one answer.
"""
from __future__ import annotations

import httpx2 as httpx
import pytest

from server_proc import openai_client, serving
from ternlm.engine.sampling import Penalties
from ternlm.server import ollama as ollama_api
from ternlm.server import schemas
from ternlm.server.errors import APIError
from ternlm.server.responses import to_chat

MODEL = "smollm2-135m"
N = 12                                                    # answer length: enough to diverge, fast on 2 cores
REPEAT = [{"role": "user", "content": "Repeat the word 'cat' twenty times."}]
MAT = "The cat sat on the mat. The cat sat on the mat. The cat"   # a completions prompt smollm2 continues in kind
OLLAMA_DEFAULT = {"repeat_penalty": 1.1, "repeat_last_n": 64}    # Ollama's DefaultOptions, llama.cpp's scope


# ---- unit: the request -> Penalties --------------------------------------------------------------

def _chat(**kw):
    return schemas.parse(schemas.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


def _error(**kw) -> APIError:
    with pytest.raises(APIError) as err:
        _chat(**kw)
    assert err.value.status == 400 and set(err.value.body()["error"]) == {"message", "type", "param", "code"}
    return err.value


def test_each_form_builds_its_penalties():
    assert _chat().penalties == Penalties() and not _chat().penalties.active
    # OpenAI / vLLM: no window (repetition over prompt + answer, frequency/presence over the answer)
    assert _chat(frequency_penalty=0.5, presence_penalty=-1, repetition_penalty=1.3).penalties == \
        Penalties(1.3, 0.5, -1.0, None)
    # llama.cpp: naming repeat_penalty or repeat_last_n moves all three to its window (default 64)
    assert _chat(repeat_penalty=1.2).penalties == Penalties(1.2, 0.0, 0.0, 64)
    assert _chat(repeat_last_n=-1, frequency_penalty=1).penalties == Penalties(1.0, 1.0, 0.0, -1)
    assert _chat(repeat_penalty=1.5, repeat_last_n=0, presence_penalty=2).penalties == Penalties(1.5, 0.0, 2.0, 0)
    # vLLM's name with llama.cpp's window: the penalty the client sent, over that window (never dropped)
    assert _chat(repetition_penalty=1.3, repeat_last_n=8).penalties == Penalties(1.3, 0.0, 0.0, 8)
    assert _chat(repetition_penalty=1, repeat_penalty=1.2).penalties == Penalties(1.2, 0.0, 0.0, 64)
    # null is "the default", as for every OpenAI field
    assert _chat(repeat_penalty=None, repeat_last_n=None, frequency_penalty=None).penalties == Penalties()
    completion = schemas.parse(schemas.CompletionRequest, {"model": "m", "prompt": "x", "repeat_penalty": 1.1,
                                                            "frequency_penalty": 0.2})
    assert completion.penalties == Penalties(1.1, 0.2, 0.0, 64)


def test_conflict_and_ranges_are_400s_naming_the_param():
    conflict = _error(repetition_penalty=1.3, repeat_penalty=1.2)
    assert "repetition_penalty" in conflict.message and "repeat_penalty" in conflict.message
    for field, bad in [("frequency_penalty", 3), ("frequency_penalty", -2.5), ("presence_penalty", 2.01),
                       ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 11),
                       ("repeat_penalty", 0), ("repeat_last_n", -2), ("repeat_last_n", 1.5),
                       ("frequency_penalty", "1"), ("repeat_penalty", True)]:
        err = _error(**{field: bad})
        assert err.param == field and err.code == "invalid_value", (field, bad, err.body())


def test_responses_api_has_no_penalties():
    """OpenAI's Responses API has no penalty fields: an unknown field there, refused by name as OpenAI does."""
    for field in ("frequency_penalty", "presence_penalty", "repetition_penalty", "repeat_penalty"):
        with pytest.raises(APIError) as err:
            to_chat({"model": "m", "input": "hi", field: 1.5}, None, "resp_a", "m")
        assert err.value.param == field and err.value.code == "unknown_parameter"


class _State:
    def check_model(self, name: str) -> None:
        pass


def _ollama(**options) -> Penalties:
    body = ollama_api.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                    "options": options}, _State())
    return schemas.parse(schemas.ChatRequest, body).penalties


def test_ollama_options_map_to_llama_cpp_scope_with_ollama_defaults():
    assert _ollama() == Penalties(1.1, 0.0, 0.0, 64)                     # a client that sends nothing
    assert _ollama(temperature=0) == Penalties(1.1, 0.0, 0.0, 64)
    assert _ollama(repeat_penalty=1.5, repeat_last_n=-1, frequency_penalty=0.5, presence_penalty=0.25) == \
        Penalties(1.5, 0.5, 0.25, -1)
    assert _ollama(repeat_penalty=1.0, repeat_last_n=0) == Penalties(1.0, 0.0, 0.0, 0)
    with pytest.raises(APIError) as err:
        _ollama(repeat_last_n=-2)
    assert err.value.param == "repeat_last_n"


# ---- through a real server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    yield from serving("-m", MODEL, "--dtype", "float32", "--threads", "1", "--slots", "2")


def chat(s, messages=REPEAT, **kw) -> str:
    r = openai_client(s).chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0, **kw)
    return r.choices[0].message.content


def complete(s, prompt=MAT, **kw) -> str:
    r = openai_client(s).completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, **kw)
    return r.choices[0].text


def test_chat_penalties_change_the_greedy_answer(server):
    plain = chat(server)
    assert plain == chat(server, frequency_penalty=0, presence_penalty=0, extra_body={"repetition_penalty": 1})
    assert chat(server, frequency_penalty=2.0) != plain                   # the official client's own params
    assert chat(server, presence_penalty=2.0) != plain
    vllm = chat(server, extra_body={"repetition_penalty": 1.5})
    assert vllm != plain
    # repetition counts presence in prompt + answer either way: vLLM's scope is llama.cpp's with every token
    assert chat(server, extra_body={"repeat_penalty": 1.5, "repeat_last_n": -1}) == vllm
    assert chat(server, extra_body={"repetition_penalty": 1.5, "repeat_last_n": -1}) == vllm
    assert chat(server, extra_body={"repeat_penalty": 1.1}) != plain   # window 64 by default
    assert chat(server, extra_body={"repeat_penalty": 2.0, "repeat_last_n": 0}) == plain   # 0: off


def test_completions_penalties_and_their_scope(server):
    plain = complete(server)
    assert complete(server, extra_body={"repetition_penalty": 1.5}) != plain
    # frequency over the last 64 tokens counts the repeated prompt (llama.cpp's scope); over the answer
    # only (OpenAI's) it does not see the prompt's repeats: the two scopes answer differently here
    llama = complete(server, frequency_penalty=2.0, extra_body={"repeat_last_n": 64})
    assert llama != plain and llama != complete(server, frequency_penalty=2.0)


def test_streaming_matches_whole_answer(server):
    c = openai_client(server)
    for kw in ({"frequency_penalty": 2.0}, {"extra_body": {"repeat_penalty": 1.5, "repeat_last_n": 32}}):
        whole = chat(server, **kw)
        parts = c.chat.completions.create(model=MODEL, messages=REPEAT, max_tokens=N, temperature=0, stream=True,
                                          **kw)
        assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) == whole, kw
        text = c.completions.create(model=MODEL, prompt=MAT, max_tokens=N, temperature=0, stream=True, **kw)
        assert "".join(ch.choices[0].text for ch in text if ch.choices) == complete(server, **kw), kw
    assert chat(server, frequency_penalty=2.0) != chat(server)


def test_n_choices_are_each_penalized(server):
    """n=2 with a seed: choice j is the lone request with seed + j, penalties included (the follower forks
    the leader's prompt KV; its sampler must still count the prompt)."""
    c = openai_client(server)
    pen = {"extra_body": {"repetition_penalty": 2.0}, "presence_penalty": 1.0}
    sample = {"temperature": 0.8, "max_tokens": N}
    both = c.chat.completions.create(model=MODEL, messages=REPEAT, n=2, seed=5, **sample, **pen)
    alone = [c.chat.completions.create(model=MODEL, messages=REPEAT, seed=5 + j, **sample, **pen)
             .choices[0].message.content for j in range(2)]
    assert [ch.message.content for ch in both.choices] == alone
    unpenalized = c.chat.completions.create(model=MODEL, messages=REPEAT, n=2, seed=5, **sample)
    assert [ch.message.content for ch in unpenalized.choices] != alone
    both = c.completions.create(model=MODEL, prompt=MAT, n=2, seed=9, **sample, **pen)
    alone = [c.completions.create(model=MODEL, prompt=MAT, seed=9 + j, **sample, **pen).choices[0].text
             for j in range(2)]
    assert [ch.text for ch in sorted(both.choices, key=lambda ch: ch.index)] == alone


def test_ollama_client_options(server):
    import ollama
    c = ollama.Client(host=server.base, timeout=300)
    base = {"temperature": 0, "num_predict": N}
    # nothing sent: Ollama's defaults (repeat_penalty 1.1 over the last 64 tokens), as Ollama answers
    r = c.chat(model=MODEL, messages=REPEAT, options=base, stream=False)
    assert r.done and r.message.content == chat(server, extra_body=OLLAMA_DEFAULT) != chat(server)
    opts = {"repeat_penalty": 1.5, "repeat_last_n": -1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    r = c.chat(model=MODEL, messages=REPEAT, options={**base, **opts}, stream=False)
    assert r.message.content == chat(server, frequency_penalty=0.5, presence_penalty=0.5,
                                     extra_body={"repeat_penalty": 1.5, "repeat_last_n": -1})
    streamed = "".join(p.message.content for p in c.chat(model=MODEL, messages=REPEAT, options={**base, **opts},
                                                         stream=True))
    assert streamed == r.message.content
    off = c.chat(model=MODEL, messages=REPEAT, options={**base, "repeat_penalty": 1.0}, stream=False)
    assert off.message.content == chat(server)
    g = c.generate(model=MODEL, prompt=MAT, raw=True, options={**base, "repeat_penalty": 1.5, "repeat_last_n": 64},
                   stream=False)
    assert g.response == complete(server, extra_body={"repeat_penalty": 1.5, "repeat_last_n": 64}) != complete(server)
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model=MODEL, messages=REPEAT, options={**base, "repeat_last_n": -2}, stream=False)
    assert err.value.status_code == 400 and "repeat_last_n" in str(err.value)


def test_bad_values_are_openai_400s_and_the_server_answers_on(server):
    import openai
    c = openai_client(server)
    cases = [(c.chat.completions.create, dict(messages=REPEAT, frequency_penalty=3), "frequency_penalty"),
             (c.chat.completions.create, dict(messages=REPEAT, presence_penalty=-2.5), "presence_penalty"),
             (c.chat.completions.create, dict(messages=REPEAT, extra_body={"repetition_penalty": 0}),
              "repetition_penalty"),
             (c.chat.completions.create, dict(messages=REPEAT, extra_body={"repeat_last_n": -2}), "repeat_last_n"),
             (c.completions.create, dict(prompt=MAT, frequency_penalty=3), "frequency_penalty"),
             (c.completions.create, dict(prompt=MAT, extra_body={"repeat_penalty": -1}), "repeat_penalty"),
             (c.chat.completions.create, dict(messages=REPEAT, extra_body={"repetition_penalty": 1.3,
                                                                           "repeat_penalty": 1.2}), None)]
    for create, kw, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=N, temperature=0, **kw)
        body = err.value.body
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error", body
        assert body["param"] == param and (param or "repeat_penalty") in body["message"], body
    r = httpx.post(server.v1 + "/responses", json={"model": MODEL, "input": "hi", "frequency_penalty": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frequency_penalty", r.text
    assert chat(server) and complete(server)                        # still answering
