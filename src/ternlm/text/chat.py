"""Render a model's chat template (jinja2) with Hugging Face ``apply_chat_template`` semantics.

Chat templates come with model files, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute starting with "_", no mutating methods on the
inputs), and see only plain copies of the messages and tools (dicts, lists, strings, numbers).

What a template can use, as in Hugging Face: ``messages``, ``add_generation_prompt``, ``tools``
and ``documents`` (None when not given), ``bos_token``/``eos_token`` (undefined when the model has
none), any extra keyword, ``raise_exception(msg)``, ``strftime_now(fmt)``, a ``tojson`` filter that
does not HTML-escape (``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), loop
controls (``break``/``continue``), and the ``{% generation %}`` block (rendered as its body).
Output blocks follow ``trim_blocks=True, lstrip_blocks=True``.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class ChatTemplateError(ValueError):
    """The chat template did not compile, called ``raise_exception``, or failed while rendering."""


class _TemplateRaised(jinja2.TemplateError):
    """What ``raise_exception`` throws inside the template (told apart from jinja's own errors)."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; templates rely on the text as json.dumps
    # writes it (tool schemas, arguments), so Hugging Face replaces it with this.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _check_namespace_name(name: Any) -> None:
    # Underscore names could reach Namespace's private storage (_Namespace__attrs).
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set underscore-prefixed names on a namespace ({name!r})")


class _SafeNamespace(Namespace):
    """jinja's ``namespace()``, refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


class _DictMaker:
    """``dict(...)`` and ``dict.fromkeys(...)`` in templates, without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in HF;
    for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_SafeNamespace, dict=_DictMaker())
    return env


_ENV = _make_environment()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    # Cached: a server renders the same template for every request.
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None


# ---------------------------------------------------------------------------------------------
# Inputs as plain data.
# ---------------------------------------------------------------------------------------------

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _plain(value: Any) -> Any:
    """A copy of ``value`` made only of dict/list/tuple/str/int/float/bool/None.

    Why: the sandbox trusts the methods of whatever objects it is given; rebuilding the inputs from
    exact builtin types leaves nothing but inert data, and the caller's messages are never mutated.
    Other objects (arrays, images) become a placeholder naming their type, as in HF.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. OpenAI SDK messages)
        return _plain(value.model_dump())
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy/torch scalars
    return f"<{type(value).__name__}>"


def _plain_messages(messages: list) -> list[dict]:
    """Messages as HF hands them to templates: plain dicts, keys whose value is None dropped
    (OpenAI clients send ``content=None`` beside ``tool_calls``, and templates render "None"), and
    the reasoning text copied under every name templates read it by."""
    out = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _template_line(exc: BaseException) -> int | None:
    """Line of the template where a runtime error happened (jinja compiles templates to code whose
    frames are named "<template>"), or None."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


# ---------------------------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------------------------

def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool,
                bos_token: str | None, eos_token: str | None, tools: list | None = None,
                **extra: Any) -> str:
    """The text a chat template produces for ``messages``. Pure: no side effects.

    ``tools`` are JSON-schema dicts (OpenAI's ``{"type": "function", "function": {...}}``);
    ``extra`` keywords (``documents``, ``enable_thinking``, ...) are passed to the template as is.
    Raises ChatTemplateError for syntax errors, ``raise_exception`` calls and rendering failures.
    """
    compiled = _compile(template)
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools must be JSON schema dicts")
    context = {k: _plain(v) for k, v in extra.items()}
    context.setdefault("documents", None)
    # A missing special token stays undefined (renders as ""), as when HF's tokenizer has none.
    if bos_token is not None:
        context["bos_token"] = bos_token
    if eos_token is not None:
        context["eos_token"] = eos_token
    context.update(messages=_plain_messages(messages), tools=_plain(tools),
                   add_generation_prompt=bool(add_generation_prompt))
    try:
        return compiled.render(**context)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"chat template raised an exception: {e.message}") from None
    except jinja2.TemplateError as e:  # UndefinedError, SecurityError, ...
        where = _template_line(e)
        at = f" at line {where}" if where else ""
        raise ChatTemplateError(f"chat template failed{at}: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        where = _template_line(e)
        at = f" at line {where}" if where else ""
        raise ChatTemplateError(f"chat template failed{at}: {type(e).__name__}: {e}") from None


def message_boundaries(template: str, messages: list[dict], **kwargs: Any) -> list[int | None]:
    """For each message i, the character offset in ``render_chat(template, messages, **kwargs)``
    where the conversation up to and including message i ends; None where rendering
    ``messages[:i + 1]`` (always without a generation prompt) is not a prefix of the full text, or
    fails. Used to say in which message two conversations diverge. Pure: no side effects."""
    full = render_chat(template, messages, **kwargs)
    partial_kwargs = dict(kwargs, add_generation_prompt=False)
    ends: list[int | None] = []
    for i in range(len(messages)):
        try:
            part = render_chat(template, messages[:i + 1], **partial_kwargs)
        except ChatTemplateError:
            ends.append(None)  # e.g. templates that insist the last message is from the user
            continue
        ends.append(len(part) if full.startswith(part) else None)
    return ends
