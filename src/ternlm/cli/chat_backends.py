"""What a chat turn cost and where answers come from: the backends `ternlm chat` and the benchmarks
(`ternlm bench multiturn`, `streams`) drive, so the chat's numbers and the benchmarks' are measured by
the same code. Kept apart from the REPL (cli/chat.py) so the benchmarks import no command-line module.

  TurnStats       one answer's figures (reuse, prefill, decode, first token, thinking tokens)
  EngineBackend   the engine in this process;  OpenAIBackend: any OpenAI-compatible server
  Thinking        a piece of a reasoning model's thinking (shown apart, never part of the answer)
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Iterator, Protocol


# ---- what a turn cost ---------------------------------------------------------------------------

@dataclass
class TurnStats:
    """One answer's figures; None where the backend did not say. `measured` says where the prefill and
    decode figures come from: "engine" (in-process), "server" (usage + llama.cpp-style `timings` in the
    stream) or "client" (wall clock here: prefill time is then time to first token, queueing included)."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None      # positions reused from the KV: [0, cached)
    completion_tokens: int | None = None
    prefill_tokens: int | None = None     # [cached, prompt) prefilled
    prefill_s: float | None = None
    decode_tokens: int | None = None
    decode_s: float | None = None
    ttft_s: float | None = None           # request sent -> first token (engine: stream start -> first sample)
    e2e_s: float | None = None            # request sent -> answer complete
    finish_reason: str | None = None
    measured: str = "client"
    cache_tier: str | None = None         # where the reused prefix came from: slot | ram | disk (ternlm)
    reasoning_tokens: int | None = None   # tokens of thinking (reasoning models), part of completion_tokens
    drafted: int | None = None            # speculative decoding: drafted tokens verified (ternlm)
    accepted: int | None = None           # ... and kept (the model's own tokens)

    @property
    def prefill_tok_s(self) -> float | None:
        return _rate(self.prefill_tokens, self.prefill_s)

    @property
    def decode_tok_s(self) -> float | None:
        return _rate(self.decode_tokens, self.decode_s)

    def line(self) -> str:
        """`reused 2034/2065 · prefill 31 tok in 0.05 s · 48 tok/s · first token 0.07 s`; parts the
        backend did not report are left out rather than guessed."""
        parts = []
        if self.prompt_tokens is not None and self.cached_tokens is not None:
            tier = f" from {self.cache_tier}" if self.cache_tier in ("ram", "disk") else ""
            parts.append(f"reused {self.cached_tokens}/{self.prompt_tokens}{tier}")
        elif self.prompt_tokens is not None:
            parts.append(f"prompt {self.prompt_tokens} tok")
        if self.prefill_s is not None:
            n = f"{self.prefill_tokens} tok " if self.prefill_tokens is not None else ""
            parts.append(f"prefill {n}in {self.prefill_s:.2f} s")
        if self.decode_tok_s is not None:
            parts.append(f"{self.decode_tok_s:.0f} tok/s")
        if self.reasoning_tokens:
            parts.append(f"thought {self.reasoning_tokens} tok")
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s:.2f} s")
        if self.drafted:             # speculative decoding: drafted tokens the model made its own
            parts.append(f"drafts {self.accepted}/{self.drafted} taken")
        if self.measured == "client":
            parts.append("timed client-side")
        return " · ".join(parts)


def _rate(n: int | None, s: float | None) -> float | None:
    return n / s if n is not None and s else None


# ---- backends -----------------------------------------------------------------------------------

class Thinking(str):
    """A piece of a reasoning model's thinking (reasoning_content): shown dimmed, apart from the answer,
    and not part of the answer kept in the history (templates drop old thinking anyway)."""

class Backend(Protocol):
    label: str

    def stream(self, messages: list[dict], *, max_tokens: int, temperature: float,
               seed: int | None = None) -> Iterator[str | TurnStats]:
        """Answer `messages` (the whole transcript): yield text pieces, then exactly one TurnStats.
        Closing the iterator early cancels the answer (no TurnStats then). Side effect: the backend's
        KV (engine slot or server) now holds this conversation."""
        ...


class EngineBackend:
    """The engine in this process. Not thread-safe (nor is the engine): one stream at a time."""

    def __init__(self, engine, label: str):
        self.engine = engine
        self.label = label

    def stream(self, messages: list[dict], *, max_tokens: int, temperature: float,
               seed: int | None = None) -> Iterator[str | TurnStats]:
        from ..engine.core import Completion
        t0 = time.perf_counter()
        from ..text import reasoning
        ids = self.engine.apply_chat_template(messages, add_generation_prompt=True)
        split = (reasoning.Splitter(reasoning.prompt_opens_thinking(self.engine.tokenizer.decode(ids[-16:])))
                 if reasoning.template_thinks(self.engine.chat_template) else None)
        thought = 0
        events = self.engine.stream(ids, max_tokens=max_tokens, temperature=temperature, seed=seed)
        try:
            for ev in events:
                if isinstance(ev, Completion):
                    if split is not None:
                        r, c = split.finish()
                        yield from ([Thinking(r)] if r else []) + ([c] if c else [])
                    t = ev.timings
                    yield TurnStats(ev.prompt_tokens, ev.cached_tokens, len(ev.token_ids), t.prefill_tokens,
                                    t.prefill_s, t.decode_tokens, t.decode_s, t.ttft_s,
                                    time.perf_counter() - t0, ev.finish_reason, measured="engine",
                                    cache_tier=ev.restored.tier, reasoning_tokens=thought if split else None,
                                    drafted=t.drafted, accepted=t.accepted)
                elif split is not None:
                    before = split.thinking
                    r, c = split.feed(ev.text)
                    thought += before and split.thought
                    yield from ([Thinking(r)] if r else []) + ([c] if c else [])
                elif ev.text:
                    yield ev.text
        finally:
            events.close()   # [CANCEL] stops after the current step; the slot's record stays exact


class OpenAIBackend:
    """Any OpenAI-compatible /v1 server through the official client, streaming with include_usage.
    Time to first token and end-to-end time are always measured here (what a user waits for); prefill
    and decode come from the server's llama.cpp-style `timings` when it sends them (ternlm and llama.cpp
    do), else from the wall clock. `model`: the name to send; None = the first of GET /models."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, label: str | None = None,
                 timeout_s: float = 600.0):
        try:
            from openai import OpenAI
        except ImportError as e:   # a test extra today; `pip install openai` is enough
            raise ValueError("--url needs the `openai` package: pip install 'openai==3.57.0'") from e
        self.url = url.rstrip("/")
        self.client = OpenAI(base_url=self.url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "none",
                             timeout=timeout_s, max_retries=0)
        self.model = model or self._first_model()
        self.label = label or f"{self.model} @ {self.url}"

    def _first_model(self) -> str:
        try:
            models = self.client.models.list().data
        except Exception as e:  # noqa: BLE001 - any failure here means "ask with a placeholder name"
            logging.getLogger("ternlm").debug("GET /models failed: %s", e)
            models = []
        return models[0].id if models else "default"

    def stream(self, messages: list[dict], *, max_tokens: int, temperature: float | None,
               seed: int | None = None, sampling: dict | None = None) -> Iterator[str | TurnStats]:
        """As Backend.stream; `temperature` None: none sent (the server's default, as many clients do);
        `sampling`: more body fields sent as given (top_p, presence_penalty, ...)."""
        extra = {"seed": seed} if seed is not None else {}
        if temperature is not None:
            extra["temperature"] = temperature
        t0 = time.perf_counter()
        resp = self.client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=dict(sampling or {}), **extra)
        st = TurnStats()
        t_first = None
        pieces = 0
        usage = timings = None
        try:
            for chunk in resp:
                usage = chunk.usage or usage
                timings = (chunk.model_extra or {}).get("timings") or timings
                for choice in chunk.choices:
                    st.finish_reason = choice.finish_reason or st.finish_reason
                    text = choice.delta.content if choice.delta else None
                    thinking = (choice.delta.model_extra or {}).get("reasoning_content") if choice.delta else None
                    if thinking:
                        if t_first is None:
                            t_first = time.perf_counter()
                        yield Thinking(thinking)
                    if text:
                        if t_first is None:
                            t_first = time.perf_counter()
                        pieces += 1
                        yield text
        finally:
            resp.close()     # [CANCEL] a closed connection is how an OpenAI client cancels
        t_end = time.perf_counter()
        st.ttft_s = (t_first or t_end) - t0
        st.e2e_s = t_end - t0
        _fill(st, usage, timings, pieces, t_first, t_end)
        yield st


def _fill(st: TurnStats, usage, timings: dict | None, pieces: int, t_first: float | None, t_end: float) -> None:
    """Token counts from `usage`, prefill/decode from `timings`; what neither gives, from the clock."""
    if usage is not None:
        st.prompt_tokens, st.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        details = usage.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            st.cached_tokens = details.cached_tokens
        done = getattr(usage, "completion_tokens_details", None)
        if done is not None and getattr(done, "reasoning_tokens", None):
            st.reasoning_tokens = done.reasoning_tokens
    if timings and timings.get("prompt_ms") is not None and timings.get("predicted_ms") is not None:
        st.measured = "server"
        st.prefill_tokens = int(timings.get("prompt_n", 0))
        st.prefill_s = timings["prompt_ms"] / 1e3
        st.decode_tokens = int(timings.get("predicted_n", 0))
        st.decode_s = timings["predicted_ms"] / 1e3
        if st.cached_tokens is None and timings.get("cache_n") is not None:
            st.cached_tokens = int(timings["cache_n"])
        st.cache_tier = timings.get("cache_tier")
        st.drafted, st.accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        return
    if st.prompt_tokens is not None and st.cached_tokens is not None:
        st.prefill_tokens = st.prompt_tokens - st.cached_tokens
    st.prefill_s = st.ttft_s
    n = st.completion_tokens if st.completion_tokens is not None else pieces
    if t_first is not None and n > 1:    # the first token's time is in ttft; the rest is decode
        st.decode_tokens, st.decode_s = n - 1, t_end - t_first
