"""One streamed answer (greedy unless a sampling setting says otherwise) to a prompt of token ids, from
`ternlm serve` (/v1/completions) or llama.cpp's `llama-server` (its native /completion), timed on both
sides: the server's own decode time (`timings`: predicted_n / predicted_ms, and speculation's draft_n /
draft_n_accepted, llama.cpp's names, which ternlm uses too) and the client's clock (first streamed piece
-> last). Ids, not text: both servers evaluate exactly the ids the benchmark rendered (no second tokenizer
or chat template, no BOS added)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from .sampling_settings import Sampling

TERNLM, LLAMA_SERVER = "ternlm", "llama-server"


@dataclass(frozen=True)
class Target:
    """A running server: which kind, where (http://host:port), and the model id it serves (OpenAI's
    `model`, which ternlm requires)."""
    kind: str
    base: str
    model: str = ""
    pid: int | None = None    # the server process (the benchmark started it and stops it)


def served_model(base: str) -> str:
    """The first model id GET /v1/models lists."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int        # timings.cache_n: the prompt prefix reused from the server's cache
    prompt_ms: float          # server: prefilling the rest
    decode_tokens: int        # timings.predicted_n: tokens generated
    decode_ms: float          # server: timings.predicted_ms
    drafted: int | None       # timings.draft_n: drafted tokens verified (None: the server reported none)
    accepted: int | None      # timings.draft_n_accepted
    wall_s: float             # client: request sent -> last byte
    ttft_s: float             # client: request sent -> first streamed piece
    stream_s: float           # client: first streamed piece -> last (the decode as a client sees it)
    finish: str | None

    @property
    def server_tok_s(self) -> float | None:
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else None

    @property
    def client_tok_s(self) -> float | None:
        # the first token came with the prefill: the rest arrived over stream_s
        return (self.decode_tokens - 1) / self.stream_s if self.stream_s > 0 and self.decode_tokens > 1 else None


def request_body(t: Target, ids: list[int], max_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0) -> tuple[str, dict]:
    """(path, JSON body) of a streamed request for `t`'s kind of server at `sampling` (default greedy),
    seeded when sampled. Pure."""
    seeded = {} if sampling.greedy else {"seed": seed}
    if t.kind == TERNLM:
        return "/v1/completions", {"model": t.model, "prompt": ids, "max_tokens": max_tokens, **sampling.openai_fields(),
                                   **seeded, "stream": True, "return_tokens": True}
    return "/completion", {"prompt": ids, "n_predict": max_tokens, **sampling.llama_fields(), **seeded,
                           "cache_prompt": True, "return_tokens": True, "stream": True}


def _events(resp):
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def stream_ids(t: Target, ids: list[int], max_tokens: int, timeout_s: float = 3600.0,
               sampling: Sampling = Sampling(), seed: int = 0) -> Answer:
    """POST one streamed request to the server `t` and collect its answer.
    Side effect: the server's slot now holds `ids` and the answer. Raises on a non-200 or a stream
    without timings."""
    kind, base = t.kind, t.base
    path, body = request_body(t, ids, max_tokens, sampling, seed)
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    pieces, tokens, timings, finish = [], [], None, None
    first = last = None
    t0 = time.perf_counter()
    try:
        resp = urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{base}{path}: HTTP {e.code}: {e.read()[:500].decode('utf-8', 'replace')}") from None
    with resp:
        for ev in _events(resp):
            now = time.perf_counter()
            if kind == TERNLM:
                ch = ev["choices"][0]
                text, finish = ch.get("text") or "", ch.get("finish_reason") or finish
                if ch.get("tokens") is not None:
                    tokens = list(ch["tokens"])            # the final chunk: every generated id
            else:
                text = ev.get("content") or ""
                tokens += ev.get("tokens") or []
                finish = ev.get("stop_type") if ev.get("stop") else finish
            if text:
                pieces.append(text)
                first, last = first or now, now
            timings = ev.get("timings") or timings
    wall = time.perf_counter() - t0
    if timings is None:
        raise RuntimeError(f"{base}{path}: the stream ended without timings")
    return Answer("".join(pieces), tuple(tokens), len(ids), int(timings.get("cache_n", 0)),
                  float(timings.get("prompt_ms", 0.0)), int(timings.get("predicted_n", len(tokens))),
                  float(timings.get("predicted_ms", 0.0)), timings.get("draft_n"), timings.get("draft_n_accepted"),
                  wall, (first or t0 + wall) - t0, (last - first) if first else 0.0, finish)
