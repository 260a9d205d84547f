"""Speculation on a hybrid model at a real state size (issues 47/48, [VERIFY-REWIND]): decode tok/s with prompt
lookup on vs off, in process, one engine, on an answer that repeats its prompt.

A random model's answers are gibberish, so lookup finds drafts only where an answer repeats the prompt (`ternlm bench
spec` on the synthetic qwen35 file drafted nothing). Here the prompt is the model's own greedy answer to a seed,
then the seed again: the next greedy answer repeats that answer, most drafts are taken and some rejected, so the
hold and the rewind run on the 24 x 1024 file's 19.3 MiB state. The text on == off is checked (exit 1 if not).

    .venv/bin/python benchmarks/hybrid_spec_loop.py -m FILE.gguf [--tokens 200] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--tokens", type=int, default=200, help="answer tokens (the seed's answer and the timed ones)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from ternlm.engine.core import Engine
    e = Engine.load(a.model)
    seed = e.tokenizer.encode("Once upon a time, in a city by the sea,", add_special_tokens=False)
    base = e.generate(seed, max_tokens=a.tokens, ignore_eos=True, speculative=False).token_ids
    prompt = seed + base + seed
    rows, texts = {False: [], True: []}, {}
    for _ in range(a.repeats):
        for spec in (False, True):
            e.slots[0].reset()
            out = e.generate(prompt, max_tokens=a.tokens, ignore_eos=True, slot=0, speculative=spec)
            t = out.timings
            rows[spec].append((t.decode_tokens / t.decode_s, t.drafted, t.accepted))
            texts.setdefault(spec, out.token_ids)
            if out.token_ids != texts[spec]:
                print("answers differ between repeats", file=sys.stderr)
                return 1
    same = texts[True] == texts[False]
    off = statistics.median(r[0] for r in rows[False])
    on = statistics.median(r[0] for r in rows[True])
    drafted, accepted = rows[True][0][1], rows[True][0][2]
    print(f"prompt {len(prompt)} tokens, {a.tokens} answer tokens, {a.threads} threads, medians of {a.repeats}")
    print(f"decode tok/s: off {off:.1f}, on {on:.1f} (x{on / off:.2f}); drafted {drafted}, accepted {accepted} "
          f"({100 * accepted / max(drafted, 1):.0f}%); text on == off: {'yes' if same else 'NO'}")
    print("per repeat (tok/s): off " + ", ".join(f"{r[0]:.1f}" for r in rows[False]) +
          "; on " + ", ".join(f"{r[0]:.1f}" for r in rows[True]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
