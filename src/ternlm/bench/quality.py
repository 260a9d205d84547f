"""`ternlm bench quality`: what --weights gguf costs in answers and saves in memory.

Next-token agreement (argmax) and perplexity of `--weights gguf`, with int8 activations (the default) and
with fp32 ones, against the same GGUF dequantized to fp32 (`--weights fp32`), over one long text (MT-Bench questions and synthetic prose, teacher-forced),
and each mode's resident set right after loading, measured in a fresh process per mode. With
--llama-perplexity, llama.cpp's own llama-perplexity on the same file and text (the decoded tokens, written
beside the JSON), and every mode's perplexity under its protocol (chunks of --ppl-ctx, second halves scored).
"""
from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from .common import command_line, synthetic_text, write_json
from .llamacpp import LLAMA_PERPLEXITY, llama_perplexity, resolve_bin

_RSS_SCRIPT = """
import json, sys, torch
from ternlm import Engine
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
torch.set_num_threads(1)
base = rss()     # Python + torch + ternlm imported, no model: what any process pays before loading
e = Engine.load(sys.argv[1], weights=sys.argv[2], ctx=int(sys.argv[3]))
kv = sum(s.k.nbytes + s.v.nbytes for s in e.slots)      # allocated so far (slots grow on demand)
c = e.config                                             # the KV budget: every slot at the full context
row = e.slots[0].k.shape[-1] * e.slots[0].k.element_size()   # one row's bytes as stored (q8_0: codes + scales)
budget = 2 * len(c.attention_layers) * c.num_kv_heads * row * e.ctx * len(e.slots)
print(json.dumps({"rss": rss(), "rss_before_load": base, "kv": kv, "kv_budget": budget}))
"""


def _text_ids(engine, n: int) -> list[int]:
    """n tokens of mixed text: MT-Bench turns (the repository's test data) then synthetic prose."""
    data = Path(__file__).resolve().parents[3] / "tests" / "data" / "mt_bench_question.jsonl"
    parts = []
    if data.exists():
        for line in data.read_text().splitlines():
            if line.strip():
                parts += json.loads(line)["turns"]
    text = "\n\n".join(parts) + "\n\n" + synthetic_text(random.Random(0), n * 2)
    ids = engine.tokenizer.encode(text)
    if len(ids) < n:
        raise ValueError(f"text too short: {len(ids)} of {n} tokens")
    return ids[:n]


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given logits of positions [0, n-1)."""
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return float(-lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean())


def _chunked_ppl(engine, ids: list[int], n_ctx: int) -> float:
    """Perplexity under llama-perplexity's protocol: consecutive chunks of n_ctx tokens, each evaluated on its
    own (its first token replaced by BOS where the model adds one), only each chunk's second half scored."""
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    nll, count, first = 0.0, 0, n_ctx // 2
    for c in range(len(ids) // n_ctx):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        with torch.inference_mode():
            lp = torch.log_softmax(engine.logits(chunk).double(), dim=-1)
        nll += float(-lp[first - 1:n_ctx - 1].gather(1, torch.tensor(chunk[first:]).unsqueeze(1)).sum())
        count += n_ctx - first
    return math.exp(nll / count)


def _rss(model: str, weights: str, ctx: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, model, weights, str(ctx)], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ))
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode)}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    from ..engine.core import Engine
    from ..models.registry import resolve
    torch.set_num_threads(args.threads)
    llama = resolve_bin(LLAMA_PERPLEXITY, getattr(args, "llama_perplexity", None))
    n_ctx = getattr(args, "ppl_ctx", 512)
    chunked = {}                 # llama-perplexity's protocol, each mode and llama.cpp itself (--llama-perplexity)
    ref = Engine.load(args.model, weights="fp32", prefix_reuse=False)
    ids = _text_ids(ref, args.tokens)
    with torch.inference_mode():
        ref_logits = ref.logits(ids)
    if llama:
        chunked["dense fp32"] = _chunked_ppl(ref, ids, n_ctx)
        text_file = Path(args.out) / f"quality-text-{Path(str(args.model)).name}.txt"
        text_file.parent.mkdir(parents=True, exist_ok=True)
        text_file.write_text(ref.tokenizer.decode([i for i in ids if i != ref.tokenizer.bos_id]))
    del ref
    per_act = {}                 # --weights gguf with each --activations, against the dequantized fp32 model
    for act in ("fp32", "int8"):
        q = Engine.load(args.model, weights="gguf", activations=act, prefix_reuse=False)
        with torch.inference_mode():
            q_logits = q.logits(ids)
        if llama:
            chunked[f"gguf {act}"] = _chunked_ppl(q, ids, n_ctx)
        del q
        ppl = math.exp(_nll(q_logits, ids))
        per_act[act] = {"agreement": float((q_logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()),
                        "perplexity": ppl, "perplexity_ratio": ppl / math.exp(_nll(ref_logits, ids)),
                        "max_abs_logit_diff": float((q_logits - ref_logits).abs().max())}
    agree, ppl_ref = per_act["int8"]["agreement"], math.exp(_nll(ref_logits, ids))
    ppl_q = per_act["int8"]["perplexity"]
    size = resolve(args.model).path.stat().st_size
    mem = {w: _rss(args.model, w, args.ctx) for w in ("gguf", "bf16", "fp32")}
    res = {"command": command_line(), "model": args.model, "tokens": len(ids), "agreement": agree,
           "perplexity": {"fp32": ppl_ref, "gguf": ppl_q, "ratio": ppl_q / ppl_ref},
           "max_abs_logit_diff": per_act["int8"]["max_abs_logit_diff"], "activations": per_act,
           "gguf_file_bytes": size, "ctx": args.ctx, "rss_after_load": mem}
    if llama:
        chunked["llama.cpp"] = llama_perplexity(llama, resolve(args.model).path, text_file, n_ctx, args.threads)
        res["llama_perplexity_protocol"] = {"n_ctx": n_ctx, "text_file": str(text_file), "perplexity": chunked}
        lc = chunked["llama.cpp"]
        print(f"{args.model}: perplexity in chunks of {n_ctx} (llama-perplexity's protocol): "
              + " · ".join(f"{k} {v:.4f}" for k, v in chunked.items() if isinstance(v, float))
              + (f" · llama.cpp {lc['perplexity']:.4f}" if "perplexity" in lc else f" · llama.cpp: {lc['error']}"))
    for act, r in per_act.items():
        print(f"{args.model}: {len(ids)} tokens · gguf with {act} activations vs the dequantized fp32 model: "
              f"next-token agreement {r['agreement']:.2%} · perplexity fp32 {ppl_ref:.4f}, gguf {r['perplexity']:.4f} "
              f"({(r['perplexity_ratio'] - 1):+.3%}) · max |logit diff| {r['max_abs_logit_diff']:.2e}")
    for w, m in mem.items():
        if "error" in m:
            print(f"  --weights {w}: {m['error']}")
        else:
            added = m["rss"] - m["rss_before_load"]
            print(f"  --weights {w}: RSS after load {m['rss'] / 2**20:.0f} MiB, {added / 2**20:.0f} MiB of it added by "
                  f"the load = {added / (size + m['kv']):.2f}x (GGUF {size / 2**20:.0f} MiB + KV allocated "
                  f"{m['kv'] / 2**20:.0f} MiB); {added / (size + m['kv_budget']):.2f}x GGUF + the KV budget "
                  f"({m['kv_budget'] / 2**20:.0f} MiB: the slot at ctx {args.ctx}); before loading: "
                  f"{m['rss_before_load'] / 2**20:.0f} MiB")
    path = write_json(Path(args.out), f"quality-{Path(str(args.model)).name}.json", res)
    print(f"wrote {path}")
    return res
