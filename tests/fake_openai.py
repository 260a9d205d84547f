"""Test helper: a tiny OpenAI-compatible chat server (stdlib http.server, own thread, free port).

Why a fake next to the real server: it answers exactly what a test tells it to (so a benchmark can be
shown a contender that disagrees), can stream forever (so Ctrl-C lands mid-answer for sure), sends no
usage or timings (the client-side fallback), and records what clients sent and when they hung up.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def count_answer(messages: list[dict]) -> str:
    """Default answer: deterministic in the transcript, like a greedy model."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return f"Answer number {len(users)} to {users[-1][:12]!r}."


class FakeOpenAI:
    """answer(messages) -> text, or None to stream "tick " every `delay_s` until the client leaves."""

    def __init__(self, answer: Callable[[list[dict]], str | None] = count_answer, delay_s: float = 0.0,
                 model: str = "fake-model"):
        self.answer = answer
        self.delay_s = delay_s
        self.model = model
        self.requests: list[dict] = []          # request bodies, in arrival order
        self.disconnects = 0                    # streams the client closed before the end
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _json(self, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._json({"object": "list", "data": [{"id": fake.model, "object": "model", "created": 0,
                                                        "owned_by": "test"}]})

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(req)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                text = fake.answer(req["messages"])
                pieces = (p + " " for p in text.split(" ")) if text is not None else _forever()
                try:
                    self._event({"role": "assistant", "content": ""}, None)
                    for p in pieces:
                        time.sleep(fake.delay_s)
                        self._event({"content": p}, None)
                    self._event({}, "stop")
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    fake.disconnects += 1

            def _event(self, delta: dict, finish: str | None) -> None:
                chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                         "model": fake.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()

        return Handler


def _forever():
    while True:
        yield "tick "
