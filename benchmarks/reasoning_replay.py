"""A 10-turn thinking conversation replayed through `ternlm serve` (prefix reuse on and off) and
llama.cpp, side by side (issue 38).

Each turn the model thinks (>= 100 tokens, forced into `<think>…</think>answer`, since no reasoning
model ships on PyPI here) and the client sends the history back with the thinking dropped — what a
Qwen3-style template does (tests/data/thinking.jinja). So every new prompt diverges from the KV at the
start of the previous answer. Contenders, interleaved turn by turn (the order rotates), each with its
own history:

  ternlm-reuse / ternlm-no-reuse   `ternlm serve --slots 1 --chat-template tests/data/thinking.jinja`,
        /v1/chat/completions, the shape forced by a regex response_format; the thinking comes back
        split (reasoning_content). Answers must be identical with reuse off (exit 1 if not), and every
        reuse turn must reuse exactly the previous prompt: prefilled = the re-rendered previous answer
        + the new user message + template glue.
  llama.cpp   llama-cpp-python's server (not llama-server --jinja: there is none here; it cannot take a
        jinja chat template), same GGUF file, one context. Each prompt is rendered here from the same
        template file with ternlm's renderer (the text `ternlm serve` renders; ids checked equal) and
        sent to /v1/completions with a GBNF grammar of the same shape. Tokens it processed: its log.

Per turn: prompt tokens, tokens reused / processed, thinking tokens, TTFT (client, streamed: first
thinking or answer text), server-side prefill time, and ternlm's explanation of where reuse stopped.

    .venv/bin/python benchmarks/reasoning_replay.py [-m smollm2-135m] [--turns 10] [--out DIR]

Writes DIR/reasoning-replay.json and DIR/reasoning-replay.md, and prints the table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from contextlib import ExitStack
from pathlib import Path

from replay_common import ROOT, LlamaCpp, Renderer, Ternlm, command_line, md_table  # noqa: E402

REUSE, NO_REUSE, LLAMA = "ternlm-reuse", "ternlm-no-reuse", "llama.cpp"
TEMPLATE = ROOT / "tests" / "data" / "thinking.jinja"
WORD = "[a-z]{2,9}"
# thinking of 100-110 words, so >= 100 tokens (every " word" is at least one), then a short answer; the
# same shape for both engines
FORMAT = {"type": "regex", "regex": rf"<think>\n{WORD}( {WORD}){{99,109}}\n</think>\n\n{WORD}( {WORD}){{8,14}}"}
GBNF = ('root ::= "<think>\\n" w (" " w){99,109} "\\n</think>\\n\\n" w (" " w){8,14}\n'
        "w ::= [a-z]{2,9}\n")
QUESTIONS = ["Why is the sky blue?", "Why are sunsets red then?", "Does the moon have a sky?",
             "What colour is the sky on Mars?", "Why?", "Could a planet have a green sky?",
             "What about a purple one?", "How do we know the air's composition on exoplanets?",
             "Which telescope does that best?", "Summarise what we discussed."]
SYSTEM = "You are a careful assistant. Think before answering. " * 6
MAX_TOKENS = 1000


def split_thinking(text: str) -> tuple[str | None, str]:
    """(thinking, answer) of a raw `<think>\\n…\\n</think>\\n\\nanswer` text; cut short (max_tokens), all of
    it is thinking."""
    m = re.match(r"<think>\n(.*?)\n</think>\n\n(.*)", text, re.S)
    if m:
        return m[1], m[2]
    return (text.removeprefix("<think>\n"), "") if text.startswith("<think>") else (None, text)


def ask(name: str, server, r: Renderer, history: list[dict], adds_bos: bool, prev_prompt: int | None) -> dict:
    """One turn for one contender. Side effect: its server's KV holds this turn."""
    if name == LLAMA:
        text = r.for_llamacpp(r.text(history), adds_bos)
        their = server.tokenize(text)
        a = server.complete(text, MAX_TOKENS, grammar=GBNF)
        thinking, answer = split_thinking(a.text)
        return {"prompt": len(their), "reused": a.cached, "prefilled": a.processed,
                "same_ids_as_ternlm": their == r.ids(r.text(history)),
                "thinking_tokens": len(r.ids(thinking)) if thinking else 0, "answer": answer,
                # its server-side estimate (total - decode time) includes grammar sampling of every token: n/a
                "reasoning": thinking, "ttft_s": a.ttft_s, "server_prefill_s": None, "why": a.why}
    a = server.chat(history, MAX_TOKENS, response_format=FORMAT)
    row = {"prompt": a.prompt_tokens, "reused": a.cached, "prefilled": a.processed,
           "client_prompt": len(r.ids(r.text(history))), "thinking_tokens": a.reasoning_tokens,
           "answer": a.text, "reasoning": a.reasoning, "ttft_s": a.ttft_s, "server_prefill_s": a.server_prefill_s,
           "why": a.why}
    if name == REUSE and prev_prompt is not None:
        # thinking dropped: the new prompt shares exactly the previous prompt with the record, no more
        row["exact"] = a.cached == prev_prompt and a.processed == a.prompt_tokens - prev_prompt
    return row


def replay(a) -> dict:
    from ternlm.models.registry import REGISTRY, cached_file
    gguf = cached_file(REGISTRY[a.model]) if a.model in REGISTRY else Path(a.model)
    r = Renderer(TEMPLATE.read_text(), gguf)
    flags = ["-m", a.model, "--slots", "1", "--chat-template", str(TEMPLATE)]
    makers = {REUSE: lambda: Ternlm(REUSE, *flags), NO_REUSE: lambda: Ternlm(NO_REUSE, *flags, "--no-prefix-kv"),
              LLAMA: lambda: LlamaCpp(gguf, a.port, a.ctx)}
    rows = {n: [] for n in a.contenders}
    with ExitStack() as stack:
        servers = {n: stack.enter_context(makers[n]()) for n in a.contenders}
        adds_bos = LLAMA in servers and servers[LLAMA].tokenize("x")[:1] == [r.tok.bos_id]
        histories = {n: [{"role": "system", "content": SYSTEM}] for n in a.contenders}
        for t, q in enumerate(QUESTIONS[:a.turns], 1):
            names = a.contenders[(t - 1) % len(a.contenders):] + a.contenders[:(t - 1) % len(a.contenders)]
            for n in names:
                histories[n].append({"role": "user", "content": q})
                prev = rows[n][-1]["prompt"] if rows[n] else None
                row = {"turn": t, **ask(n, servers[n], r, histories[n], adds_bos, prev)}
                rows[n].append(row)
                histories[n].append({"role": "assistant", "content": row["answer"]})   # thinking dropped
                print(f"turn {t:2d} {n:16s} prompt {row['prompt']:4d} prefilled {row['prefilled']:4d} "
                      f"ttft {row['ttft_s']:6.2f} s  {(row['why'] or '')[:80]}", file=sys.stderr, flush=True)
    same = None
    if REUSE in rows and NO_REUSE in rows:
        same = all(x["answer"] == y["answer"] and x["reasoning"] == y["reasoning"]
                   for x, y in zip(rows[REUSE], rows[NO_REUSE]))
    return {"command": command_line(), "model": a.model, "gguf": str(gguf), "identical_answers": same,
            "turns": rows}


def markdown(res: dict) -> str:
    rows = res["turns"]
    names = list(rows)
    head = ["turn"]
    for n in names:
        head += [f"{n} prompt", f"{n} {'processed' if n == LLAMA else 'prefilled'}", f"{n} thinking tok",
                 f"{n} TTFT s"]
        if n == REUSE:
            head += ["reused %", "exact"]
    body = []
    for i in range(len(rows[names[0]])):
        line = [i + 1]
        for n in names:
            x = rows[n][i]
            line += [x["prompt"], x["prefilled"], x["thinking_tokens"], f"{x['ttft_s']:.2f}"]
            if n == REUSE:
                line += [f"{100 * x['reused'] / x['prompt']:.0f}%",
                         {True: "yes", False: "**NO**"}.get(x.get("exact"), "-")]
        body.append(line)
    out = [f"model {res['model']}; `{res['command']}`", "", md_table(head, body), ""]
    for n in names:
        p, f = sum(x["prompt"] for x in rows[n]), sum(x["prefilled"] or 0 for x in rows[n])
        pre = (f"{sum(x['server_prefill_s'] for x in rows[n]):.2f} s" if n != LLAMA else "n/a: its log's "
               "prompt eval time reads ~0 and total - decode time includes grammar sampling")
        out.append(f"- {n}: {f:,} of {p:,} prompt tokens processed, total TTFT "
                   f"{sum(x['ttft_s'] for x in rows[n]):.2f} s, turns 2-10 "
                   f"{sum(x['ttft_s'] for x in rows[n][1:]):.2f} s (server-side prefill {pre})")
    if REUSE in rows:
        out.append("- why reuse stopped (ternlm-reuse, turn 2): " + str(rows[REUSE][1]["why"] if len(rows[REUSE]) > 1 else "-"))
    if LLAMA in rows:
        out.append(f"- llama.cpp prompt ids == ternlm's tokenization of the same text on every turn: "
                   f"{all(x['same_ids_as_ternlm'] for x in rows[LLAMA])}")
    if res["identical_answers"] is not None:
        out.append(f"- answers identical with --no-prefix-kv: {res['identical_answers']}")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--ctx", type=int, default=8192, help="llama.cpp's n_ctx")
    ap.add_argument("--port", type=int, default=8102, help="llama.cpp's port")
    ap.add_argument("--contenders", default=f"{REUSE},{NO_REUSE},{LLAMA}")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/reasoning-replay"))
    a = ap.parse_args()
    a.contenders = a.contenders.split(",")
    res = replay(a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "reasoning-replay.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (a.out / "reasoning-replay.md").write_text(md)
    print(md)
    return 0 if res["identical_answers"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
