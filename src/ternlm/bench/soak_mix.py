"""The soak's request mix: what each turn's request carries beside the transcript, as clients send it.

`users` (the default): most turns sampled the way chat clients sample, some greedy, some asking for a
JSON answer with a json_schema response_format. `greedy`: every turn at temperature 0 (what the soak
sent before). Any sampling_settings name (`t1`, `t0.7-p0.95-pres0.5`, ...) is a mix of that one setting.

Which kind a turn gets is a pure function of (--seed, conversation, turn), and every request but a
greedy one carries the seed multiturn.turn_seed gives that turn: a seeded draw is keyed by (seed,
token index), so the answer is the same whatever else the server runs, with speculation on or off,
after reuse or cold. That is what lets the cold check compare sampled answers text for text.

A json turn's user message asks for JSON (as a client's prompt would) and its answer must parse and
validate against SCHEMA; the caller counts a failure otherwise. SCHEMA bounds every value (a string's
maxLength, an enum, an integer range): an answer cut at max_tokens is not JSON whatever the grammar,
so json turns get at least JSON_MAX_TOKENS.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import jsonschema

from .multiturn import turn_seed
from .sampling_settings import parse

SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 24},
    "mood": {"type": "string", "enum": ["positive", "neutral", "negative"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["topic", "mood", "confidence"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA, "strict": True}}
JSON_ASK = (" Reply in JSON only: the topic (a few words), your mood (positive, neutral or negative) and your "
            "confidence from 0 to 10.")
JSON_MAX_TOKENS = 96       # {"topic": 24 chars, "mood", "confidence"}: about 30 tokens; room for odd characters


@dataclass(frozen=True)
class Kind:
    """One kind of request: its body fields (besides model, messages, max_tokens, stream), how often it
    comes (weight), whether it carries a seed, whether it asks for JSON."""
    name: str
    weight: int
    fields: dict = field(default_factory=dict)
    seeded: bool = True
    json: bool = False

    def describe(self) -> str:
        """The fields in a few words, e.g. `temperature 0.7, top_p 0.95, presence_penalty 0.5, seed`."""
        parts = [f"{k} {v:g}" for k, v in self.fields.items()]
        if not any(k == "temperature" for k in self.fields):
            parts.insert(0, "no sampling field (temperature 1: the default)")
        return ", ".join(parts + (["response_format json_schema"] if self.json else [])
                         + (["seed"] if self.seeded else []))


GREEDY = Kind("greedy", 15, {"temperature": 0.0}, seeded=False)
USERS = (
    Kind("chat", 35, {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.5}),   # a chat UI's settings
    Kind("default", 15, {}),       # an OpenAI SDK caller who sets nothing but a seed: the server's temperature 1
    Kind("rep", 10, {"temperature": 0.7, "top_p": 0.95, "repetition_penalty": 1.1}),  # vLLM's name, whole context
    # llama.cpp's sampling defaults with the repeat_penalty Ollama sends (llama.cpp's scope: the last 64 tokens)
    Kind("llama", 10, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}),
    GREEDY,
    Kind("json", 15, {"temperature": 0.7, "top_p": 0.95}, json=True),
)
MIXES = {"users": USERS, "greedy": (GREEDY,)}


@dataclass(frozen=True)
class Mix:
    """A named mix of kinds. Pure: `request` depends only on its arguments."""
    name: str
    kinds: tuple[Kind, ...]
    seed: int = 0

    def kind_of(self, conversation: str, turn: int) -> Kind:
        """The kind of one turn's request: weighted by Kind.weight, drawn from (seed, conversation, turn)."""
        if len(self.kinds) == 1:
            return self.kinds[0]
        x = zlib.crc32(f"mix/{self.seed}/{conversation}/{turn}".encode()) % sum(k.weight for k in self.kinds)
        for k in self.kinds:
            if x < k.weight:
                return k
            x -= k.weight
        raise AssertionError("unreachable")

    def request(self, conversation: str, turn: int, user: str, max_tokens: int) -> tuple[Kind, str, dict, int]:
        """(kind, the user message as sent, the body's extra fields, max_tokens) of one turn."""
        k = self.kind_of(conversation, turn)
        fields = dict(k.fields)
        if k.seeded:
            fields["seed"] = turn_seed(self.seed, conversation, turn)
        if k.json:
            return k, user + JSON_ASK, fields | {"response_format": RESPONSE_FORMAT}, max(max_tokens, JSON_MAX_TOKENS)
        return k, user, fields, max_tokens

    def describe(self) -> list[dict]:
        """The kinds as results.json keeps them: name, share of requests, fields, seeded, json."""
        total = sum(k.weight for k in self.kinds)
        return [{"kind": k.name, "share": k.weight / total, "fields": k.fields, "seeded": k.seeded, "json": k.json,
                 "describe": k.describe()} for k in self.kinds]


def mix_named(name: str, seed: int = 0) -> Mix:
    """`users` | `greedy` | one sampling_settings name (seeded unless greedy). Raises ValueError."""
    if name in MIXES:
        return Mix(name, MIXES[name], seed)
    s = parse(name)             # ValueError names the bad part
    if s.greedy:
        return Mix(name, (GREEDY,), seed)
    return Mix(name, (Kind(s.name, 1, s.openai_fields()),), seed)


def json_problem(text: str) -> str | None:
    """Why a json turn's answer is not a valid SCHEMA instance (None: it is). Pure."""
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except json.JSONDecodeError as e:
        return f"json_schema answer is not JSON ({e.msg} at {e.pos}): {text[:120]!r}"
    except jsonschema.ValidationError as e:
        return f"json_schema answer does not validate ({e.message[:120]}): {text[:120]!r}"
    return None
