"""Tool (function) calling: how tools reach the prompt, the grammar that forces a call, the parser
that reads calls back out of the answer.

Two ways to put tools in the prompt:
- native: the model's chat template reads the `tools` variable (Qwen2.5, Hermes, Llama 3.1, ...).
  Tools, past calls (`tool_calls`, arguments as objects) and `role: "tool"` results are rendered
  by the template itself, as transformers' apply_chat_template does.
- fallback, for templates that never mention `tools` (SmolLM2): the tools are described in the
  system message (before the client's own system text, or as a new first message) in the Hermes /
  Qwen format; past calls become the assistant text `<tool_call>\\n{json}\\n</tool_call>` and tool
  results user messages `<tool_response>\\n...\\n</tool_response>`. Same idea as llama.cpp's generic
  tool-call handler.
Both expect calls in the answer as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

Why a grammar for `required` and named calls (grammar.py): the call always parses, names a declared
function and has schema-valid arguments, and its JSON is spelled as json.dumps / the template's
`tojson` spell it (", ", ": ", declared key order), so the history the client resends after the call
re-renders to the tokens that were generated and the next turn reuses the KV through the call.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .grammar import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

FALLBACK_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}"
    "\n</tool_call>")


def supports_tools(template: str | None) -> bool:
    """Whether a chat template renders the `tools` variable (else: the fallback)."""
    if not template:
        return False
    import jinja2.meta
    from .chat import _ENV
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_ENV.parse(template))
    except Exception:   # a template that does not parse fails later, with its own error
        return False


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str               # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _args_object(arguments: Any) -> Any:
    """A history call's arguments as the template wants them: an object (JSON text parsed)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def call_text(name: str, arguments: Any) -> str:
    """One call as the answer spells it (json.dumps: the spelling the grammar forces)."""
    return f'{OPEN}\n{json.dumps({"name": name, "arguments": _args_object(arguments)}, ensure_ascii=False)}\n{CLOSE}'


def prepare(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], dict]:
    """OpenAI messages (+ tools) -> (messages for the template, extra template variables).
    Pure: the input is not modified."""
    if native:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                             "arguments": _args_object(c["function"]["arguments"])}}
                                         for c in m["tool_calls"]]}
            out.append(m)
        return out, ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            text = m.get("content") or ""
            kept = {"reasoning_content": m["reasoning_content"]} if m.get("reasoning_content") else {}
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls, **kept})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "reasoning_content")})
    if tools:
        header = FALLBACK_HEADER.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{header}"}
        else:
            out.insert(0, {"role": "system", "content": header})
    return out, {}


def _token(tokenizer: Any, text: str) -> str:
    """`text` in a Lark rule: the special token's id where the vocabulary has one (Qwen's <tool_call>
    is one token, and its template's text tokenizes to it), else the literal."""
    tid = tokenizer.token_to_id(text)
    if tid is not None and tokenizer.is_special(tid):
        return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(tools: list[dict], only: str | None, parallel: bool, tokenizer: Any) -> GrammarSpec:
    """The grammar of an answer that is only tool calls (tool_choice "required", or the function
    named by `only`): one call, or one or more separated by newlines when `parallel`."""
    alts = []
    for t in tools:
        f = t["function"]
        if only is not None and f["name"] != only:
            continue
        params = dict(f.get("parameters") or {"type": "object", "properties": {}})
        if params.get("type") == "object":
            params.setdefault("additionalProperties", False)   # undeclared arguments: nothing can use them
        alts.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                     "required": ["name", "arguments"], "additionalProperties": False})
    schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
    schema = {**schema, "x-guidance": _JSON_STYLE}
    lark = "\n".join([
        'start: call ("\\n" call)*' if parallel else "start: call",
        f'call: {_token(tokenizer, OPEN)} "\\n" body "\\n" {_token(tokenizer, CLOSE)}',
        f"body: %json {json.dumps(schema)}",
    ])
    return GrammarSpec("lark", lark)


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer -> (the content outside the calls, or None when only calls; the calls). A block
    whose JSON does not parse or has no name stays in the content: a call is reported only when it
    is one."""
    calls, rest, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if not isinstance(name, str):
                raise ValueError("name")
        except (ValueError, KeyError, TypeError):
            continue
        rest.append(text[last:m.start()])
        last = m.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments))
    rest.append(text[last:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


class ContentFilter:
    """Streaming with tools: passes content through until a call may begin (`<tool_call>`, held back
    while only a prefix of it has arrived), then keeps the rest for parse_calls at the end."""

    def __init__(self):
        self.text = ""               # everything generated so far
        self._sent = 0               # characters of `text` already streamed as content
        self._in_call = False

    def feed(self, delta: str) -> str:
        """New text -> the content that is safe to stream now."""
        self.text += delta
        if self._in_call:
            return ""
        at = self.text.find(OPEN, self._sent)
        if at >= 0:
            self._in_call = True
            out, self._sent = self.text[self._sent:at], at
            return out
        hold = next((k for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                     if self.text.endswith(OPEN[:k])), 0)
        end = len(self.text) - hold
        out, self._sent = self.text[self._sent:end], max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, the calls). The content is what parse_calls leaves outside calls."""
        _, calls = parse_calls(self.text)
        if not calls:
            return self.text[self._sent:], []
        # the content before the first call was streamed already; what follows the last call is sent now
        return self.text[self.text.rfind(CLOSE) + len(CLOSE):].strip(), calls
