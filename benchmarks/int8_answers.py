"""What int8 activations cost in answers on the small registry models (issue 59): greedy first turns of the
MT-Bench questions (tests/data) and the README's own example, with int8 activations, fp32 activations (both on the
GGUF's quantized weights) and the dense fp32 reference (--weights fp32, the GGUF dequantized: transformers'
numbers). Per model: how many answers differ from the reference in their first --max-tokens tokens (and where),
and the decode speed of each variant on the same prompts (tokens / decode seconds, one token a step).

    python benchmarks/int8_answers.py -m smollm2-135m [-m gemma3-270m ...] [--questions 80] [--max-tokens 48]
        [--out FILE.json]

Prints one line per variant and the differing answers' texts side by side (for a reader to judge). Reads no slot
across variants: each variant is its own engine, prefix reuse off.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from ternlm.engine.core import Engine

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "mt_bench_question.jsonl"
FRANCE = "What is the capital of France?"
VARIANTS = {"int8": {"weights": "gguf", "activations": "int8"}, "fp32-act": {"weights": "gguf", "activations": "fp32"},
            "dense": {"weights": "fp32"}}


def answers(model: str, variant: str, questions: list[str], max_tokens: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    e = Engine.load(model, dtype="float32", slots=1, ctx=2048, speculative=False, prefix_reuse=False,
                    **VARIANTS[variant])
    out, toks, secs = [], 0, 0.0
    for q in questions:
        ids = e.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        c = e.generate(ids, max_tokens=max_tokens, speculative=False)
        out.append({"ids": c.token_ids, "text": c.text})
        toks += c.timings.decode_tokens
        secs += c.timings.decode_s
    del e
    gc.collect()
    return {"answers": out, "decode_tok_s": toks / secs if secs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("--questions", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    qs = [FRANCE] + [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[:a.questions]]
    report = {"command": " ".join(["python", *sys.argv]), "questions": len(qs), "max_tokens": a.max_tokens,
              "models": {}}
    for model in a.model:
        runs = {v: answers(model, v, qs, a.max_tokens, a.threads) for v in VARIANTS}
        ref = runs["dense"]["answers"]
        row = {}
        for v, r in runs.items():
            diff = [i for i, (x, y) in enumerate(zip(r["answers"], ref)) if x["ids"] != y["ids"]]
            first = [next((j for j, (s, t) in enumerate(zip(r["answers"][i]["ids"], ref[i]["ids"])) if s != t),
                          min(len(r["answers"][i]["ids"]), len(ref[i]["ids"]))) for i in diff]
            row[v] = {"differ_from_dense": len(diff), "differing": diff, "first_divergence": first,
                      "decode_tok_s": r["decode_tok_s"], "france": r["answers"][0]["text"]}
            print(f"{model:22s} {v:9s} differ {len(diff):3d}/{len(qs)}  decode {r['decode_tok_s']:.1f} tok/s  "
                  f"France: {r['answers'][0]['text'][:70]!r}", flush=True)
        for i in row["int8"]["differing"][:12]:
            print(f"  q{i}: {qs[i][:60]!r}\n    dense: {ref[i]['text'][:160]!r}\n    int8:  "
                  f"{runs['int8']['answers'][i]['text'][:160]!r}\n    fp32a: {runs['fp32-act']['answers'][i]['text'][:160]!r}")
        report["models"][model] = {"variants": row,
                                   "texts": {v: [x["text"] for x in r["answers"]] for v, r in runs.items()}}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
