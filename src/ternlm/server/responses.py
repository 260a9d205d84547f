"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) on the one chat path.

A request becomes an OpenAI chat request (dialect.py): `instructions` a first system message, `input`
(a string or items) messages — `message` items by role, `reasoning` items the next assistant message's
reasoning_content, `function_call` items its tool_calls, `function_call_output` items tool messages —
and `text.format`, `tools`, `tool_choice`, `reasoning.effort`, `max_output_tokens` their chat fields.
The answer comes back as output items (reasoning, message, function_call) with `usage.input_tokens_details.
cached_tokens` the reused KV prefix; streamed, as the Responses event sequence (`response.created` ...
`response.completed`, each event named by its `type` and numbered by `sequence_number`). Accepted without
effect: `safety_identifier`, `service_tier` auto/default, `truncation` disabled, `reasoning.summary` auto
(no summaries are made: `summary` is []). Refused by name (400): hosted tools, `conversation`, `prompt`,
`include`, `background`, `item_reference` items, image/file parts. ternlm extensions: text.format `regex` /
`grammar`, `chat_template_kwargs`.

Why the server keeps conversations: `previous_response_id` says "continue that one", so the client
sends only the new input. A stored response keeps the chat messages that produced it (without its
`instructions`: OpenAI does not carry them over) plus its answer as an assistant message
(reasoning_content, tool_calls), so a continuation is exactly that list + the new input: the same
messages a Chat Completions client would resend, rendered by the same template into the same tokens.
Every response of one chain passes `prompt_cache_key` = the chain's root id, so it goes to the slot
holding the chain's KV and only the new input is prefilled (token-exact prefix reuse does the rest).

The store (ResponseStore) is in memory, per server and per tenant (a response of another API key is a
404, as if it did not exist), bounded (MAX_STORED responses, MAX_STORED_BYTES of JSON; least recently
used dropped first) and expiring (STORE_TTL_S after its last use). It is NOT kept across restarts: a
restarted server answers 404 for an old id, and a client continues by resending the conversation
(`input` items, no previous_response_id), which the tiers' KV may still serve.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request

from .dialect import Dialect, first_choice_message, sse
from .errors import APIError, bad_request, unsupported

MAX_STORED = 1000                  # responses kept per server (all tenants together)
MAX_STORED_BYTES = 64 << 20        # their JSON size together
STORE_TTL_S = 24 * 3600.0          # a stored response not used for this long is dropped

_TOP = {"model", "input", "instructions", "previous_response_id", "store", "stream", "max_output_tokens",
        "temperature", "top_p", "tools", "tool_choice", "text", "parallel_tool_calls", "reasoning", "metadata",
        "user", "prompt_cache_key", "safety_identifier", "truncation", "include", "service_tier", "background",
        "chat_template_kwargs"}
# known Responses fields with no meaning here: refused by name (unsupported_parameter), never ignored
_UNSUPPORTED = {"conversation", "prompt", "max_tool_calls", "top_logprobs", "stream_options", "context_management",
                "prompt_cache_retention", "prompt_cache_options", "access_programs", "background_options", "image",
                "moderation"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the store --------------------------------------------------------------------------------

@dataclass
class Stored:
    """One stored response: its body (what GET returns), the chat messages behind it plus its answer
    (what a continuation starts from), and the chain's root id (its prompt_cache_key)."""
    tenant: str
    body: dict
    messages: list[dict]
    root: str
    size: int = 0
    used: float = field(default_factory=time.monotonic)


class ResponseStore:
    """Stored responses of one server, LRU within count and byte bounds, expiring after `ttl_s` unused.
    Touched only on the event loop (routes and the SSE generator), so it takes no lock."""

    def __init__(self, max_items: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES, ttl_s: float = STORE_TTL_S):
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    def put(self, s: Stored) -> None:
        """Keep `s` under its body's id. Side effect: drops expired entries, then the least recently
        used until the bounds hold (a response larger than the whole budget is not kept)."""
        s.size = len(json.dumps([s.body, s.messages], ensure_ascii=False))
        self._drop(s.body["id"])
        if s.size > self.max_bytes:      # would evict everyone else and still not fit
            return
        self._items[s.body["id"]] = s
        self._bytes += s.size
        self._expire()
        while self._items and (len(self._items) > self.max_items or self._bytes > self.max_bytes):
            self._drop(next(iter(self._items)))

    def get(self, tenant: str, rid: Any) -> Stored | None:
        """The tenant's stored response `rid`, or None (absent, expired, or another tenant's).
        Side effect: marks it recently used."""
        self._expire()
        s = self._items.get(rid) if isinstance(rid, str) else None
        if s is None or s.tenant != tenant:
            return None
        s.used = time.monotonic()
        self._items.move_to_end(rid)
        return s

    def delete(self, tenant: str, rid: str) -> bool:
        if self.get(tenant, rid) is None:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        s = self._items.pop(rid, None)
        if s is not None:
            self._bytes -= s.size

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._items:
            rid, s = next(iter(self._items.items()))     # least recently used first: stop at the first fresh
            if s.used >= cutoff:
                return
            self._drop(rid)


def not_found(rid: Any, param: str | None = None) -> APIError:
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id {str(rid)[:80]!r} not found.", param=param, code="not_found")


# ---- request -> chat --------------------------------------------------------------------------

def _text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A string, or text parts ({type in kinds, text}) joined by newlines as the chat path joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    parts = []
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise bad_request(f"{where}[{i}]: content part {kind!r} is not supported (only {', '.join(kinds)})",
                              f"{where}[{i}]")
        parts.append(p["text"])
    return "\n".join(parts)


def input_messages(items: Any) -> list[dict]:
    """`input` -> chat messages. A reasoning item's text goes to the next assistant message; consecutive
    function_call items join the assistant message before them (one turn's calls, as chat sends them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    thinking: list[str] = []

    def assistant(content: str | None) -> dict:
        m: dict = {"role": "assistant", "content": content}
        if thinking:
            m["reasoning_content"] = "".join(thinking)
            thinking.clear()
        out.append(m)
        return m

    for i, it in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_request(f"{at} must be an object", at)
        kind = it.get("type", "message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{at}.role must be user, system, developer or assistant", f"{at}.role")
            text = _text(it.get("content"), f"{at}.content",
                         ("output_text", "refusal") if role == "assistant" else ("input_text",))
            if role == "assistant":
                assistant(text)
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            for part in (it.get("content") or []):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    thinking.append(part["text"])
        elif kind == "function_call":
            if not all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{at}: a function_call item needs call_id, name and arguments (strings)", at)
            last = out[-1] if out and out[-1]["role"] == "assistant" and not thinking else assistant(None)
            last.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise bad_request(f"{at}: a function_call_output item needs call_id", f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _text(it.get("output"), f"{at}.output", ("input_text",))})
        else:
            raise bad_request(f"{at}: item type {kind!r} is not supported (message, reasoning, function_call, "
                              "function_call_output)", f"{at}.type")
    return out


def _tools(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise unsupported(f"tools[{i}].type", f"tools[{i}]: tool type {kind!r} is not supported (only 'function')")
        extra = set(t) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise bad_request(f"tools[{i}]: unknown field(s) {sorted(extra)}", f"tools[{i}]")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(raw: Any) -> Any:
    if raw in ("none", "auto", "required"):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    raise unsupported("tool_choice", "tool_choice must be 'none', 'auto', 'required' or {type: 'function', name}")


def _format(text: Any) -> dict | None:
    """text.format -> response_format (None: plain text)."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text must be an object with 'format'", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "text.verbosity other than 'medium' is not supported")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        body = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": body}
    if kind in ("regex", "grammar"):      # ternlm's extensions, as the chat path's response_format takes them
        return {"type": kind, kind: fmt.get(kind)}
    raise bad_request("text.format.type must be text, json_object or json_schema (or ternlm's regex, grammar)",
                      "text.format.type")


@dataclass(frozen=True)
class Plan:
    """What one request runs and what its response echoes. history: the chat messages it continues +
    its input, without the instructions (what is stored with its answer)."""
    chat: dict
    history: list[dict]
    echo: dict
    root: str
    store: bool


def to_chat(raw: Any, previous: Stored | None, rid: str, default_model: str) -> Plan:
    """A Responses request (+ the stored response it continues) -> the chat request that runs it.
    Pure; raises APIError(400) naming the field."""
    if not isinstance(raw, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_body")
    raw = {k: v for k, v in raw.items() if v is not None}      # null = the default, as OpenAI reads it
    for name in sorted(set(raw) & _UNSUPPORTED):
        raise unsupported(name)
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    if raw.get("background"):
        raise unsupported("background", "background responses are not supported")
    if raw.get("truncation", "disabled") != "disabled":
        raise unsupported("truncation", "truncation 'auto' is not supported: the context is never cut")
    if raw.get("include"):
        raise unsupported("include", f"include {raw['include']!r} is not supported")
    if raw.get("service_tier", "auto") not in ("auto", "default"):
        raise unsupported("service_tier")
    if "input" not in raw:
        raise bad_request("Missing required parameter: 'input'", "input", "missing_required_parameter")
    store = raw.get("store", True)
    if not isinstance(store, bool):
        raise bad_request("store must be a boolean", "store")
    instructions = raw.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    history = (list(previous.messages) if previous else []) + input_messages(raw["input"])
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    model = raw.get("model") or default_model
    root = previous.root if previous else rid
    chat: dict = {"model": model, "messages": messages,
                  # the chain's slot holds its KV: route every turn there (a client's own key wins)
                  "prompt_cache_key": raw.get("prompt_cache_key", f"ternlm-responses:{root}")}
    for src, dst in (("stream", "stream"), ("max_output_tokens", "max_completion_tokens"),
                     ("temperature", "temperature"), ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("user", "user"), ("chat_template_kwargs", "chat_template_kwargs")):
        if src in raw:
            chat[dst] = raw[src]
    tools = raw.get("tools") or []
    if tools:
        chat["tools"] = _tools(tools)
    if "tool_choice" in raw:
        chat["tool_choice"] = _tool_choice(raw["tool_choice"])
    text = raw.get("text", {"format": {"type": "text"}})
    fmt = _format(text)
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = raw.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise bad_request("reasoning takes effort and summary", "reasoning")
        if reasoning.get("summary", "auto") not in ("auto", None) or reasoning.get("generate_summary"):
            raise unsupported("reasoning.summary", "reasoning summaries are not produced (summary 'auto' only)")
        effort = reasoning.get("effort")
        if effort is not None:
            if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
                raise bad_request("reasoning.effort must be none, minimal, low, medium, high or xhigh",
                                  "reasoning.effort")
            if not isinstance(chat.get("chat_template_kwargs", {}), dict):
                raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
            # to the template as the chat path passes reasoning_effort (templates that read it)
            chat["chat_template_kwargs"] = {"reasoning_effort": effort, **chat.get("chat_template_kwargs", {})}
    metadata = raw.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16
                                 or not all(isinstance(v, str) for v in metadata.values())):
        raise bad_request("metadata must be an object of at most 16 string values", "metadata")
    echo = {"model": model, "instructions": instructions, "previous_response_id": raw.get("previous_response_id"),
            "tools": [{"type": "function", "name": t["function"]["name"],
                       "description": t["function"].get("description"),
                       "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict", True)}
                      for t in chat.get("tools", [])],
            "tool_choice": raw.get("tool_choice", "auto"), "text": text,
            "temperature": raw.get("temperature", 1.0), "top_p": raw.get("top_p", 1.0),
            "max_output_tokens": raw.get("max_output_tokens"), "store": store, "metadata": metadata or {},
            "parallel_tool_calls": raw.get("parallel_tool_calls", True), "truncation": "disabled",
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
            "user": raw.get("user"), "prompt_cache_key": raw.get("prompt_cache_key"),
            "background": False, "service_tier": "default"}
    return Plan(chat, history, echo, root, store)


# ---- chat answer -> response ------------------------------------------------------------------

def usage(u: dict | None) -> dict:
    """Chat usage -> Responses usage. cache_write_tokens: the tokens prefilled (their KV is now cached)."""
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    prompt, out = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
            "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": (u.get("completion_tokens_details") or {})
                                      .get("reasoning_tokens") or 0},
            "total_tokens": prompt + out}


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": iid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(iid: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def call_item(iid: str, call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": iid, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class ResponsesDialect(Dialect):
    """The OpenAI chat answer as a Response object (streamed: the Responses event sequence). When the
    answer is complete and the request asked to store it, `keep(Stored)` stores it."""
    wants_usage = True

    def __init__(self, rid: str, plan: Plan, tenant: str, keep: Callable[[Stored], None]):
        self.id, self.plan, self.tenant, self.keep = rid, plan, tenant, keep
        self.created = int(time.time())
        self._seq = 0
        self._items: list[dict] = []          # output items closed so far (stream)
        self._open: dict | None = None        # the item being streamed: reasoning | message
        self._reasoning, self._content, self._calls = [], [], []
        self._finish: str | None = None

    def _envelope(self, status: str, output: list[dict], u: dict | None = None) -> dict:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "error": None, "incomplete_details": None, "output": output, "usage": u, **self.plan.echo}
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        return out

    def _finished(self, output: list[dict], chat_usage: dict | None, message: dict) -> dict:
        """The final Response. Side effect: stores it (with the conversation + `message`) if asked."""
        status = "incomplete" if self._finish == "length" else "completed"
        body = self._envelope(status, output, usage(chat_usage))
        if self.plan.store:
            self.keep(Stored(self.tenant, body, self.plan.history + [message], self.plan.root))
        return body

    def _item_status(self) -> str:
        return "incomplete" if self._finish == "length" else "completed"   # cut at max_output_tokens

    @staticmethod
    def _assistant(content: str | None, reasoning: str | None, calls: list[dict]) -> dict:
        """The answer as the chat message a client would send back (what a continuation renders)."""
        m: dict = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            m["reasoning_content"] = reasoning
        if calls:
            m["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]
        return m

    def response(self, body: dict) -> dict:
        msg, self._finish = first_choice_message(body)
        output = []
        if msg.get("reasoning_content") is not None:
            output.append(reasoning_item(_new_id("rs"), msg["reasoning_content"]))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            output.append(message_item(_new_id("msg"), msg.get("content") or "", self._item_status()))
        output += [call_item(_new_id("fc"), c) for c in calls]
        return self._finished(output, body.get("usage"),
                              self._assistant(msg.get("content"), msg.get("reasoning_content"), calls))

    # ---- streaming ----
    def _ev(self, kind: str, **fields) -> bytes:
        self._seq += 1
        return sse({"type": kind, "sequence_number": self._seq - 1, **fields}, kind)

    def _start(self, item: dict) -> bytes:
        """Opens an output item (closing the open one)."""
        out = self._close()
        self._open = item
        out += self._ev("response.output_item.added", output_index=len(self._items), item=item)
        if item["type"] in ("message", "reasoning"):
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []} \
                if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            out += self._ev("response.content_part.added", item_id=item["id"], output_index=len(self._items),
                            content_index=0, part=part)
        return out

    def _close(self) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        where = {"item_id": item["id"], "output_index": len(self._items)}
        if item["type"] == "message":
            text = "".join(self._content)
            done = message_item(item["id"], text, self._item_status())
            out = self._ev("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            out += self._ev("response.content_part.done", **where, content_index=0, part=done["content"][0])
        else:
            text = "".join(self._reasoning)
            done = reasoning_item(item["id"], text)
            out = self._ev("response.reasoning_text.done", **where, content_index=0, text=text)
            out += self._ev("response.content_part.done", **where, content_index=0, part=done["content"][0])
        self._items.append(done)
        return out + self._ev("response.output_item.done", output_index=len(self._items) - 1, item=done)

    def chunk(self, chunk: dict) -> bytes:
        if chunk.get("usage"):                                       # the last chunk: totals
            out = b""
            if self._open is None and not self._calls and not any(i["type"] == "message" for i in self._items):
                out += self._start(message_item(_new_id("msg"), None, "in_progress"))   # an empty answer
            out += self._close()
            message = self._assistant("".join(self._content), "".join(self._reasoning)
                                      if any(i["type"] == "reasoning" for i in self._items) else None, self._calls)
            body = self._finished(self._items, chunk["usage"], message)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            return out + self._ev(kind, response=body)
        out = b""
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("role"):                                        # the first chunk
                out += self._ev("response.created", response=self._envelope("in_progress", []))
                out += self._ev("response.in_progress", response=self._envelope("in_progress", []))
            if d.get("reasoning_content"):
                if self._open is None or self._open["type"] != "reasoning":
                    out += self._start({"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                                        "status": "in_progress"})
                self._reasoning.append(d["reasoning_content"])
                out += self._ev("response.reasoning_text.delta", item_id=self._open["id"],
                                output_index=len(self._items), content_index=0, delta=d["reasoning_content"])
            if d.get("content"):
                if self._open is None or self._open["type"] != "message":
                    out += self._start(message_item(_new_id("msg"), None, "in_progress"))
                self._content.append(d["content"])
                out += self._ev("response.output_text.delta", item_id=self._open["id"],
                                output_index=len(self._items), content_index=0, delta=d["content"], logprobs=[])
            for call in d.get("tool_calls") or []:
                call = {"id": call["id"], "type": "function", "function": dict(call["function"])}
                self._calls.append(call)
                iid = _new_id("fc")
                out += self._start({**call_item(iid, call, "in_progress"), "arguments": ""})
                self._open = None                                    # a call is whole at once: closed here
                where = {"item_id": iid, "output_index": len(self._items)}
                args = call["function"]["arguments"]
                out += self._ev("response.function_call_arguments.delta", **where, delta=args)
                out += self._ev("response.function_call_arguments.done", **where, arguments=args)
                self._items.append(call_item(iid, call))
                out += self._ev("response.output_item.done", output_index=len(self._items) - 1, item=self._items[-1])
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def done(self) -> bytes:
        return b""                                                   # the Responses stream has no [DONE]

    def error(self, err: APIError) -> bytes:
        out = self._ev("error", code=err.code, message=err.message, param=err.param)
        failed = self._envelope("failed", self._items)
        failed["error"] = {"code": "server_error", "message": err.message}
        return out + self._ev("response.failed", response=failed)


# ---- routes -----------------------------------------------------------------------------------

def add_routes(app, st, run_chat: Callable, read_json: Callable, store: ResponseStore | None = None) -> None:
    """POST /v1/responses, GET and DELETE /v1/responses/{id}. The store is this app's own (one per
    server: nothing global), reachable as app.state.responses."""
    store = store if store is not None else ResponseStore()
    app.state.responses = store

    @app.post("/v1/responses")
    async def create(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        previous = None
        if isinstance(raw, dict) and raw.get("previous_response_id") is not None:
            pid = raw["previous_response_id"]
            previous = store.get(tenant, pid)
            if previous is None:
                raise not_found(pid, "previous_response_id")
        rid = _new_id("resp")
        plan = to_chat(raw, previous, rid, st.model_id)
        return await run_chat(request, plan.chat, tenant, ResponsesDialect(rid, plan, tenant, store.put))

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str, request: Request):
        tenant = st.tenant(request)
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise unsupported("stream", "streaming a stored response again is not supported")
        s = store.get(tenant, rid)
        if s is None:
            raise not_found(rid)
        return s.body

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request):
        tenant = st.tenant(request)
        if not store.delete(tenant, rid):
            raise not_found(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}
