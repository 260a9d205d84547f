"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/version`, `/api/ps`) on
the one chat path (dialect.py), for Open WebUI, Continue and the many apps that speak it by default.

Mapping: `options` temperature/top_p/top_k/min_p/seed/num_predict/stop to the sampling fields, and
repeat_penalty/repeat_last_n/frequency_penalty/presence_penalty to the penalties in llama.cpp's scope (all
three over the last repeat_last_n tokens of prompt + answer; -1 all, 0 off), with Ollama's
own defaults where the client sends none (api/types.go DefaultOptions: temperature 0.8, top_k 40, top_p 0.9,
repeat_penalty 1.1, repeat_last_n 64; so an Ollama client's greedy answer is penalized, as Ollama's is); `format`
"json" or a JSON schema through the same grammar path; `think` to the template's enable_thinking and
the answer's `message.thinking`; tools and tool calls (arguments as objects, tool results paired with
the calls in order, since Ollama's tool messages carry no call id); `keep_alive` accepted (the model
is always loaded). Streaming is NDJSON and on by default, as Ollama's. Durations are nanoseconds,
`prompt_eval_count` counts the prompt's tokens actually prefilled (the reused prefix is not evaluated).
Errors: `{"error": message}` (errors.body_for). Options that only tune Ollama's own runtime (num_ctx,
num_thread, ...) are accepted and ignored; any other is refused by name.
"""
from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Callable

from fastapi import Request

from .dialect import Dialect, call_arguments, first_choice_message
from .errors import APIError, bad_request

VERSION = "0.6.3"     # the Ollama API version these shapes follow (what /api/version answers)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1, "repeat_last_n": 64}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
             "num_predict": "max_tokens", "stop": "stop", "repeat_penalty": "repeat_penalty",
             "repeat_last_n": "repeat_last_n", "frequency_penalty": "frequency_penalty",
             "presence_penalty": "presence_penalty"}
_RUNTIME = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa",
            "num_keep", "low_vram", "vocab_only"}
_CHAT_KEYS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"}
_GENERATE_KEYS = {"model", "prompt", "system", "format", "options", "stream", "keep_alive", "think", "raw",
                  "images", "context", "suffix", "template"}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _name(raw: dict, st) -> str:
    """Ollama names carry a tag (`smollm2-135m:latest`); the served model answers to its own name."""
    name = raw.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required")
    base = name[:-len(":latest")] if name.endswith(":latest") else name
    st.check_model(base)
    return base


def _sampling(raw: dict, out: dict) -> None:
    opts = raw.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    unknown = sorted(set(opts) - set(_SAMPLING) - _RUNTIME)
    if unknown:
        raise bad_request(f"options {unknown} are not supported (supported: {sorted(_SAMPLING)}; "
                          f"ignored: {sorted(_RUNTIME)})", "options")
    out.update(DEFAULTS)
    for src, dst in _SAMPLING.items():
        if opts.get(src) is not None:
            out[dst] = opts[src]
    if isinstance(out.get("temperature"), int):
        out["temperature"] = float(out["temperature"])
    if isinstance(out.get("max_tokens"), int) and out["max_tokens"] < 0:
        del out["max_tokens"]                      # -1 / -2: until the context is full, as Ollama
    fmt = raw.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad_request("format must be 'json' or a JSON schema object", "format")
    if raw.get("think") is not None:
        if not isinstance(raw["think"], bool):
            raise bad_request("think must be a boolean (effort levels are not supported)", "think")
        out["chat_template_kwargs"] = {"enable_thinking": raw["think"]}
    out["stream"] = raw.get("stream", True) is not False


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty list", "messages")
    out, pending = [], []            # pending: ids of the last assistant turn's calls, answered in order
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool", f"messages[{i}]")
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: images are not supported by this model", f"messages[{i}]")
        msg: dict = {"role": m["role"], "content": m.get("content") or ""}
        if m["role"] == "assistant":
            if m.get("thinking"):
                msg["reasoning_content"] = m["thinking"]
            calls = m.get("tool_calls") or []
            if calls:
                pending = [f"call_{i}_{k}" for k in range(len(calls))]
                msg["tool_calls"] = [{"id": cid, "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.dumps(c["function"].get("arguments") or {})}}
                    for cid, c in zip(pending, calls)]
        elif m["role"] == "tool":
            msg["tool_call_id"] = pending.pop(0) if pending else f"call_{i}"
        out.append(msg)
    return out


def chat_request(raw: Any, st) -> dict:
    if not isinstance(raw, dict):
        raise bad_request("the body must be a JSON object")
    unknown = sorted(set(raw) - _CHAT_KEYS)
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}", unknown[0])
    out = {"model": _name(raw, st), "messages": _messages(raw.get("messages"))}
    if raw.get("tools"):
        out["tools"] = raw["tools"]
    _sampling(raw, out)
    return out


def _stats(timings: dict | None, usage: dict | None, started: float) -> dict:
    t, u = timings or {}, usage or {}
    return {"total_duration": int((time.perf_counter() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": t.get("prompt_n", u.get("prompt_tokens", 0)),
            "prompt_eval_duration": int(t.get("prompt_ms", 0) * 1e6),
            "eval_count": u.get("completion_tokens", t.get("predicted_n", 0)),
            "eval_duration": int(t.get("predicted_ms", 0) * 1e6)}


class OllamaDialect(Dialect):
    """The OpenAI chat answer as Ollama's (NDJSON lines while streaming). generate: /api/generate's
    shape (`response` text) instead of /api/chat's (`message`)."""
    media_type = "application/x-ndjson"
    wants_usage = True

    def __init__(self, model: str, generate: bool = False):
        self.model, self.generate = model, generate
        self.started = time.perf_counter()
        self._finish: str | None = None
        self._timings: dict | None = None

    def _line(self, obj: dict) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def _body(self, content: str, thinking: str | None, calls: list | None) -> dict:
        if self.generate:
            out = {"response": content}
            if thinking:
                out["thinking"] = thinking
            return out
        msg: dict = {"role": "assistant", "content": content}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = [{"function": {"name": c["function"]["name"], "arguments": call_arguments(c)}}
                                 for c in calls]
        return {"message": msg}

    def response(self, body: dict) -> dict:
        msg, finish = first_choice_message(body)
        text = msg.get("content") or ""
        return {"model": self.model, "created_at": now(),
                **self._body(text, msg.get("reasoning_content"), msg.get("tool_calls")), "done": True,
                "done_reason": "length" if finish == "length" else "stop",
                **_stats(body.get("timings"), body.get("usage"), self.started)}

    def chunk(self, chunk: dict) -> bytes:
        if chunk.get("usage"):
            return self._line({"model": self.model, "created_at": now(), **self._body("", None, None), "done": True,
                               "done_reason": "length" if self._finish == "length" else "stop",
                               **_stats(chunk.get("timings") or self._timings, chunk["usage"], self.started)})
        out = b""
        for ch in chunk.get("choices") or []:
            d = ch.get("delta") or {}
            text = d.get("content") if not self.generate else ch.get("text", d.get("content"))
            if text or d.get("reasoning_content") or d.get("tool_calls"):
                out += self._line({"model": self.model, "created_at": now(),
                                   **self._body(text or "", d.get("reasoning_content"), d.get("tool_calls")),
                                   "done": False})
            if ch.get("finish_reason"):
                self._finish = ch["finish_reason"]
        if chunk.get("timings"):
            self._timings = chunk["timings"]
        return out

    def done(self) -> bytes:
        return b""

    def error(self, err: APIError) -> bytes:
        return self._line({"error": err.message})


def add_routes(app, st, run_chat: Callable, run_completion: Callable, read_json: Callable) -> None:

    @app.post("/api/chat")
    async def chat(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        req = chat_request(raw, st)
        return await run_chat(request, req, tenant, OllamaDialect(req["model"]))

    @app.post("/api/generate")
    async def generate(request: Request):
        tenant = st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        if not isinstance(raw, dict):
            raise bad_request("the body must be a JSON object")
        unknown = sorted(set(raw) - _GENERATE_KEYS)
        if unknown:
            raise bad_request(f"unknown field(s) {unknown}", unknown[0])
        for key in ("images", "context", "suffix", "template"):
            if raw.get(key):
                raise bad_request(f"{key} is not supported by this server", key)
        model = _name(raw, st)
        prompt = raw.get("prompt") or ""
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string", "prompt")
        if not prompt:    # Ollama's "load the model" request
            st.ready()
            return {"model": model, "created_at": now(), "response": "", "done": True, "done_reason": "load"}
        out: dict = {"model": model}
        _sampling(raw, out)
        if raw.get("raw"):          # no template: the prompt as is
            out.pop("chat_template_kwargs", None)
            out["prompt"] = prompt
            if out.get("max_tokens") is None:
                out["max_tokens"] = 512
            return await run_completion(request, out, tenant, OllamaDialect(model, generate=True))
        system = raw.get("system")
        out["messages"] = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        return await run_chat(request, out, tenant, OllamaDialect(model, generate=True))

    def details() -> dict:
        eng = st.engine
        cfg = eng.config if eng is not None else None
        return {"format": "gguf" if str(st.config.model).endswith(".gguf") or eng is None
                or eng.weights_choice.mode == "gguf" else "safetensors",
                "family": cfg.arch if cfg else "", "families": [cfg.arch] if cfg else [],
                "parameter_size": "", "quantization_level": eng.weights_choice.mode if eng else ""}

    @app.get("/api/tags")
    async def tags(request: Request):
        st.tenant(request)
        digest = (st.fingerprint or "").removeprefix("fp_")
        return {"models": [{"name": f"{st.model_id}:latest", "model": f"{st.model_id}:latest",
                            "modified_at": now(), "size": 0, "digest": digest, "details": details()}]}

    @app.get("/api/ps")
    async def ps(request: Request):
        st.tenant(request)
        return {"models": [{"name": f"{st.model_id}:latest", "model": f"{st.model_id}:latest", "size": 0,
                            "digest": (st.fingerprint or "").removeprefix("fp_"), "details": details(),
                            "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0}]}

    @app.post("/api/show")
    async def show(request: Request):
        st.tenant(request)
        raw = await read_json(request, st.config.max_body_bytes)
        if not isinstance(raw, dict):
            raise bad_request("the body must be a JSON object")
        _name({"model": raw.get("model") or raw.get("name")}, st)
        eng, _ = st.ready()
        c = eng.config
        info = {"general.architecture": c.arch, f"{c.arch}.context_length": eng.ctx,
                f"{c.arch}.embedding_length": c.hidden_size, f"{c.arch}.block_count": c.num_layers}
        caps = ["completion"] + (["tools"] if eng.chat_template else []) + \
            (["thinking"] if eng.chat_template and "</think>" in eng.chat_template else [])
        return {"modelfile": "", "parameters": "", "template": eng.chat_template or "", "license": "",
                "details": details(), "model_info": info, "capabilities": caps, "modified_at": now()}

    @app.get("/api/version")
    async def version():
        return {"version": VERSION}
