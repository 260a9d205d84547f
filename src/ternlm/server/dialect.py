"""One engine path, several client APIs: a Dialect re-says the OpenAI chat answer in another API's shapes.

Why this way: every API (OpenAI Chat Completions, Anthropic Messages, Ollama, OpenAI Responses) is
turned into one OpenAI chat request and runs through the same handler (app.run_chat: template, tools,
grammar, scheduler, reuse, tenants, limits, metrics). Only the wire format differs, so a Dialect sees
what the Chat Completions endpoint would have sent — each `chat.completion.chunk` of a stream (with
the usage chunk always requested), or the whole `chat.completion` — and writes its own bytes. Errors
take each API's own shape too (`error_body`, chosen by path in errors.py).

A Dialect instance serves one request (it may keep state across chunks: open blocks, counters).
"""
from __future__ import annotations

import json

from .errors import APIError


def sse(obj: dict, event: str | None = None) -> bytes:
    """One server-sent event (`event:` line only when named, as Anthropic's stream has)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Dialect:
    """The OpenAI Chat Completions dialect itself: chunks as SSE, `[DONE]` at the end."""
    media_type = "text/event-stream"
    wants_usage = False          # whether the stream must carry the usage chunk (others always need it)

    def chunk(self, chunk: dict) -> bytes:
        """One chat.completion.chunk (choices' deltas, the final chunk, or the usage chunk)."""
        return sse(chunk)

    def done(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, err: APIError) -> bytes:
        """A failure after the stream began (headers already sent): an in-band error event."""
        return sse(err.body())

    def response(self, body: dict) -> dict:
        """The whole chat.completion -> this API's response body."""
        return body


OPENAI = Dialect()


def first_choice_message(body: dict) -> tuple[dict, str | None]:
    """(message, finish_reason) of a chat.completion's first choice (a text_completion's as a message)."""
    choice = body["choices"][0]
    message = choice.get("message") or {"role": "assistant", "content": choice.get("text", "")}   # completions
    return message, choice.get("finish_reason")


def call_arguments(call: dict) -> dict:
    """An OpenAI tool call's `arguments` (JSON text) as an object (what Anthropic and Ollama send)."""
    try:
        out = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {"value": out}
