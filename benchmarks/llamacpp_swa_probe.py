"""What llama-cpp-python's prefix reuse does on a sliding-window model when its SWA cache is trimmed to
the window (swa_full=False, llama-server's default; the Python server cannot set it and gets llama.cpp's
C default, swa_full=True: a full-size cache, benchmarks/swa_replay.py). Runs in the peers venv:

    .venv-peers/bin/python benchmarks/llamacpp_swa_probe.py [FILE.gguf] [--swa-full]

A context evaluates a ~1,300-token prompt; then a second prompt that diverges from it at token D is
generated with Llama.generate's reuse (keep [0, D), evaluate the rest). Its last-position logits are
compared with a cold evaluation of the same prompt in the same context, for D before and inside the
window from the end. Prints one JSON line per D: reused tokens, error (if decode refused), max |Δlogit|.
"""
import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0] if args else os.path.expanduser("~/.cache/ternlm/models/gemma-3-270m-q4_k_m.gguf")
    full = "--swa-full" in sys.argv
    llm = Llama(model_path=path, n_ctx=4096, n_threads=2, n_threads_batch=2, swa_full=full, verbose=False)
    words = "river mountain engine garden theory market window history language music science city ".split()
    base = llm.tokenize(" ".join(words[i * 7 % len(words)] for i in range(1300)).encode())
    def last_logits() -> np.ndarray:   # the last evaluated position's logits (scores are not kept without logits_all)
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.array(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)), copy=True)

    for d in (200, 700, len(base) - 100):
        other = base[:d] + [base[d] + 1] + base[d + 1:]
        llm.reset()
        llm.eval(base)                                   # the "previous turn" in the KV
        row = {"swa_full": full, "prompt": len(other), "diverge_at": d}
        try:
            gen = llm.generate(other, temp=0.0, reset=True)   # prefix match: keeps [0, d), evaluates the rest
            next(gen)
            gen.close()
            row["reused"] = d        # Llama.generate keeps the common prefix: [0, d)
            warm = last_logits()
            llm.reset()
            llm.eval(other)
            cold = last_logits()
            row["max_abs_dlogit_vs_cold"] = float(np.abs(warm - cold).max())
            row["same_argmax"] = int(warm.argmax()) == int(cold.argmax())
        except Exception as e:   # noqa: BLE001 - what it raised is the finding
            row["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
