"""Sampling settings for the benchmarks, by name: what clients send beside greedy. OpenAI's default is
temperature 1; chat clients often send temperature 0.7 with top_p 0.95 and a presence penalty. A figure
measured only greedy is a figure about the benchmark (ARCHITECTURE.md, section 5).

A name is `greedy` or fields joined by `-`, each a tag and a number: t (temperature), p (top_p), k (top_k),
minp (min_p), pres (presence penalty), freq (frequency penalty), rep (repetition penalty). So `t1` is
OpenAI's default, `t0.7-p0.95-pres0.5` the chat client's. Fields left out keep their off value (top_p 1,
top_k 0, penalties 0 / 1). One setting becomes Engine.stream's keywords, an OpenAI body's fields or
llama-server's /completion fields here, so every benchmark spells it the same way. Pure."""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ..engine.sampling import Penalties, SamplingParams

GREEDY = "greedy"
# the report's and the settings: greedy, OpenAI's default, a chat client's
STANDARD = (GREEDY, "t1", "t0.7-p0.95-pres0.5")

_TAGS = {"minp": "min_p", "pres": "presence", "freq": "frequency", "rep": "repetition",   # longest tags first
         "t": "temperature", "p": "top_p", "k": "top_k"}
_FIELD = re.compile(r"(minp|pres|freq|rep|t|p|k)(-?\d+(?:\.\d+)?)(?:-(?=.)|$)")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:     # the engine's own checks, at construction
        SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, penalties=self.penalties)

    @property
    def penalties(self) -> Penalties:
        return Penalties(repetition=self.repetition, frequency=self.frequency, presence=self.presence)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def name(self) -> str:
        """`greedy` when every field is off, else the temperature and each field not off (parse's inverse)."""
        if self == Sampling():
            return GREEDY
        off = Sampling()
        tags = {v: k for k, v in _TAGS.items()}
        return "-".join(f"{tags[f.name]}{getattr(self, f.name):g}" for f in fields(self)
                        if f.name == "temperature" or getattr(self, f.name) != getattr(off, f.name))

    def engine_kwargs(self, seed: int | None) -> dict:
        """Engine.stream / generate / open keywords."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "penalties": self.penalties, "seed": seed}

    def openai_fields(self) -> dict:
        """An OpenAI request body's fields: temperature and top_p always; OpenAI's penalties and the
        vLLM / llama.cpp extensions (top_k, min_p, repetition_penalty) when not off."""
        out = {"temperature": self.temperature, "top_p": self.top_p}
        for key, value, off in (("presence_penalty", self.presence, 0.0), ("frequency_penalty", self.frequency, 0.0),
                                ("top_k", self.top_k, 0), ("min_p", self.min_p, 0.0),
                                ("repetition_penalty", self.repetition, 1.0)):
            if value != off:
                out[key] = value
        return out

    def llama_fields(self) -> dict:
        """llama-server's /completion fields. Its own defaults (top_k 40, min_p 0.05, ...) are overridden
        so it samples from the same distribution family; its penalties keep llama.cpp's window (the last
        64 tokens), which OpenAI's scope (the whole answer) is not."""
        if self.greedy:
            return {"temperature": 0.0, "top_k": 1}
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "presence_penalty": self.presence, "frequency_penalty": self.frequency,
                "repeat_penalty": self.repetition}


def parse(name: str) -> Sampling:
    """`greedy` | `t1` | `t0.7-p0.95-pres0.5` ... -> Sampling. Raises ValueError naming the bad part."""
    name = name.strip()
    if name == GREEDY:
        return Sampling()
    kw, pos = {}, 0
    while pos < len(name):
        m = _FIELD.match(name, pos)
        if m is None:
            raise ValueError(f"sampling setting {name!r}: cannot read {name[pos:]!r} (greedy, or fields such as "
                             f"t0.7-p0.95-pres0.5: {', '.join(f'{t}={f}' for t, f in _TAGS.items())})")
        key = _TAGS[m.group(1)]
        if key in kw:
            raise ValueError(f"sampling setting {name!r}: {key} given twice")
        kw[key] = int(m.group(2)) if key == "top_k" else float(m.group(2))
        pos = m.end()
    if not kw:
        raise ValueError("empty sampling setting")
    return Sampling(**kw)


def parse_list(names: str) -> list[Sampling]:
    """A comma list of names -> settings, in order, each once."""
    out = [parse(n) for n in names.split(",") if n.strip()]
    if not out:
        raise ValueError("--sampling: name at least one setting (e.g. greedy,t1,t0.7-p0.95-pres0.5)")
    if len({s for s in out}) != len(out):
        raise ValueError(f"--sampling {names}: a setting is named twice")
    return out


def from_flags(temperature: float | None, top_p: float | None, presence: float | None) -> Sampling | None:
    """--temperature / --top-p / --presence-penalty as one setting; None when none of them is given."""
    if temperature is None and top_p is None and presence is None:
        return None
    return Sampling(temperature=1.0 if temperature is None else temperature,   # OpenAI's default temperature
                    top_p=1.0 if top_p is None else top_p, presence=presence or 0.0)


def request_fields(temperature: float | None, top_p: float | None, presence: float | None) -> dict:
    """The fields an OpenAI body carries for these flags: only those given (none: the server's defaults)."""
    out = {"temperature": temperature, "top_p": top_p, "presence_penalty": presence}
    return {k: v for k, v in out.items() if v is not None}


def describe(fields: dict) -> str:
    """A request's sampling fields in words: `greedy`, `temperature 0.7, top_p 0.95`, or the server's default."""
    if not fields:
        return "the server's default sampling (no temperature sent)"
    if fields.get("temperature") == 0 and all(k == "temperature" or k == "seed" for k in fields):
        return "greedy"
    return ", ".join(f"{k} {v:g}" for k, v in fields.items() if k != "seed")


def add_request_flags(p, default_temperature: float | None, temperature_help: str) -> None:
    """--temperature / --top-p / --presence-penalty for a benchmark that sends OpenAI-style requests."""
    p.add_argument("--temperature", type=float, default=default_temperature, help=temperature_help)
    p.add_argument("--top-p", type=float, default=None, help="top_p sent in every request (default: none sent)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="presence_penalty sent in every request (OpenAI's; default: none sent)")
