"""Streaming detokenization (deltas join to the full decode, never a broken character) and stop
strings (cut before the first stop, even across chunk boundaries)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ternlm.engine.detok import IncrementalDetokenizer, StopMatcher
from ternlm.models.registry import model_path
from ternlm.text.tokenizer import Tokenizer

def examples(n: int) -> settings:
    # The module-scoped tokenizer fixture is shared by all examples on purpose (it is read-only).
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def model_file(name: str) -> Path:
    """A registry model, fetched and verified on first use."""
    return model_path(name, progress=False)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(model_file("smollm2-135m"))


def stream(tokenizer, ids, **kw) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kw)
    return [detok.push(i) for i in ids] + [detok.flush()]


# Mixed-script text whose tokens often split UTF-8 characters (emoji, CJK, accents).
PIECES = ["Hello", " world", "😀", "👍🏽", "👨‍👩‍👧", "你好", "世界", "é", "ß", " ", "\n", "123", "<|im_end|>", "🇯🇵", "ℝ"]
TEXTS = st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join)


@examples(150)
@given(text=TEXTS)
def test_deltas_of_real_text_are_whole_characters(tok, text):
    ids = tok.encode(text)
    deltas = stream(tok, ids)
    assert "".join(deltas) == text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@examples(200)
@given(ids=st.lists(st.integers(0, 49151), max_size=30), skip=st.booleans())
def test_deltas_of_random_ids_join_to_full_decode(tok, ids, skip):
    assert "".join(stream(tok, ids, skip_special_tokens=skip)) == tok.decode(ids, skip_special_tokens=skip)


@examples(100)
@given(text=TEXTS, junk=st.lists(st.integers(0, 49151), max_size=6), cut=st.integers(0, 40))
def test_broken_characters_in_the_middle(tok, text, junk, cut):
    # Splice random ids (often lone UTF-8 fragments) into real text: still equal to the full decode.
    ids = tok.encode(text)
    ids = ids[:cut] + junk + ids[cut:]
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_emoji_is_held_until_complete(tok):
    ids = tok.encode("a😀")
    assert len(ids) >= 3  # "a" plus several byte-level pieces of the emoji
    detok = IncrementalDetokenizer(tok)
    out = [detok.push(i) for i in ids]
    assert out[0] == "a" and all(d == "" for d in out[1:-1]) and out[-1] == "😀"
    assert detok.flush() == ""


def test_flush_emits_an_incomplete_tail(tok):
    ids = tok.encode("ok😀")[:-1]  # drop the emoji's last piece
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.push(i) for i in ids) == "ok"
    assert detok.flush() == tok.decode(ids)[2:] and detok.flush() == ""


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert "".join(stream(tok, ids, skip_special_tokens=True)) == "assistant\nHi"
    assert "".join(stream(tok, ids)) == "<|im_start|>assistant\nHi<|im_end|>"


def _tiny_spm() -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "a", "b", "▁a", "ab", "▁ab"]
    types = [2, 3, 3] + [6] * 256 + [1] * 6
    scores = [0.0] * 259 + [-10.0, -11.0, -12.0, -1.0, -2.0, -3.0]
    return Tokenizer.from_gguf_metadata({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores})


@examples(300)
@given(ids=st.lists(st.sampled_from([1, 2, 0x41 + 3, 0xC3 + 3, 0xA9 + 3, 0xE4 + 3, 0xB8 + 3, 0xAD + 3, 0x80 + 3,
                                     0xF0 + 3, 259, 260, 261, 262, 263, 264]), max_size=20))
def test_sentencepiece_byte_tokens_and_leading_space(ids):
    # Byte-fallback runs decode as a whole (an invalid run is one U+FFFD per byte) and the first
    # piece loses its dummy-prefix space: the window scheme must reproduce both.
    spm = _tiny_spm()
    assert "".join(stream(spm, ids)) == spm.decode(ids)
    assert "".join(stream(spm, ids, skip_special_tokens=True)) == spm.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# StopMatcher
# ---------------------------------------------------------------------------------------------

def feed_all(stops, chunks) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    out, stopped = [], False
    for chunk in chunks:
        emit, stopped = matcher.feed(chunk)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), matcher.stopped


def test_stop_spanning_chunks():
    assert feed_all(["STOP"], ["Hel", "lo S", "T", "OP more"]) == ("Hello ", True)


def test_stop_at_the_very_start():
    assert feed_all(["<end>"], ["<end>", "ignored"]) == ("", True)
    assert feed_all(["<end>"], ["<", "e", "nd>rest"]) == ("", True)


def test_partial_stop_is_held_then_released():
    matcher = StopMatcher(["abc"])
    assert matcher.feed("xab") == ("x", False)   # "ab" could still become "abc"
    assert matcher.feed("d") == ("abd", False)
    assert matcher.feed("ab") == ("", False)
    assert matcher.flush() == "ab"               # generation ended: the tail was plain text


def test_earliest_stop_wins_and_stays_stopped():
    matcher = StopMatcher(["world", "lo w", ""])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.feed("more") == ("", True) and matcher.flush() == ""


def test_a_stop_that_began_earlier_wins_even_when_a_shorter_one_completes_first():
    """Found by the property below (hypothesis): stops "a" and "<a<", text "<a" then "<". The text
    ends before "<a<" (position 0), not before "a" (1), whatever the chunking."""
    assert feed_all(["a", "<a<"], ["<a", "<"]) == ("", True)
    assert feed_all(["a", "<a<"], ["<a"]) == ("<", True)          # "<a<" never came: "a" stops it
    assert feed_all(["a", "<a<"], ["<a", "b"]) == ("<", True)


def test_no_stops_passes_through():
    assert StopMatcher([]).feed("anything") == ("anything", False)


@examples(300)
@given(text=st.text(alphabet="abc\n<>", max_size=40), stops=st.lists(st.text(alphabet="abc\n<>", min_size=1,
       max_size=4), max_size=3), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_matches_a_whole_string_search(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = (text[:min(hits)], True) if hits else (text, False)
    assert feed_all(stops, chunks) == expected


def test_detok_and_stop_together_across_token_boundaries(tok):
    ids = tok.encode("The answer is 42 😀.\n\nUser: next question")
    detok, matcher = IncrementalDetokenizer(tok), StopMatcher(["\n\nUser:"])
    out = []
    for i in ids:
        emit, stopped = matcher.feed(detok.push(i))
        out.append(emit)
        if stopped:
            break
    assert stopped and "".join(out) == "The answer is 42 😀."
