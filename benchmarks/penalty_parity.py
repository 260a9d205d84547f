"""Penalties against llama.cpp's own llama-server (issue 59): the same prompt ids, temperature 0, with
repeat_penalty / repeat_last_n / frequency / presence as llama.cpp's native /completion takes them, and the same
request through ternlm's engine (Penalties in llama.cpp's scope). Greedy tokens compared: how many answers are
identical token for token, and where the others first differ, beside the same comparison without any penalty (the
two engines' float differences alone). llama-server: `make bench-peers`.

    python benchmarks/penalty_parity.py -m smollm2-135m [--questions 20] [--tokens 32] [--activations int8]

Prompts: the first turns of the MT-Bench questions (tests/data) in the model's chat template.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from ternlm.bench.llamacpp import LLAMA_SERVER, find_bin, llama_server
from ternlm.engine.core import Engine
from ternlm.models.registry import model_path
from ternlm.engine.sampling import Penalties

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"none": {}, "repeat1.3-last64": {"repeat_penalty": 1.3, "repeat_last_n": 64},
            "repeat1.1-last4096": {"repeat_penalty": 1.1, "repeat_last_n": 4096},
            "freq0.5-pres0.5-last64": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repeat_last_n": 64}}


def penalties(s: dict) -> Penalties | None:
    if not s:
        return None
    return Penalties(s.get("repeat_penalty", 1.0), s.get("frequency_penalty", 0.0), s.get("presence_penalty", 0.0),
                     s.get("repeat_last_n", 64))


def llama(base: str, ids: list[int], n: int, s: dict) -> list[int]:
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": False, "return_tokens": True,
            "stream": False, "ignore_eos": True, "repeat_penalty": 1.0, "repeat_last_n": 64, **s}
    req = urllib.request.Request(f"{base}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return list(json.loads(r.read())["tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--activations", default="int8", help="ternlm's (llama.cpp multiplies 8-bit activations)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    binary = find_bin(LLAMA_SERVER, ROOT)
    if binary is None:
        sys.exit("no llama-server: run `make bench-peers`")
    e = Engine.load(a.model, activations=a.activations, slots=1, prefix_reuse=False, speculative=False)
    qs = [json.loads(line)["turns"][0] for line in (ROOT / "tests/data/mt_bench_question.jsonl").read_text().splitlines()]
    prompts = [list(e.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in qs[:a.questions]]
    report = {"command": " ".join(["python", *sys.argv]), "settings": {}}
    with llama_server(binary, model_path(a.model), 2, 1, 4096, Path("/tmp/penalty-parity-llama-server.log")) as srv:
        for name, s in SETTINGS.items():
            same, firsts = 0, []
            for ids in prompts:
                ours = e.generate(ids, max_tokens=a.tokens, ignore_eos=True, penalties=penalties(s)).token_ids
                theirs = llama(srv.base, ids, a.tokens, s)[:len(ours)]
                if ours == theirs:
                    same += 1
                else:
                    firsts.append(next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y),
                                       min(len(ours), len(theirs))))
            report["settings"][name] = {"fields": s, "identical": same, "of": len(prompts), "first_difference": firsts}
            print(f"{name:26s} identical {same}/{len(prompts)}  first differences at {firsts}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
