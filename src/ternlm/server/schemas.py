"""OpenAI request models (strict pydantic, validated) and response shapes (plain dicts).

Why strict and closed: a parameter this server does not honour must be refused, never silently
ignored, or a client believes it got what it asked for (a tool call, JSON mode, n answers). So models
forbid unknown fields, wrong JSON types are errors (no "0.5" -> 0.5 coercion), and the OpenAI fields we
know but do not implement are named in `_NOT_IMPLEMENTED` with the one value each that is harmless
(best_of: 1, echo: false, ...). Union-typed fields are normalised by before-validators so an error names
one clean location ("messages[1].role"), which becomes the error's `param`.

Response builders take the engine's Completion/Delta and return the dicts OpenAI clients parse;
ternlm extras (`timings`, llama.cpp style; `tokens` with return_tokens) ride alongside.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..engine.core import Completion, Delta
from ..text.grammar import GrammarSpec, json_schema_source
from ..text.reasoning import Splitter, split
from ..text.tools import ContentFilter, parse_calls
from ..engine.sampling import Penalties
from ..engine.scheduler import MAX_LOGPROBS
from .errors import APIError, bad_request, unsupported

MAX_STOP = 4
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_N = 16            # choices per prompt
MAX_PROMPTS = 64      # prompts in one /v1/completions request
MAX_CHOICES = 128     # choices in one response (prompts x n)
_SEED = Field(None, ge=-(1 << 63), le=(1 << 64) - 1)   # the range torch.Generator.manual_seed takes


# ---- requests ---------------------------------------------------------------------------------

class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Closed):
    include_usage: bool = False


class FunctionCall(_Closed):
    name: str
    arguments: str                                # JSON text, as OpenAI sends it


class MessageToolCall(_Closed):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None                    # text parts joined; see _content
    tool_calls: list[MessageToolCall] | None = None   # assistant: the calls it made
    tool_call_id: str | None = Field(None, max_length=256)   # tool: the call this result answers
    # assistant: its thinking, sent back (templates that keep it render it; Qwen3's drops old turns')
    reasoning_content: str | None = None
    reasoning: str | None = None                  # the same, under the other name clients use

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):   # [{"type": "text", "text": ...}, ...]: text parts only
            texts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or not isinstance(part.get("text"), str) \
                        or part.get("type") != "text" or set(part) - {"type", "text"}:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"content part {i} ({kind!r}) is not supported: only "
                                     "{'type': 'text', 'text': str} parts")
                texts.append(part["text"])
            return "\n".join(texts)
        return v

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (a string or a list of text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if None not in (self.reasoning_content, self.reasoning) and self.reasoning_content != self.reasoning:
            raise ValueError("reasoning_content and reasoning disagree; send one")
        return self

    def for_template(self) -> dict:
        # "developer" is OpenAI's new name for the system role; chat templates know "system"
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            out["reasoning_content"] = thinking
        return out


class FunctionDef(_Closed):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None                # a JSON schema (object)
    strict: bool | None = None                    # forced calls are constrained either way


class Tool(_Closed):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Closed):
    name: str


class NamedToolChoice(_Closed):
    type: Literal["function"]
    function: NamedFunction


_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def grammar_of(fmt: Any) -> GrammarSpec | None:
    """response_format -> the grammar that constrains the output (None for plain text).
    OpenAI's {"type": "json_object"} and {"type": "json_schema", "json_schema": {"name", "schema",
    "strict", "description"}}; ternlm extensions {"type": "regex", "regex": str} and
    {"type": "grammar", "grammar": str} (Lark syntax, llguidance dialect). Raises ValueError.
    Constrained whether or not `strict` is set: a schema the client sent is a schema it wants."""
    if not isinstance(fmt, dict) or fmt.get("type") not in _FORMATS:
        raise ValueError(f"type must be one of {list(_FORMATS)}")
    kind = fmt["type"]
    extra = set(fmt) - {"type", kind}
    if extra:
        raise ValueError(f"unknown field(s) {sorted(extra)} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    body = fmt.get(kind)
    if kind in ("regex", "grammar"):
        if not isinstance(body, str) or not body:
            raise ValueError(f"{kind!r} must be a non-empty string")
        return GrammarSpec("regex" if kind == "regex" else "lark", body)
    if not isinstance(body, dict):
        raise ValueError("json_schema must be an object with 'name' and 'schema'")
    unknown = set(body) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} in json_schema")
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise ValueError("json_schema.name must be a string of 1 to 64 characters")
    if "strict" in body and body["strict"] is not None and not isinstance(body["strict"], bool):
        raise ValueError("json_schema.strict must be a boolean")
    schema = body.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema.schema must be a JSON schema object")
    return GrammarSpec("json_schema", json_schema_source(schema))


class _Sampling(_Closed):
    """Fields shared by both endpoints."""
    model: str
    n: int = Field(1, ge=1, le=MAX_N)             # choices; they share one prefill (scheduler: leader/fork)
    response_format: GrammarSpec | None = None    # see grammar_of
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1 << 20)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = _SEED
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    user: str | None = Field(None, max_length=512)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    cache_salt: str | None = Field(None, max_length=1024)
    # OpenAI's: {"token id": bias in [-100, 100]}, added to the logit before every choice (verify rows too)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # ternlm: false turns speculative decoding off for this request (it never changes an answer, only time);
    # true leaves it to the server (--speculative)
    speculative: bool = True
    # penalties (sampling.py), two ecosystems' forms: OpenAI's frequency/presence (over the answer) with vLLM's
    # repetition_penalty (over prompt + answer), or llama.cpp's repeat_penalty / repeat_last_n (all three over
    # the last n tokens of prompt + answer); see `penalties`
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=10.0)
    repeat_last_n: int | None = Field(None, ge=-1, le=(1 << 31) - 1)   # -1: all tokens, 0: penalties off

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if any(not k.isascii() or not k.isdigit() or len(k) > 12 for k in v):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        if any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        return v

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, v: Any) -> Any:
        return grammar_of(v)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @model_validator(mode="after")
    def _one_repetition(self):
        if self.repeat_penalty is not None and self.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty (vLLM's name) and repeat_penalty (llama.cpp's) are one penalty "
                             "in two scopes; send one")
        return self

    @property
    def penalties(self) -> Penalties:
        """The request's penalties. A body naming repeat_penalty or repeat_last_n gets llama.cpp's scope (all
        three over the last repeat_last_n tokens, default 64 as llama.cpp's); otherwise OpenAI's / vLLM's."""
        if self.repeat_penalty is None and self.repeat_last_n is None:
            return Penalties(self.repetition_penalty, self.frequency_penalty, self.presence_penalty, None)
        # repetition_penalty with only repeat_last_n: the client's penalty over its window, never dropped
        rep = self.repeat_penalty if self.repeat_penalty is not None else self.repetition_penalty
        return Penalties(rep, self.frequency_penalty, self.presence_penalty,
                         64 if self.repeat_last_n is None else self.repeat_last_n)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def affinity(self) -> str | None:
        # `user` is OpenAI's older cache-routing hint, superseded by prompt_cache_key
        return self.prompt_cache_key if self.prompt_cache_key is not None else self.user


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # reasoning models: variables for the template (Qwen3's {"enable_thinking": false}), the effort
    # (passed to templates that read `reasoning_effort`), and whether thinking is split out (reasoning.py)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    reasoning_format: Literal["auto", "none"] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict | None) -> dict | None:
        reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
        if v and (bad := sorted(k for k in v if k in reserved or not k.isidentifier() or k.startswith("_"))):
            raise ValueError(f"chat_template_kwargs may not set {bad}")
        return v

    @property
    def template_vars(self) -> dict:
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out.setdefault("reasoning_effort", self.reasoning_effort)
        return out

    @field_validator("messages")
    @classmethod
    def _nonempty(cls, v: list) -> list:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not in tools")
        # a regex/grammar constrains the whole text, calls included (e.g. thinking, then a call); a JSON
        # schema and a call cannot both be the answer
        if self.calling and self.response_format is not None and (
                self.forced[0] or self.response_format.kind not in ("regex", "lark")):
            raise ValueError("response_format together with tools is not supported (except a regex or grammar "
                             "with tool_choice 'auto'): send tool_choice 'none' or no tools")
        return self

    @property
    def calling(self) -> bool:
        """Tools are offered and may be called (their calls are parsed out of the answer)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def forced(self) -> tuple[bool, str | None]:
        """(a call is forced, the one function it must be: None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required" and self.calling, None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    # prompts, in order: each text or token ids (skips tokenisation); a single prompt is a list of one
    prompt: list[str | list[int]]
    max_tokens: int = Field(16, ge=1)             # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens: bool = False                   # ternlm: the generated ids in the choice as `tokens`

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        """str | list[int] (one prompt) | list[str] | list[list[int]] (a batch) -> list of prompts."""
        if isinstance(v, str) or (isinstance(v, list) and v and all(type(x) is int for x in v)):
            v = [v]
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a non-empty string, a list of token ids, or a list of those")
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        for i, p in enumerate(v):
            where = f"prompt {i}" if len(v) > 1 else "prompt"
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"{where} must not be empty")
            elif isinstance(p, list):
                if not p:
                    raise ValueError(f"{where} must not be empty")
                bad = next((x for x in p if type(x) is not int), None)
                if bad is not None:
                    raise ValueError(f"token ids must be integers, got {bad!r} in {where}")
            else:
                raise ValueError(f"{where} must be a string or a list of token ids, got {type(p).__name__}")
        return v

    @model_validator(mode="after")
    def _choices(self):
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompt)} prompts x n={self.n} exceeds {MAX_CHOICES} choices")
        return self


class TokenizeRequest(_Closed):
    """llama.cpp-style /tokenize: the ids a client can later send as a completions prompt."""
    content: str
    add_special: bool = False        # add the model's BOS etc., as /v1/completions does for text


class DetokenizeRequest(_Closed):
    tokens: list[int]


def _always(_: Any) -> bool:
    return False


# Known OpenAI fields we do not implement -> the value that is harmless (null always is: parse drops nulls).
_NOT_IMPLEMENTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v == 1 and v is not True, "best_of > 1 is not supported"),
    "functions": (lambda v: v == [], "functions (OpenAI's deprecated form) is not supported: send tools"),
    "function_call": (lambda v: v == "none", "function_call (OpenAI's deprecated form) is not supported: send tool_choice"),
    "echo": (lambda v: v is False, "echo is not supported"),
    "suffix": (_always, "suffix (insertion) is not supported"),
    "modalities": (lambda v: v == ["text"], "only the 'text' modality is supported"),
    "audio": (_always, "audio output is not supported"),
    "prediction": (_always, "predicted outputs are not supported"),
    "web_search_options": (_always, "web search is not supported"),
    "store": (lambda v: v is False, "store is not supported"),
}


def _param(loc: tuple) -> str:
    """('messages', 1, 'role') -> 'messages[1].role'."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def parse(model: type[BaseModel], raw: Any) -> Any:
    """Validate a decoded JSON body into `model`. Raises APIError(400) naming the offending field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    body = {k: v for k, v in raw.items() if v is not None}   # null = "use the default", as OpenAI reads it
    for name, (harmless, why) in _NOT_IMPLEMENTED.items():
        if name in body:
            v = body.pop(name)
            if not harmless(v):
                raise unsupported(name, f"{why} (got {name}={_short(v)})")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"]) or None
        kind = err["type"]
        if kind == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param,
                              "unknown_parameter") from None
        if kind == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param,
                              "missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"Invalid '{param}': {msg}" if param else msg, param, "invalid_value") from None


def _short(v: Any, n: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


# ---- responses --------------------------------------------------------------------------------

def usage(cs: list[Completion], counted: list[bool] | None = None) -> dict:
    """Usage of a response's choices. counted[i]: choice i's prompt counts (the first choice of each
    prompt; n choices of one prompt prefill it once and count it once, as OpenAI does)."""
    counted = counted or [True] * len(cs)
    prompt = sum(c.prompt_tokens for c, k in zip(cs, counted) if k)
    out = sum(len(c.token_ids) for c in cs)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c, k in zip(cs, counted) if k)}}


def timings(c: Completion) -> dict:
    """llama.cpp's timings object: prompt_n = tokens prefilled, cache_n = tokens reused."""
    t = c.timings
    n_pred = len(c.token_ids)

    def per_s(n: int, s: float) -> float:
        return n / s if s > 0 else 0.0
    return {"prompt_n": t.prefill_tokens, "cache_n": c.cached_tokens, "prompt_ms": t.prefill_s * 1e3,
            "prompt_per_token_ms": t.prefill_s * 1e3 / t.prefill_tokens if t.prefill_tokens else 0.0,
            "prompt_per_second": per_s(t.prefill_tokens, t.prefill_s),
            "predicted_n": n_pred, "predicted_ms": t.decode_s * 1e3,
            "predicted_per_token_ms": t.decode_s * 1e3 / n_pred if n_pred else 0.0,
            "predicted_per_second": per_s(n_pred, t.decode_s),
            # speculative decoding (llama.cpp's names): drafted tokens verified, and those kept
            "draft_n": t.drafted, "draft_n_accepted": t.accepted,
            # ternlm: where cache_n came from (slot KV, RAM tier, disk tier) and what loading cost
            "cache_tier": c.restored.tier, "cache_slot_n": c.restored.slot, "cache_ram_n": c.restored.ram,
            "cache_disk_n": c.restored.disk, "cache_redis_n": c.restored.redis,
            "cache_sibling_n": c.restored.sibling,
            "cache_load_ms": c.restored.load_s * 1e3,
            # why reuse stopped where it did ("diverged at token 812 of record 2034 (message 3): ..."); None: it
            # covered the whole record
            "cache_reason": c.reuse.reason if c.reuse.diverged is not None else None,
            # mixture of experts: the expert store's traffic in the steps this request took part in (hits,
            # misses, bytes_read from the file, evictions; a step shared with other requests counts for
            # each of them); absent for a dense model
            **({"experts": experts} if (experts := getattr(c, "experts", None)) is not None else {})}


class Shape:
    """Builds one request's response objects (one endpoint's dialect). `id`/`created` fixed per request."""
    object_full = object_chunk = ""

    def __init__(self, model: str, fingerprint: str, tokenizer: Any, id_prefix: str):
        self.model = model
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def usage_chunk(self, cs: list[Completion], counted: list[bool] | None = None) -> dict:
        # timings: choice 0's (each choice's own ride on its final chunk)
        return self._envelope(self.object_chunk, [], usage=usage(cs, counted), timings=timings(cs[0]))

    def before_final(self, index: int, c: Completion, include_usage: bool) -> list[dict]:
        return []

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _token(self, tid: int) -> tuple[str, list[int]]:
        """A token's text and its exact bytes (a token may hold part of a UTF-8 character: its text
        then shows U+FFFD while `bytes` stays exact)."""
        piece = getattr(self.tokenizer, "id_to_piece_bytes", None)
        s = self.token_text(tid)
        return s, list(piece(tid) if piece is not None else s.encode("utf-8"))


class ChatShape(Shape):
    """tools: tools may be called: `<tool_call>` blocks in an answer become message.tool_calls
    (streamed as delta.tool_calls once the choice ends; the content before them streams as it comes)."""
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, *a, tools: bool = False, thinking: bool | None = None, **kw):
        """thinking: None: no reasoning split (content as generated); False/True: split `<think>`
        blocks out into reasoning_content, True when the prompt already opened one (reasoning.py)."""
        super().__init__(*a, id_prefix="chatcmpl", **kw)
        self.tools = tools
        self.thinking = thinking
        self._filters: dict[int, ContentFilter] = {}
        self._splitters: dict[int, Splitter] = {}
        self._reasoning_n: dict[int, int] = {}      # choice -> tokens streamed while thinking

    def _filter(self, index: int) -> ContentFilter:
        return self._filters.setdefault(index, ContentFilter())

    def _split(self, index: int, text: str) -> tuple[str, str]:
        """A streamed delta -> (reasoning, content) safe to send; counts the thinking's tokens."""
        if self.thinking is None:
            return "", text
        s = self._splitters.setdefault(index, Splitter(self.thinking))
        thinking_before = s.thinking
        r, c = s.feed(text)
        if thinking_before and s.thought:
            self._reasoning_n[index] = self._reasoning_n.get(index, 0) + 1
        return r, c

    def _delta(self, index: int, reasoning: str, content: str) -> dict:
        out = {"reasoning_content": reasoning} if reasoning else {}
        if self.tools:
            content = self._filter(index).feed(content)
        if content:
            out["content"] = content
        return out

    def logprob(self, d: Delta) -> dict | None:
        if d.logprob is None:
            return None
        tok, b = self._token(d.token_id)
        tops = []
        for tid, lp in d.top_logprobs or []:
            t, tb = self._token(tid)
            tops.append({"token": t, "logprob": lp, "bytes": tb})
        return {"token": tok, "logprob": d.logprob, "bytes": b, "top_logprobs": tops}

    def first_chunk(self, index: int, include_usage: bool) -> dict | None:
        return self._chunk(index, {"role": "assistant", "content": ""}, None, None, include_usage)

    def delta_chunk(self, index: int, d: Delta, include_usage: bool) -> dict | None:
        lp = self.logprob(d)
        delta = self._delta(index, *self._split(index, d.text))
        if not delta and lp is None:
            return None          # text held back (partial UTF-8 / stop string / a tag / a call): nothing to send
        if lp is not None and not delta:
            delta = {"content": ""}
        return self._chunk(index, delta, {"content": [lp]} if lp else None, None, include_usage)

    def before_final(self, index: int, c: Completion, include_usage: bool) -> list[dict]:
        """Chunks a choice sends when it ends, before its final chunk: held-back thinking and content,
        its tool calls."""
        out = []
        if self.thinking is not None:
            r, tail = self._splitters.setdefault(index, Splitter(self.thinking)).finish()
            if delta := self._delta(index, r, tail):
                out.append(self._chunk(index, delta, None, None, include_usage))
        if not self.tools:
            return out
        tail, calls = self._filter(index).finish()
        out += [self._chunk(index, {"content": tail}, None, None, include_usage)] if tail else []
        if calls:
            out.append(self._chunk(index, {"tool_calls": [call.openai(k) for k, call in enumerate(calls)]},
                                   None, None, include_usage))
        return out

    def final_chunk(self, index: int, c: Completion, include_usage: bool, return_tokens: bool = False) -> dict:
        called = self.tools and bool(self._filter(index).finish()[1])
        out = self._chunk(index, {}, None, "tool_calls" if called else c.finish_reason, include_usage)
        out["timings"] = timings(c)
        return out

    def _chunk(self, index: int, delta: dict, logprobs, finish, include_usage: bool) -> dict:
        extra = {"usage": None} if include_usage else {}
        return self._envelope(self.object_chunk, [{"index": index, "delta": delta, "logprobs": logprobs,
                                                   "finish_reason": finish}], **extra)

    def response(self, cs: list[Completion], deltas: list[list[Delta]], want_logprobs: bool, return_tokens: bool,
                 counted: list[bool] | None = None) -> dict:
        choices = []
        thought = 0
        for i, (c, ds) in enumerate(zip(cs, deltas)):
            lps = [x for x in (self.logprob(d) for d in ds) if x is not None]
            parts = split(c.text, self.thinking) if self.thinking is not None else None
            text = parts.content if parts is not None else c.text
            message: dict = {"role": "assistant", "content": text}
            if parts is not None and parts.reasoning is not None:
                message["reasoning_content"] = parts.reasoning
                for d in ds:                                # tokens fed while thinking
                    self._split(i, d.text)
                thought += self._reasoning_n.get(i, 0)
            finish = c.finish_reason
            if self.tools:
                content, calls = parse_calls(text)
                if calls:
                    message = {**message, "content": content, "tool_calls": [call.openai() for call in calls]}
                    finish = "tool_calls"
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": lps} if want_logprobs else None, "finish_reason": finish})
        return self._envelope(self.object_full, choices, usage=self._usage(usage(cs, counted), thought),
                              timings=timings(cs[0]))

    def _usage(self, u: dict, thought: int) -> dict:
        if self.thinking is not None:
            u["completion_tokens_details"] = {"reasoning_tokens": thought}
        return u

    def usage_chunk(self, cs: list[Completion], counted: list[bool] | None = None) -> dict:
        out = super().usage_chunk(cs, counted)
        self._usage(out["usage"], sum(self._reasoning_n.values()))
        return out


class TextShape(Shape):
    object_full = object_chunk = "text_completion"

    def __init__(self, *a, **kw):
        super().__init__(*a, id_prefix="cmpl", **kw)
        self._offset: dict[int, int] = {}   # choice index -> text_offset of its next streamed token

    def logprobs(self, deltas: list[Delta], offset: int = 0) -> dict:
        """Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for d in deltas:
            if d.logprob is None:
                continue
            tok = self.token_text(d.token_id)
            out["tokens"].append(tok)
            out["token_logprobs"].append(d.logprob)
            out["top_logprobs"].append({self.token_text(t): lp for t, lp in d.top_logprobs or []})
            out["text_offset"].append(offset)
            offset += len(tok)
        return out

    def first_chunk(self, index: int, include_usage: bool) -> dict | None:
        return None

    def delta_chunk(self, index: int, d: Delta, include_usage: bool) -> dict | None:
        if not d.text and d.logprob is None:
            return None
        lp = None
        if d.logprob is not None:
            lp = self.logprobs([d], self._offset.get(index, 0))
            self._offset[index] = self._offset.get(index, 0) + len(lp["tokens"][0])
        return self._chunk(index, d.text, lp, None, include_usage)

    def final_chunk(self, index: int, c: Completion, include_usage: bool, return_tokens: bool = False) -> dict:
        out = self._chunk(index, "", None, c.finish_reason, include_usage)
        if return_tokens:
            out["choices"][0]["tokens"] = list(c.token_ids)
        out["timings"] = timings(c)
        return out

    def _chunk(self, index: int, text: str, logprobs, finish, include_usage: bool) -> dict:
        extra = {"usage": None} if include_usage else {}
        return self._envelope(self.object_chunk, [{"index": index, "text": text, "logprobs": logprobs,
                                                   "finish_reason": finish}], **extra)

    def response(self, cs: list[Completion], deltas: list[list[Delta]], want_logprobs: bool, return_tokens: bool,
                 counted: list[bool] | None = None) -> dict:
        choices = []
        for i, (c, ds) in enumerate(zip(cs, deltas)):
            choice = {"index": i, "text": c.text, "logprobs": self.logprobs(ds) if want_logprobs else None,
                      "finish_reason": c.finish_reason}
            if return_tokens:
                choice["tokens"] = list(c.token_ids)
            choices.append(choice)
        return self._envelope(self.object_full, choices, usage=usage(cs, counted), timings=timings(cs[0]))


def too_long(prompt_tokens: int, max_tokens: int, ctx: int, where: str) -> APIError:
    return bad_request(f"This model's maximum context length is {ctx} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in "
                       f"the completion). Please reduce the length of the {where} or max_tokens.",
                       "max_tokens" if prompt_tokens < ctx else where, "context_length_exceeded")
