"""llama.cpp (llama-cpp-python) timing worker for ternlm's benchmarks, started by llamacpp.LlamaCppWorker.
Runs by path under the peers venv (`make bench-peers`), so it imports llama_cpp and nothing of ternlm;
reads one JSON command per line on stdin, answers one JSON line on stdout.

  {"op": "ping"}
  {"op": "prefill", "ids": [...]}                    -> {"s": seconds}        (fresh context)
  {"op": "decode", "ids": [...], "n": 128}           -> {"s": seconds, "n": n} (after the first token)
  {"op": "ttft", "ids": [...], "reset": false}       -> {"s": seconds, "token": id}  (llama.cpp's own
        prefix reuse: Llama.generate keeps the longest common prefix of its previous input)
"""
import json
import sys
import time

from llama_cpp import Llama


def main() -> None:
    path, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # swa_full=False: llama-server's default (common params), a sliding-window cache trimmed to the window;
    # llama-cpp-python's own default is llama_context_default_params' full-size SWA cache, whose decode on
    # gemma3 attends all of the context on every layer (0.9 tok/s at 16,000 tokens here). Only sliding-window
    # models are affected; their `ttft` reuse past the window is then not exact (a one-off probe:
    # `git show d5bfd79:benchmarks/llamacpp_swa_probe.py`).
    llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                swa_full=False, verbose=False)
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "ping":
            out = {"ok": True}
        elif op == "prefill":
            llm.reset()
            t = time.perf_counter()
            llm.eval(req["ids"])
            out = {"s": time.perf_counter() - t}
        elif op == "decode":
            llm.reset()
            gen = llm.generate(req["ids"], top_k=1, temp=0.0, reset=True)
            next(gen)
            t = time.perf_counter()
            for _ in range(req["n"]):
                next(gen)
            out = {"s": time.perf_counter() - t, "n": req["n"]}
            gen.close()
        elif op == "ttft":
            if req.get("reset"):
                llm.reset()
            t = time.perf_counter()
            gen = llm.generate(req["ids"], top_k=1, temp=0.0, reset=True)
            tok = next(gen)
            out = {"s": time.perf_counter() - t, "token": int(tok)}
            gen.close()
        else:
            out = {"error": f"unknown op {op}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
