"""Issue 61's quality target for `--kv-dtype q8_0`: perplexity and next-token agreement of a q8_0 KV against
the float16 KV over ONE 8,192-token context, beside llama.cpp's `-ctk q8_0 -ctv q8_0` against its own f16 KV.

    python benchmarks/kv_quality.py OUT_DIR [--models a,b,c] [--ctx 8192] [--threads 2] [--tmp /tmp]
                                    [--kv-dtypes float16,q8_0] [--llama-perplexity BIN|auto|none]

Per model: bench quality's text (bench/quality.py _text_ids: MT-Bench turns, then synthetic prose), 2 x ctx
tokens of it decoded to OUT_DIR/text-<model>.txt (llama-perplexity refuses fewer than 2 x -c tokens; --chunks 1
scores the first ctx). llama-perplexity -c ctx -b 2048 --chunks 1 with its default f16 KV writes the
--kl-divergence-base file (under --tmp, deleted after), then --kl-divergence with -fa 1 -ctk q8_0 -ctv q8_0
reads it: PPL ratio, "Same top p", KLD. ternlm then runs the tokens llama.cpp evaluated (the base file's first
chunk, its first token BOS where the model adds one: the same ids), teacher-forced in one slot of each KV
type (--weights gguf, --activations auto), both engines in lockstep, prefilled --chunk rows at a time with
logits for all of them; each chunk's logits are reduced (NLL, argmax, KL of the candidate against the
reference) before the next, so no (ctx x vocab) tensor is ever held. Scored: every position (all), and
llama-perplexity's positions ctx/2 .. ctx-2 (second half), for each KV type after the first (the reference).
Side effects: OUT_DIR/kvq-<model>.json, <model>-base.log, <model>-kld.log, text-<model>.txt; the child
processes; the KL base file (up to 2.5 GB for a 152k vocabulary), deleted after use."""
from __future__ import annotations

import argparse
import gc
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ternlm import Engine                                                   # noqa: E402
from ternlm.bench.common import bench_model                                 # noqa: E402
from ternlm.bench.llamacpp import LLAMA_PERPLEXITY, llama_perplexity, resolve_bin   # noqa: E402
from ternlm.bench.quality import _text_ids                                  # noqa: E402
from ternlm.engine.runner import Feed                                       # noqa: E402

MODELS = ("qwen2.5-coder-1.5b", "gemma3-270m", "smollm2-135m")
_RATIO = re.compile(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([-0-9.]+)")


def base_tokens(path: Path) -> tuple[int, int, list[int]]:
    """n_ctx, n_vocab and the first chunk's tokens of a --kl-divergence-base file (its header only:
    "_logits_", n_ctx u32, n_vocab i32, n_chunk i32, tokens i32 x n_chunk x n_ctx; the original tokens, BOS not
    substituted). int8_agreement.read_kld_base reads the log-probs too."""
    with open(path, "rb") as f:
        head = f.read(20)
        if head[:8] != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        n_ctx = int(np.frombuffer(head, np.uint32, 1, 8)[0])
        n_vocab = int(np.frombuffer(head, np.int32, 1, 12)[0])
        toks = np.frombuffer(f.read(4 * n_ctx), np.int32)
    return n_ctx, n_vocab, toks.tolist()


def base_top(path: Path, n_ctx: int, n_vocab: int, rows: int = 256) -> torch.Tensor:
    """llama.cpp's f16-KV argmax at its scored positions of chunk 0 (uint16 log-probs; ties within 16/65535
    nats collapse), read through a memory map a few rows at a time."""
    nv = 2 * ((n_vocab + 1) // 2) + 4
    scored = n_ctx - 1 - n_ctx // 2
    lp = np.memmap(path, np.uint16, "r", 20 + 4 * n_ctx, (scored, nv))   # --chunks 1: one chunk
    return torch.cat([torch.from_numpy(lp[r:r + rows, 4:4 + n_vocab].argmax(-1)) for r in range(0, scored, rows)])


def run_llama(binary: str, gguf: Path, text: Path, n_ctx: int, threads: int, kld: Path, out: Path,
              name: str) -> dict:
    extra = ["--chunks", "1", "--kl-divergence-base", str(kld)]
    base = llama_perplexity(binary, gguf, text, n_ctx, threads, 2048, extra, out / f"{name}-base.log")
    quant = llama_perplexity(binary, gguf, text, n_ctx, threads, 2048,
                             [*extra, "--kl-divergence", "-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0"],
                             out / f"{name}-kld.log")
    if m := _RATIO.search((out / f"{name}-kld.log").read_text()):
        quant.setdefault("kld", {})["Mean PPL(Q)/PPL(base)"] = float(m[1])
    return {"base": base, "q8_0": quant}


def score(engines: dict[str, Engine], seq: list[int], chunk: int) -> dict:
    """Teacher-force seq through slot 0 of every engine in lockstep; per engine NLL of each next token and
    argmax of each position, and per candidate (not the first) the KL divergence from the reference."""
    names = list(engines)
    n = len(seq)
    nll = {k: torch.zeros(n - 1, dtype=torch.float64) for k in names}
    top = {k: torch.zeros(n - 1, dtype=torch.long) for k in names}
    kl = {k: torch.zeros(n - 1, dtype=torch.float64) for k in names[1:]}
    for e in engines.values():
        e.slots[0].truncate(0)
    for c0 in range(0, n - 1, chunk):
        ids = seq[c0:min(c0 + chunk, n - 1)]        # rows c0.. predict tokens c0+1..; the last token is fed never
        tgt = torch.tensor(seq[c0 + 1:c0 + 1 + len(ids)]).unsqueeze(1)
        lps = {}
        for k, e in engines.items():
            with torch.inference_mode():
                lg = e.runner.step([Feed(e.slots[0], ids, None, "all")])[0]
            lp = torch.log_softmax(lg.double(), dim=-1)
            del lg
            nll[k][c0:c0 + len(ids)] = -lp.gather(1, tgt).squeeze(1)
            top[k][c0:c0 + len(ids)] = lp.argmax(-1)
            lps[k] = lp
        ref = lps[names[0]]
        for k in names[1:]:
            kl[k][c0:c0 + len(ids)] = (ref.exp() * (ref - lps[k])).sum(-1)
        del lps, ref
    return {"nll": nll, "top": top, "kl": kl}


def summarize(s: dict, names: list[str], n_ctx: int) -> dict:
    """Over all positions (rows 0 .. n-2) and llama-perplexity's second half (rows n_ctx/2 .. n_ctx-2), and the
    candidate's agreement and perplexity ratio per quarter of the context (where q8_0 loses most)."""
    n = len(s["nll"][names[0]])
    spans = {"all": slice(0, n), "second_half": slice(n_ctx // 2, n)}
    spans.update({f"q{i + 1}": slice(i * n // 4, (i + 1) * n // 4) for i in range(4)})
    out = {}
    for span, sl in spans.items():
        d = {"positions": sl.stop - sl.start,
             "perplexity": {k: math.exp(float(s["nll"][k][sl].mean())) for k in names}}
        ref = names[0]
        for k in names[1:]:
            d[k] = {"ppl_ratio": math.exp(float(s["nll"][k][sl].mean() - s["nll"][ref][sl].mean())),
                    "agreement": float((s["top"][k][sl] == s["top"][ref][sl]).double().mean()),
                    "flips": int((s["top"][k][sl] != s["top"][ref][sl]).sum()),
                    "kld_mean": float(s["kl"][k][sl].mean()),
                    "kld_max": float(s["kl"][k][sl].max())}
        out[span] = d
    return out


def run_model(name: str, a, binary: str | None) -> dict:
    t0 = time.perf_counter()
    kinds = a.kv_dtypes.split(",")

    def load(k: str) -> Engine:
        return Engine.load(name, weights="gguf", activations="auto", kv_dtype=k, ctx=a.ctx, prefix_reuse=False)

    ref = load(kinds[0])
    tok = ref.tokenizer
    ids = _text_ids(ref, 2 * a.ctx + 64)
    text = a.out / f"text-{name}.txt"
    text.write_text(tok.decode([i for i in ids if i != tok.bos_id]))
    del ref                                       # not resident beside llama-perplexity (its peak: ~7 GB for qwen)
    gc.collect()
    res: dict = {"model": name, "gguf": str(bench_model(name).gguf), "ctx": a.ctx, "threads": a.threads,
                 "chunk": a.chunk}
    seq, top_llama = list(ids[:a.ctx]), None
    if binary:
        kld = a.tmp / f"kvq-{name}.kld"
        try:
            res["llama.cpp"] = run_llama(binary, bench_model(name).gguf, text, a.ctx, a.threads, kld, a.out, name)
            n_ctx, n_vocab, toks = base_tokens(kld)
            ours = list(ids[:n_ctx])
            same = sum(x == y for x, y in zip(ours[1:], toks[1:]))
            res["tokenization"] = {"llama_chunk_tokens": len(toks), "same_as_ternlm_after_first": same,
                                   "first_diff": next((i for i, (x, y) in enumerate(zip(ours, toks)) if x != y
                                                       and i > 0), None)}
            seq = list(toks)
            top_llama = base_top(kld, n_ctx, n_vocab)
        finally:
            kld.unlink(missing_ok=True)
    engines = {k: load(k) for k in kinds}
    res["ran"] = {k: {"kv_dtype": e.kv_dtype, "weights": e.weights_choice.log_line,
                      "activations": getattr(e.model, "activations", "fp32"),
                      "activations_note": getattr(e.model, "activations_note", ""), "kernels": e.kernel_fingerprint}
                  for k, e in engines.items()}
    if tok.add_bos and tok.bos_id is not None:
        seq[0] = tok.bos_id                       # as llama-perplexity does for each chunk
    s = score(engines, seq, a.chunk)
    res["ternlm"] = summarize(s, kinds, a.ctx)
    if top_llama is not None:                     # the two f16-KV references against each other
        mine = s["top"][kinds[0]][a.ctx // 2:]
        res["ternlm_vs_llama_f16_top"] = float((mine == top_llama[:len(mine)]).double().mean())
    res["seconds"] = time.perf_counter() - t0
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256, help="prefill rows per step (each scored before the next)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tmp", type=Path, default=Path("/tmp"))
    ap.add_argument("--kv-dtypes", default="float16,q8_0", help="comma list; the first is the reference")
    ap.add_argument("--llama-perplexity", default="auto", metavar="BIN|auto|none")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(a.threads)
    binary = resolve_bin(LLAMA_PERPLEXITY, a.llama_perplexity)
    kinds = a.kv_dtypes.split(",")
    for name in a.models.split(","):
        res = run_model(name, a, binary)
        res["command"] = " ".join(sys.argv)
        (a.out / f"kvq-{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        t = res["ternlm"]
        for k in kinds[1:]:
            print(f"{name}: ternlm {k} vs {kinds[0]} over {t['all']['positions']} positions: ppl "
                  f"{t['all']['perplexity'][kinds[0]]:.4f} -> {t['all']['perplexity'][k]:.4f} "
                  f"({t['all'][k]['ppl_ratio'] - 1:+.3%}), agreement {t['all'][k]['agreement']:.3%}; second half: "
                  f"ppl {t['second_half'][k]['ppl_ratio'] - 1:+.3%}, agreement {t['second_half'][k]['agreement']:.3%}, "
                  f"KLD {t['second_half'][k]['kld_mean']:.6f}", flush=True)
        if "llama.cpp" in res:
            q = res["llama.cpp"]["q8_0"]
            print(f"{name}: llama.cpp q8_0 vs f16 KV: {q.get('kld') or q.get('error')}", flush=True)


if __name__ == "__main__":
    main()
