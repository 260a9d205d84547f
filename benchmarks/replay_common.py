"""Replay glue shared by benchmarks/reasoning_replay.py, swa_replay.py and hybrid_replay.py: the llama.cpp
peers (started by ternlm.bench.llamacpp, the project's one llama.cpp launcher), one streaming client for every
engine, and the prompt arithmetic.

Two llama.cpp peers. `LlamaCpp`: llama-cpp-python 0.3.36's OpenAI server (`make bench-peers`,
`.venv-peers/bin/python -m llama_cpp.server`). It cannot take a jinja chat template, so the replays render
each prompt here with ternlm's own renderer (ternlm.text.chat.render_chat, the code `ternlm serve` runs) and
send the text to its /v1/completions. What it did with the prompt is read from its verbose log:
`Llama.generate: N prefix-match hit, remaining M prompt tokens to eval` (M = tokens it processed; no such
line = it reset and processed the whole prompt) and `llama_perf_context_print: prompt eval time`.
`LlamaServer`: llama.cpp's own `llama-server` binary (scripts/build-llamacpp), sent the same token ids as
ternlm (a prompt of ids is evaluated as given) on /v1/completions; what it processed is in its answer's
`timings` (`cache_n` reused, `prompt_n` evaluated, `prompt_ms`), no log reading needed.

Both engines' processes get OMP_WAIT_POLICY=PASSIVE unless the caller set it: both are OpenMP builds
(libggml links libgomp), and spinning OpenMP barriers collapse when the 2 cores are shared (measured
here: llama.cpp decode 2.8 s a token spinning under load 11, in an early probe).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

from ternlm.bench.llamacpp import (LLAMA_SERVER, LlamaCppServer, find_bin, llama_server_argv, llamacpp_server_argv,
                                   peers_python)
from ternlm.bench.procs import TernlmServe

ROOT = Path(__file__).resolve().parents[1]

ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
MODELS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ternlm" / "models"

_PREFIX_HIT = re.compile(r"Llama\.generate: (\d+) prefix-match hit, remaining (\d+) prompt tokens to eval")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")
_EVAL = re.compile(r" eval time =\s+([\d.]+) ms /\s+(\d+) runs")
_TOTAL = re.compile(r"total time =\s+([\d.]+) ms")


# ---- one answer, whichever engine -------------------------------------------------------------

@dataclass
class Answer:
    """One streamed answer. `processed`: prompt tokens the server evaluated for it (ternlm: timings.prompt_n;
    llama.cpp: its log). `tokens`: generated ids where the server returns them (ternlm, return_tokens)."""
    text: str
    reasoning: str | None
    ttft_s: float                      # client: request sent -> first chunk with text (thinking included)
    e2e_s: float
    prompt_tokens: int | None = None
    processed: int | None = None
    cached: int | None = None          # ternlm: usage.prompt_tokens_details.cached_tokens
    server_prefill_s: float | None = None
    tokens: list[int] | None = None
    finish_reason: str | None = None
    why: str | None = None             # ternlm: timings.cache_reason; llama.cpp: its prefix-match log line
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None


def stream_json(url: str, body: dict, timeout_s: float = 1800.0):
    """POST `body` with stream=True and yield (arrival perf_counter, decoded SSE `data:` object); keep-alive
    comments and [DONE] are skipped. Raises on a non-200 answer with its body."""
    with httpx.stream("POST", url, json=body, timeout=timeout_s) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"POST {url}: {r.status_code} {r.text[:2000]}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield time.perf_counter(), json.loads(line[6:])


def collect(url: str, body: dict) -> Answer:
    """Stream one completion or chat completion (either engine) and gather its text, thinking, first-text
    time and ternlm's usage/timings/tokens. Thinking arrives as delta.reasoning_content (ternlm's split)."""
    text, thought, first = [], [], None
    usage = timings = tokens = finish = None
    t0 = time.perf_counter()
    for at, chunk in stream_json(url, body):
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
        for c in chunk.get("choices", []):
            finish = c.get("finish_reason") or finish
            tokens = c.get("tokens", tokens)
            d = c.get("delta") or {}
            piece, think = c.get("text", d.get("content")) or "", d.get("reasoning_content") or ""
            if (piece or think) and first is None:
                first = at
            text.append(piece)
            thought.append(think)
    t1 = time.perf_counter()
    a = Answer("".join(text), "".join(thought) or None, (first or t1) - t0, t1 - t0, tokens=tokens,
               finish_reason=finish)
    if usage:
        a.prompt_tokens, a.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        a.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        a.reasoning_tokens = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if timings:
        a.processed, a.server_prefill_s = timings["prompt_n"], timings["prompt_ms"] / 1e3
        a.why = timings.get("cache_reason")
        if a.cached is None and "cache_n" in timings:     # llama-server: its prompt cache's share
            a.cached = timings["cache_n"]
    return a


# ---- ternlm -----------------------------------------------------------------------------------

class Ternlm:
    """`ternlm serve` through ternlm.bench.procs.TernlmServe (closed pass or fail). complete() sends token ids to
    /v1/completions; chat() sends messages to /v1/chat/completions. Both stream, greedy."""

    def __init__(self, label: str, *flags: str):
        self.label = label
        self.proc = TernlmServe(*flags, env=ENV)
        self.model = ""

    def __enter__(self) -> "Ternlm":
        self.proc.__enter__()
        self.model = httpx.get(self.proc.v1 + "/models", timeout=10).json()["data"][0]["id"]
        return self

    def __exit__(self, *exc) -> None:
        self.proc.__exit__(*exc)

    def complete(self, ids: list[int], max_tokens: int, **extra) -> Answer:
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "return_tokens": True, **extra}
        return collect(self.proc.v1 + "/completions", body)

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **extra}
        return collect(self.proc.v1 + "/chat/completions", body)

    def slot_tokens(self) -> int:
        """Tokens in the (single) slot's record now. Reads /slots; no side effect."""
        return httpx.get(self.proc.base + "/slots", timeout=10).json()["slots"][0]["tokens"]

    def kv_memory(self) -> dict:
        """KV size as the server states it: /v1/models meta (kv_dtype, ctx, slots) and its startup memory
        line (`KV 288.0 MiB for 1 slot x 16384 tokens`), from which bytes per token follow."""
        meta = httpx.get(self.proc.v1 + "/models", timeout=10).json()["data"][0]["meta"]
        line = next((x for x in self.proc.log().splitlines() if "memory: needs" in x), "")
        m = re.search(r"KV ([\d.]+) (KiB|MiB|GiB) for (\d+) slots? x (\d+) tokens", line)
        out = {"meta": meta, "log_line": line.split("INFO ternlm: ")[-1]}
        if m:
            size = float(m[1]) * {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m[2]]
            out |= {"kv_bytes_all_slots": int(size), "kv_bytes_per_slot": int(size) // int(m[3]),
                    "kv_bytes_per_token": round(size / int(m[3]) / int(m[4]))}
        return out


# ---- llama.cpp (llama-cpp-python's server) ----------------------------------------------------

class LlamaCpp(LlamaCppServer):
    """llama-cpp-python's OpenAI server on `port`, one context (its server has one), output to a temporary log
    file that its client methods read. A context manager (llamacpp.LlamaCppServer): the process is stopped on the
    way out, pass or fail, and dies with this process; the log file is removed after."""

    label = "llama.cpp"

    def __init__(self, model_path: Path, port: int, n_ctx: int, threads: int = 2, logits_all: bool = False):
        python = peers_python(ROOT)
        if not python.exists():
            raise SystemExit(f"{python} missing: run `make bench-peers` first")
        # [LOGITS-ALL] its server defaults to logits_all=True: the full-vocabulary logits of EVERY prompt
        # position are computed and copied into an (n_ctx, vocab) numpy array (gemma3: 1 MiB a token; RSS grew
        # to 6.9 GiB at 5k tokens and prefill pays the 262k-row output matmul per token). llama-server
        # computes only the last; so do we, unless asked.
        argv = llamacpp_server_argv(str(python), model_path, threads, n_ctx, port, ["--logits_all", str(logits_all)])
        log = Path(tempfile.mkstemp(prefix="llamacpp-peer-", suffix=".log")[1])
        super().__init__(argv, port, log, env=dict(os.environ, PYTHONUNBUFFERED="1", **ENV))

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.log_path.unlink(missing_ok=True)

    def tokenize(self, text: str) -> list[int]:
        """The ids its /v1/completions makes of `text` (BOS added when the file says so, specials parsed)."""
        r = httpx.post(self.base + "/extras/tokenize", json={"input": text}, timeout=60)
        r.raise_for_status()
        return r.json()["tokens"]

    def complete(self, prompt: str, max_tokens: int, **extra) -> Answer:
        """Stream one completion; `processed` and `why` from the log lines this request printed. Side
        effect: its context now holds this prompt and answer."""
        mark = self.log_path.stat().st_size
        a = collect(self.base + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "stream": True, **extra})
        new = ""
        for _ in range(100):          # the perf lines are printed as the answer ends: wait for them
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                new = f.read().decode(errors="replace")
            if _TOTAL.search(new):
                break
            time.sleep(0.05)
        hit, ev = _PREFIX_HIT.search(new), _PROMPT_EVAL.search(new)
        a.why = hit[0] if hit else ("no prefix-match line: full prompt evaluated" if ev else None)
        a.processed = int(hit[2]) if hit else (int(ev[2]) if ev else None)
        # Its `prompt eval time` reads ~0 ms here (the counters are reset mid-request), so the server-side
        # prefill is estimated as total - eval (decode) time: prompt eval plus its sampling overhead.
        total, dec = _TOTAL.search(new), _EVAL.search(new)
        a.server_prefill_s = (float(total[1]) - float(dec[1])) / 1e3 if total and dec else None
        a.cached = int(hit[1]) if hit else 0
        return a

    def kv_memory(self) -> dict:
        """What it allocated for its KV, from its startup log: the per-cache `size =` lines and whether the
        sliding-window cache is full-size (`using full-size SWA cache`) or trimmed to the window."""
        lines = [x.strip() for x in self.log().splitlines()
                 if "llama_kv_cache: size" in x or "llama_kv_cache_iswa" in x]
        total = sum(float(m[1]) for x in lines if (m := re.search(r"size =\s+([\d.]+) MiB", x)))
        cells = max((int(m[1]) for x in lines if (m := re.search(r"\(\s*(\d+) cells", x))), default=0)
        return {"log_lines": lines, "kv_bytes_per_slot": int(total * (1 << 20)),
                "kv_bytes_per_token": round(total * (1 << 20) / cells) if cells else None,
                "swa_full": any("full-size SWA cache" in x for x in lines)}


# ---- llama.cpp's own llama-server ---------------------------------------------------------------

class LlamaServer(LlamaCppServer):
    """llama.cpp's `llama-server` on `port` with one slot (`-np 1`, as `ternlm serve --slots 1`), `threads` for
    prompt and generation, its defaults otherwise (prefix cache, context checkpoints, RAM prompt cache: what a
    user gets), output to a temporary log removed after. A context manager (llamacpp.LlamaCppServer): stopped on
    the way out, pass or fail, and dies with this process. `binary`: None = the build scripts/build-llamacpp
    made (llamacpp.find_bin)."""

    label = "llama-server"

    def __init__(self, model_path: Path, port: int, n_ctx: int, threads: int = 2, binary: str | None = None):
        binary = binary or find_bin(LLAMA_SERVER, ROOT)
        if not binary:
            raise SystemExit("no llama-server: run scripts/build-llamacpp (make bench-peers) or pass its path")
        argv = llama_server_argv(binary, model_path, threads, 1, n_ctx, port)
        log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        super().__init__(argv, port, log, env=dict(os.environ, **ENV), ready="/health")

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.log_path.unlink(missing_ok=True)

    def complete(self, ids: list[int], max_tokens: int, **extra) -> Answer:
        """Stream one greedy completion of `ids`; `processed`/`cached`/`server_prefill_s` from its timings.
        Side effect: its slot now holds these ids and the answer."""
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **extra}
        a = collect(self.base + "/v1/completions", body)
        a.why = f"cache_n {a.cached}, prompt_n {a.processed}"
        return a

    def kv_memory(self) -> dict:
        """Its KV and recurrent-state allocations as its startup log states them (`llama_kv_cache: size = ...`,
        `llama_memory_recurrent: ... size = ...`)."""
        lines = [x.strip() for x in self.log().splitlines()
                 if ("llama_kv_cache" in x or "llama_memory_recurrent" in x) and "size" in x]
        total = sum(float(m[1]) for x in lines if (m := re.search(r"size =\s+([\d.]+) MiB", x)))
        return {"log_lines": lines, "kv_bytes_per_slot": int(total * (1 << 20))}


# ---- prompts ----------------------------------------------------------------------------------

@dataclass
class Renderer:
    """Chat template text -> prompt text and ids, exactly as `ternlm serve` renders and tokenizes them
    (ternlm.text.chat.render_chat, the model file's own tokenizer, no extra special tokens). Pure."""
    template: str
    gguf: Path
    tok: object = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from ternlm.text.tokenizer import Tokenizer
        self.tok = Tokenizer.from_gguf(str(self.gguf))

    def text(self, messages: list[dict], **kw) -> str:
        from ternlm.text.chat import render_chat
        return render_chat(self.template, messages, add_generation_prompt=True, bos_token=self.tok.bos_token,
                           eos_token=self.tok.eos_token, **kw)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def for_llamacpp(self, text: str, adds_bos: bool) -> str:
        """The same prompt for a server that prepends BOS itself: the template's leading BOS text dropped
        (else it would see two, as llama.cpp warns)."""
        bos = self.tok.bos_token
        return text[len(bos):] if adds_bos and bos and text.startswith(bos) else text


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def expected_reuse(record: list[int], prompt: list[int], min_reuse: int) -> int:
    """What ternlm's slot should reuse of `record` for `prompt`: the common prefix, capped at n - 1 (the last
    prompt token is always recomputed for fresh logits), and nothing below --min-reuse. Pure."""
    k = min(lcp(record, prompt), len(prompt) - 1)
    return k if k >= min_reuse else 0


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; numbers as given (format before)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return "\n".join(out)


def command_line() -> str:
    return " ".join([".venv/bin/python", *[a if re.fullmatch(r"[\w./=,:-]+", a) else repr(a) for a in sys.argv]])
