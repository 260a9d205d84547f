"""A 10-turn thinking conversation replayed through `ternlm serve`, prefix reuse on and off (issue 38).

Each turn the model thinks (>= 100 tokens, forced into `<think>…</think>answer` by a regex, since no
reasoning model ships on PyPI here) and the client sends the history back with the thinking dropped —
what a Qwen3-style template does (tests/data/thinking.jinja). So every new prompt diverges from the
KV at the start of the previous answer. Per turn it records: prompt tokens, tokens reused, tokens
prefilled, TTFT (server timings), and the server's own explanation of where reuse stopped; and it
checks that the answers are identical with reuse off (`--no-prefix-kv`).

    .venv/bin/python benchmarks/reasoning_replay.py [-m smollm2-135m] [--turns 10] [--out DIR]

Writes DIR/reasoning-replay.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from server_proc import ServerProc  # noqa: E402

TEMPLATE = ROOT / "tests" / "data" / "thinking.jinja"
WORD = "[a-z]{2,9}"
# thinking of 100+ tokens (~60 words), then a short answer
FORMAT = {"type": "regex", "regex": rf"<think>\n{WORD}( {WORD}){{60,70}}\n</think>\n\n{WORD}( {WORD}){{8,14}}"}
QUESTIONS = ["Why is the sky blue?", "Why are sunsets red then?", "Does the moon have a sky?",
             "What colour is the sky on Mars?", "Why?", "Could a planet have a green sky?",
             "What about a purple one?", "How do we know the air's composition on exoplanets?",
             "Which telescope does that best?", "Summarise what we discussed."]


def replay(model: str, turns: int, reuse: bool) -> list[dict]:
    from openai import OpenAI
    flags = ["-m", model, "--slots", "1", "--chat-template", str(TEMPLATE)] + ([] if reuse else ["--no-prefix-kv"])
    rows = []
    with ServerProc(*flags) as s:
        c = OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=600)
        msgs = [{"role": "system", "content": "You are a careful assistant. Think before answering. " * 6}]
        for i, q in enumerate(QUESTIONS[:turns]):
            msgs.append({"role": "user", "content": q})
            t0 = time.perf_counter()
            r = c.chat.completions.create(model=model, messages=msgs, max_tokens=400, temperature=0,
                                          response_format=FORMAT)
            wall = time.perf_counter() - t0
            m, t = r.choices[0].message, r.model_dump()["timings"]
            rows.append({"turn": i + 1, "prompt": r.usage.prompt_tokens,
                         "reused": r.usage.prompt_tokens_details.cached_tokens, "prefilled": t["prompt_n"],
                         "ttft_s": t["prompt_ms"] / 1e3, "wall_s": wall,
                         "thinking_tokens": r.usage.completion_tokens_details.reasoning_tokens,
                         "completion": r.usage.completion_tokens, "why": t.get("cache_reason"),
                         "answer": m.content, "reasoning": m.reasoning_content})
            msgs.append({"role": "assistant", "content": m.content})     # thinking dropped, as templates do
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/reasoning-replay")
    a = ap.parse_args()
    on, off = replay(a.model, a.turns, True), replay(a.model, a.turns, False)
    same = all(x["answer"] == y["answer"] and x["reasoning"] == y["reasoning"] for x, y in zip(on, off))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reasoning-replay.json").write_text(json.dumps({"model": a.model, "reuse": on, "no_reuse": off,
                                                           "identical_answers": same}, indent=1))
    print(f"model {a.model}; answers identical with --no-prefix-kv: {same}\n")
    print("| turn | prompt | thinking tok | reused | prefilled | reused % | TTFT reuse s | TTFT no-reuse s | why reuse stopped |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for x, y in zip(on, off):
        why = (x["why"] or "").replace("|", "/")
        print(f"| {x['turn']} | {x['prompt']} | {x['thinking_tokens']} | {x['reused']} | {x['prefilled']} | "
              f"{100 * x['reused'] / x['prompt']:.0f}% | {x['ttft_s']:.2f} | {y['ttft_s']:.2f} | {why} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
