"""llama.cpp's own `llama-server` as a timed peer, over its native /completion API with token ids, so it
evaluates exactly the ids ternlm was given (no second tokenizer, no BOS added: a prompt of ids is taken
as is). What it did with a prompt is read from its answer's `timings`: `cache_n` prompt tokens taken from
its slot, `prompt_n` evaluated, `prompt_ms` spent on them. llamacpp.py starts and stops the process."""
from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerTurn:
    """One answer of llama-server. `cached + processed == prompt` when its counts are consistent."""
    prompt: int            # ids sent
    cached: int            # timings.cache_n: reused from the slot (its prefix cache or a context checkpoint)
    processed: int         # timings.prompt_n: evaluated for this request
    wall_s: float          # client: request sent -> whole answer back (n_predict 1: time to first token)
    prompt_ms: float       # server: timings.prompt_ms
    tokens: tuple[int, ...]  # generated ids (return_tokens)

    @property
    def consistent(self) -> bool:
        return self.cached + self.processed == self.prompt


def complete_ids(base: str, ids: list[int], n_predict: int, cache_prompt: bool = True,
                 timeout_s: float = 1800.0) -> ServerTurn:
    """POST /completion with `ids`, greedy, not streamed. Side effect: the server's slot now holds `ids` and
    the answer (with cache_prompt False it evaluated every id: the no-reuse row). Raises on a non-200."""
    body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": cache_prompt,
            "return_tokens": True, "stream": False}
    req = urllib.request.Request(f"{base}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        out = json.loads(r.read())
    wall = time.perf_counter() - t
    tm = out["timings"]
    return ServerTurn(len(ids), int(tm["cache_n"]), int(tm["prompt_n"]), wall, float(tm["prompt_ms"]),
                      tuple(out.get("tokens") or ()))
