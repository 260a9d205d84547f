"""gemma3-270m (the real file) against transformers on the same GGUF: fp32 logits and greedy text.

    .venv/bin/ternlm pull gemma3-270m
    .venv/bin/python benchmarks/gemma3_parity.py [--tokens 64] [--weights gguf --kv-dtype auto]

transformers dequantizes the GGUF itself (`from_pretrained(dir, gguf_file=...)`); ternlm runs the same
file dense in fp32 (`--weights fp32`, the default: torch layers), or keeps its quantized blocks
(`--weights gguf`: every layer fused in kernels/layer.c, fp32 activations; `--kv-dtype auto` = fp16
cache there). Prints max |Δlogit| per prompt and how many greedy tokens agree.
"""
from __future__ import annotations

import argparse

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n", "Photosynthesis converts light energy into",
           "Once upon a time, in a small village,", "The three laws of motion are"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--weights", choices=["fp32", "gguf"], default="fp32")
    ap.add_argument("--kv-dtype", choices=["float32", "float16", "auto"], default="float32")
    a = ap.parse_args()
    import transformers as tf

    from ternlm.engine.core import Engine
    from ternlm.models.registry import model_path
    path = model_path("gemma3-270m")
    eng = Engine.load(str(path), dtype="float32", weights=a.weights, ctx=2048, kv_dtype=a.kv_dtype)
    fused = getattr(eng.model, "native", None) is not None
    print(f"weights {a.weights}, layers {'fused in layer.c' if fused else 'in torch'}, KV {eng.model.kv_dtype}")
    hf = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=torch.float32).eval()
    worst, agree, total = 0.0, 0, 0
    for text in PROMPTS:
        ids = eng.tokenizer.encode(text)
        ours = eng.logits(ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            theirs = hf.generate(torch.tensor([ids]), max_new_tokens=a.tokens, do_sample=False)[0, len(ids):].tolist()
        mine = eng.generate(ids, max_tokens=a.tokens, temperature=0).token_ids
        n = min(len(mine), len(theirs))
        same = next((i for i in range(n) if mine[i] != theirs[i]), n)
        d = (ours - ref).abs().max().item()
        worst, agree, total = max(worst, d), agree + same, total + n
        print(f"{text[:32]!r:36} max|dlogit| {d:.2e}  greedy agree {same}/{n}", flush=True)
    print(f"worst max|dlogit| {worst:.2e}; greedy tokens agreeing {agree}/{total}")


if __name__ == "__main__":
    main()
