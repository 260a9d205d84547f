"""Decode against its memory-bandwidth bound (issue 35): how close a decode step comes to the time it
takes just to read what it must read.

A decode step reads every weight once (all projections of every layer, the final norm, the output
projection; the embedding only for one row, which is negligible unless it is also the output head)
plus, in every layer, the K and V of all the positions before it. At one token a step the arithmetic
is small, so the floor is bytes per token ÷ the read bandwidth the cores reach:

    bound tok/s = bandwidth / (weight bytes + KV bytes at the context)

bandwidth = the median rate of a plain read of a buffer much larger than the caches with the same
thread count (torch.sum over 2 GiB of float32: a streaming read, no writes), measured in the same
process just before the decode. The weight bytes are what ternlm's layouts hold (lanes/row codes,
scales, sups), counted from the loaded model, beside the GGUF's own tensor bytes (what llama.cpp reads).

    .venv/bin/python benchmarks/decode_bound.py -m MODEL [--context 1024] [--threads 2] [--tokens 64]
        [--repeats 3] [--json OUT]

Prints one table; --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ternlm.bench.common import synthetic_text  # noqa: E402
from ternlm.engine.core import Engine  # noqa: E402
from ternlm.models.registry import resolve  # noqa: E402

MIB = 1 << 20


def read_bandwidth(threads: int, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of torch.sum over a `gib` GiB float32 buffer with `threads` threads (median of repeats,
    after one untimed pass that faults the pages in)."""
    torch.set_num_threads(threads)
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    buf.sum()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    del buf
    return gib * (1 << 30) / statistics.median(times)


def _nbytes(obj) -> int:
    """Bytes a weight holds: a QWeight/QLinear (`nbytes`), a packed Linear or a dense tensor."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    n = getattr(obj, "nbytes", None)
    if isinstance(n, int):
        return n
    if callable(n):
        return int(n())
    return sum(_nbytes(t) for t in vars(obj).values() if isinstance(t, torch.Tensor)) if hasattr(obj, "__dict__") else 0


def weight_bytes_per_token(model) -> dict[str, int]:
    """Bytes a decode step reads from the weights, by part: the layers' projections (and norms), the
    final norm and the output projection. The embedding is read for one row only (not counted)."""
    layers = 0
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            layers += _nbytes(getattr(layer, name, None))
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor) and "norm" in name:
                layers += _nbytes(t)
    return {"layers": layers, "output": _nbytes(model.lm_head), "final_norm": _nbytes(model.norm)}


def gguf_bytes_per_token(path: str) -> int:
    """What a GGML decode step reads of the same file: every tensor's bytes, less the token embedding
    when the file has a separate output tensor (then only one embedding row is read a step)."""
    from gguf import GGUFReader
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    embed = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
    return sum(tensors.values()) - embed


def kv_bytes_per_token(model, context: int) -> int:
    """K and V of `context` positions read by every layer's attention in one decode step."""
    cfg = model.cfg
    elem = torch.tensor([], dtype=model.kv_dtype).element_size()
    return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * elem * context


def decode_tok_s(engine, context: int, tokens: int, repeats: int) -> list[float]:
    """Decode tok/s after a `context`-token prompt (reuse off, so every repeat is the same work), one token a
    step: speculation off, as bench engine measures (a verify step that accepts drafts emits several tokens
    for one pass over the weights, which no bandwidth bound of one step describes)."""
    engine.prefix_reuse = False
    ids = engine.tokenizer.encode(synthetic_text(random.Random(0), context * 2), add_special_tokens=False)[:context]
    out = []
    for _ in range(repeats):
        c = engine.generate(ids, max_tokens=tokens + 1, ignore_eos=True, speculative=False)
        out.append(c.timings.decode_tokens / c.timings.decode_s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--weights", default="gguf")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens a repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    engine = Engine.load(a.model, weights=a.weights, ctx=max(4096, a.context + a.tokens + 64))
    model = engine.model
    wb = weight_bytes_per_token(model)
    kv = kv_bytes_per_token(model, a.context)
    total = sum(wb.values()) + kv
    src = resolve(a.model)
    ggml = gguf_bytes_per_token(str(src.path)) if src.kind == "gguf" else None
    decode_tok_s(engine, 64, 8, 1)                                    # warm-up
    bw = read_bandwidth(a.threads)
    rates = decode_tok_s(engine, a.context, a.tokens, a.repeats)
    bw_after = read_bandwidth(a.threads)
    rate, bandwidth = statistics.median(rates), statistics.median([bw, bw_after])
    bound = bandwidth / total
    row = {"model": a.model, "weights": a.weights, "threads": a.threads, "context": a.context,
           "weight_bytes": wb, "kv_bytes": kv, "bytes_per_token": total, "kv_dtype": str(model.kv_dtype),
           "read_bandwidth_gb_s": [bw / 1e9, bw_after / 1e9], "decode_tok_s": rates,
           "bound_tok_s": bound, "fraction_of_bound": rate / bound,
           "effective_gb_s": rate * total / 1e9, "gguf_weight_bytes": ggml}
    print(f"| model | context | bytes/token (weights + KV) | read GB/s (2 thr) | decode tok/s | bound tok/s | of bound |")
    print(f"|---|---|---|---|---|---|---|")
    print(f"| {a.model} | {a.context} | {sum(wb.values()) / MIB:,.1f} + {kv / MIB:,.1f} MiB | {bandwidth / 1e9:.2f} "
          f"| {rate:.2f} | {bound:.2f} | {rate / bound:.0%} |")
    print(f"weights by part (MiB): " + ", ".join(f"{k} {v / MIB:,.1f}" for k, v in wb.items())
          + (f"; the GGUF's tensors a GGML step reads: {ggml / MIB:,.1f}" if ggml else ""))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
