"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the one chat path.

A request becomes an OpenAI chat request (dialect.py): `system` a system message; user text blocks its
content; `tool_result` blocks tool messages; assistant `tool_use` blocks tool_calls and `thinking`
blocks reasoning_content (templates that keep thinking render it back, so reuse covers it); tools and
tool_choice map one to one (auto / any = required / tool = a named function / none). The answer comes
back as content blocks (thinking, text, tool_use), `stop_reason`, and `usage` where
`cache_read_input_tokens` is the reused KV prefix and `input_tokens` the tokens prefilled (Anthropic
counts them apart). Streaming: message_start, content_block_start/delta/stop per block, message_delta
(stop_reason and the final usage), message_stop. Errors: `{"type": "error", "error": {type, message}}`.
`x-api-key` is accepted like the bearer key (app.ServerState.tenant).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from fastapi import Request

from .dialect import Dialect, call_arguments, first_choice_message, sse
from .errors import APIError, anthropic_body, bad_request

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TOP = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
        "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config", "cache_control",
        "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id"}
# accepted and without effect here: hints for Anthropic's own service (the KV is cached whatever
# cache_control says; there is one region and one speed)
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics", "user_profile_id",
            "workspace_id"}
_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined (what tool_result / system may carry)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, b in enumerate(content):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_request(f"{where}[{i}]: only text blocks are supported here", where)
            parts.append(b["text"])
        return "\n".join(parts)
    raise bad_request(f"{where} must be a string or a list of text blocks", where)


def _message(m: Any, i: int) -> list[dict]:
    """One Anthropic message -> OpenAI messages (a user turn's tool results become tool messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
        raise bad_request(f"{where} must be {{'role': 'user'|'assistant', 'content': ...}}", where)
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", where)
    texts, calls, results, thinking = [], [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and m["role"] == "assistant" and isinstance(b.get("name"), str):
            calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
        elif kind == "tool_result" and m["role"] == "user" and isinstance(b.get("tool_use_id"), str):
            body = _text(b.get("content", ""), at + ".content")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {body}" if b.get("is_error") else body})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            if isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])
        else:
            raise bad_request(f"{at}: block type {kind!r} is not supported in a {m['role']} message "
                              "(text, tool_use, tool_result, thinking)", at)
    out = list(results)
    if m["role"] == "assistant":
        msg: dict = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out.append(msg)
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def to_chat(raw: Any, *, counting: bool = False) -> dict:
    """An Anthropic Messages request -> the OpenAI chat request that runs it. Raises APIError(400)."""
    if not isinstance(raw, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}", unknown[0])
    if not counting and not isinstance(raw.get("max_tokens"), int):
        raise bad_request("max_tokens is required (an integer)", "max_tokens")
    if not isinstance(raw.get("messages"), list) or not raw["messages"]:
        raise bad_request("messages must be a non-empty list", "messages")
    messages = [{"role": "system", "content": _text(raw["system"], "system")}] if raw.get("system") else []
    for i, m in enumerate(raw["messages"]):
        messages += _message(m, i)
    chat: dict = {"model": raw.get("model", ""), "messages": messages}
    for src, dst in (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("stream", "stream"), ("stop_sequences", "stop")):
        if raw.get(src) is not None and not counting:
            chat[dst] = raw[src]
    if "temperature" in chat and isinstance(chat["temperature"], (int, float)):
        chat["temperature"] = float(chat["temperature"])     # Anthropic's range is 0..1: a subset of ours
    if raw.get("tools"):
        if not isinstance(raw["tools"], list):
            raise bad_request("tools must be a list", "tools")
        chat["tools"] = []
        for i, t in enumerate(raw["tools"]):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise bad_request(f"tools[{i}] needs a name and an input_schema", f"tools[{i}]")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and not counting:
        kind = choice.get("type")
        if kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in ("auto", "any", "none"):
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request("tool_choice.type must be auto, any, tool (with name) or none", "tool_choice")
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    out_cfg = raw.get("output_config")
    if out_cfg is not None and not counting:
        if not isinstance(out_cfg, dict) or set(out_cfg) - {"format", "effort"}:
            raise bad_request("output_config takes format and effort", "output_config")
        fmt = out_cfg.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise bad_request("output_config.format must be {type: json_schema, schema}", "output_config.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if out_cfg.get("effort") is not None:
            if out_cfg["effort"] not in _EFFORT:
                raise bad_request(f"output_config.effort must be one of {sorted(_EFFORT)}", "output_config.effort")
            chat["reasoning_effort"] = _EFFORT[out_cfg["effort"]]
    thinking = raw.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled") and not counting:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return chat


def _usage(u: dict | None) -> dict:
    u = u or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


class MessagesDialect(Dialect):
    """The OpenAI chat answer as an Anthropic message (streamed: Anthropic's event sequence)."""
    wants_usage = True

    def __init__(self, model: str):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self._block: str | None = None     # the open content block's kind: thinking | text
        self._index = -1
        self._finish: str | None = None

    def _envelope(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def response(self, body: dict) -> dict:
        msg, finish = first_choice_message(body)
        blocks: list[dict] = []
        if msg.get("reasoning_content"):
            blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            blocks.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or []:
            blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                           "input": call_arguments(call)})
        return {**self._envelope(), "content": blocks, "stop_reason": STOP.get(finish, "end_turn"),
                "stop_sequence": None, "usage": _usage(body.get("usage"))}

    # ---- streaming ----
    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self._index += 1
        self._block = kind
        return out + sse({"type": "content_block_start", "index": self._index, "content_block": block},
                         "content_block_start")

    def _close(self) -> bytes:
        if self._block is None:
            return b""
        out = b""
        if self._block == "thinking":   # clients expect a signature before a thinking block ends
            out = sse({"type": "content_block_delta", "index": self._index,
                       "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
        self._block = None
        return out + sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")

    def chunk(self, chunk: dict) -> bytes:
        out = b""
        if chunk.get("usage"):                                      # the last chunk: totals
            out += self._close()
            out += sse({"type": "message_delta",
                        "delta": {"stop_reason": STOP.get(self._finish, "end_turn"), "stop_sequence": None},
                        "usage": _usage(chunk["usage"])}, "message_delta")
            return out
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("role"):                                       # the first chunk
                out += sse({"type": "message_start", "message": {
                    **self._envelope(), "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}, "message_start")
            if d.get("reasoning_content"):
                if self._block != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": ""})
                out += sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "thinking_delta", "thinking": d["reasoning_content"]}},
                           "content_block_delta")
            if d.get("content"):
                if self._block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out += sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "text_delta", "text": d["content"]}}, "content_block_delta")
            for call in d.get("tool_calls") or []:
                out += self._open("tool_use", {"type": "tool_use", "id": call["id"],
                                               "name": call["function"]["name"], "input": {}})
                out += sse({"type": "content_block_delta", "index": self._index,
                            "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
                           "content_block_delta")
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        return out

    def done(self) -> bytes:
        return sse({"type": "message_stop"}, "message_stop")

    def error(self, err: APIError) -> bytes:
        return sse(anthropic_body(err), "error")


def add_routes(app, st, run_chat: Callable, read_json: Callable) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (app.py's run_chat runs the chat)."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        chat = to_chat(raw)
        return await run_chat(request, chat, tenant, MessagesDialect(chat["model"] or st.model_id))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        import asyncio
        st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        engine, _ = st.ready()
        chat = to_chat(raw, counting=True)
        from ..text import tools
        msgs, extra = tools.prepare(chat["messages"], [t for t in chat.get("tools", [])] or None,
                                    tools.supports_tools(engine.chat_template))
        try:
            ids = await asyncio.to_thread(engine.apply_chat_template, msgs, add_generation_prompt=True, **extra)
        except ValueError as e:
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        return {"input_tokens": len(ids)}
