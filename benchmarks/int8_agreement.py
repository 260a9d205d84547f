"""Where int8 activations' disagreement comes from (issue 46), and ternlm's agreement under llama-perplexity's protocol.

Runs --weights gguf with int8 and with fp32 activations, captures each run's input to the output projection
(the final normed hidden states) and multiplies it by both output projections, so one pass per activation kind
gives four variants: layers int8|fp32 x lm_head int8|fp32. Each is scored against the fp32-dequantized
reference (--weights fp32) by next-token agreement (argmax), on two token streams:

  bench: `ternlm bench quality`'s stream (--tokens, teacher-forced, every position scored);
  llama: with --kld-base, the tokens llama-perplexity stored in its --kl-divergence-base file, in its chunks
         (first token BOS where the model adds one), only the positions it scores (n_ctx/2 .. n_ctx-2 of each
         chunk): like-for-like with llama.cpp's "Same top p". The base file's own argmax (llama.cpp's dense F32
         run) is compared with ternlm's dense reference too, as a check that the two references agree.

    python benchmarks/int8_agreement.py -m MODEL [--tokens 2000] [--kld-base FILE] [--threads 1] [--out FILE]
    python benchmarks/int8_agreement.py --write-text FILE [--tokens 2000]   # the text for llama-perplexity

The text for llama-perplexity is bench quality's before tokenization (MT-Bench turns, then synthetic prose
sized for --tokens): model-independent, so llama.cpp tokenizes it itself (--chunks 4 takes 2,048 tokens).

Only the lm_head swap touches the model: a capture wrapper replaces `model.lm_head` for the run. Reads no slot.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ternlm import Engine                               # noqa: E402
from ternlm.bench.common import synthetic_text         # noqa: E402
from ternlm.bench.quality import _text_ids              # noqa: E402


class _Capture:
    """Calls `head` and keeps every input it saw (rows of the final normed hidden state, fp32)."""

    def __init__(self, head):
        self.head, self.inputs = head, []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x.float().clone())
        return self.head(x)


def write_text(path: Path, tokens: int) -> None:
    """bench quality's text (bench/quality.py _text_ids) before it is tokenized and cut to `tokens`."""
    import random
    data = Path(__file__).resolve().parents[1] / "tests" / "data" / "mt_bench_question.jsonl"
    parts = [t for line in data.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    path.write_text("\n\n".join(parts) + "\n\n" + synthetic_text(random.Random(0), tokens * 2))


def read_kld_base(path: Path) -> dict:
    """llama-perplexity's --kl-divergence-base file: n_ctx, n_vocab, n_chunk, the tokens (n_chunk * n_ctx int32),
    then per chunk and scored position (n_ctx/2 .. n_ctx-2) the log-probs as uint16 after two fp32 (scale, min):
    the argmax of the uint16s is the base model's top token (ties within 16/65535 nats collapse)."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path} is not a llama-perplexity logits file")
    n_ctx = int(np.frombuffer(raw, np.uint32, 1, 8)[0])
    n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw, np.int32, 2, 12))
    tokens = np.frombuffer(raw, np.int32, n_ctx * n_chunk, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    scored = n_ctx - 1 - n_ctx // 2
    lp = np.frombuffer(raw, np.uint16, n_chunk * scored * nv, 20 + 4 * n_ctx * n_chunk).reshape(n_chunk, scored, nv)
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "tokens": tokens.tolist(),
            "top": lp[:, :, 4:4 + n_vocab].argmax(-1)}            # (n_chunk, scored)


def _chunks(engine, base: dict) -> list[list[int]]:
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    out = []
    for chunk in base["tokens"]:
        chunk = list(chunk)
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def _scored(logits: torch.Tensor, n_ctx: int) -> torch.Tensor:
    """The rows llama-perplexity scores in one chunk's logits: positions n_ctx/2 .. n_ctx-2."""
    return logits[n_ctx // 2:n_ctx - 1]


def _nll(logits: torch.Tensor, seq: list[int], n_ctx: int | None) -> tuple[float, int]:
    """Summed negative log-likelihood and count of the scored next tokens: every one after the first (bench),
    or tokens n_ctx/2 + 1 .. n_ctx - 1 of the chunk from rows n_ctx/2 .. n_ctx - 2 (llama-perplexity's)."""
    first = 0 if n_ctx is None else n_ctx // 2
    rows, targets = logits[first:len(seq) - 1], torch.tensor(seq[first + 1:])
    lp = torch.log_softmax(rows.double(), dim=-1)
    return float(-lp.gather(1, targets.unsqueeze(1)).sum()), len(targets)


def _streams(engine, ids: list[int], base: dict | None) -> dict[str, list[list[int]]]:
    out = {"bench": [ids]}
    if base is not None:
        out["llama"] = _chunks(engine, base)
    return out


def _top(engine, seqs: list[list[int]], n_ctx: int | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Argmax of each position (bench) or of llama-perplexity's scored positions (llama), concatenated, the
    gap between the top two logits there (how near a tie the reference's choice is), and the mean NLL (_nll)."""
    tops, gaps, nll, count = [], [], 0.0, 0
    for s in seqs:
        with torch.inference_mode():
            lg = engine.logits(s)
        two = (lg if n_ctx is None else _scored(lg, n_ctx)).topk(2, dim=-1)
        a, b = _nll(lg, s, n_ctx)
        nll, count = nll + a, count + b
        tops.append(two.indices[:, 0])
        gaps.append(two.values[:, 0] - two.values[:, 1])
    return torch.cat(tops), torch.cat(gaps), nll / count


def _score(top: torch.Tensor, ref_top: torch.Tensor, ref_gap: torch.Tensor) -> dict:
    """Agreement, and how near a tie the reference was where they differ (its top-2 logit gap)."""
    flips = top != ref_top
    gap = ref_gap[flips]
    return {"agreement": float((~flips).double().mean()), "flips": int(flips.sum()),
            "flip_gap_median": float(gap.median()) if gap.numel() else None,
            "flip_gap_max": float(gap.max()) if gap.numel() else None,
            "share_below_max_flip_gap": float((ref_gap <= gap.max()).double().mean()) if gap.numel() else 0.0}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    base = read_kld_base(args.kld_base) if args.kld_base else None
    ref = Engine.load(args.model, weights="fp32", prefix_reuse=False)
    ids = _text_ids(ref, args.tokens)
    streams = _streams(ref, ids, base)
    n_ctx = {"bench": None, "llama": base["n_ctx"] if base else None}
    ref_top, ref_gap, ref_nll = {}, {}, {}
    for k, v in streams.items():
        ref_top[k], ref_gap[k], ref_nll[k] = _top(ref, v, n_ctx[k])
    del ref
    engines = {act: Engine.load(args.model, weights="gguf", activations=act, prefix_reuse=False)
               for act in ("int8", "fp32")}
    heads = {act: e.runner.model.lm_head for act, e in engines.items()}
    res = {"model": args.model, "tokens": {k: int(v.numel()) for k, v in ref_top.items()}, "agreement": {},
           "dense_perplexity": {k: math.exp(v) for k, v in ref_nll.items()}}
    for layers, e in engines.items():
        model = e.runner.model
        for name, seqs in streams.items():
            hidden = []                          # per sequence: (len, hidden), its head's input rows
            for s in seqs:
                cap = _Capture(heads[layers])
                model.lm_head = cap
                try:
                    with torch.inference_mode():
                        e.logits(s)
                finally:
                    model.lm_head = heads[layers]
                hidden.append(torch.cat(cap.inputs))
            for head_act, head in heads.items():
                tops, nll, count = [], 0.0, 0
                for h, seq in zip(hidden, seqs):
                    with torch.inference_mode():
                        lg = head(h).float()
                    if model.cfg.final_logit_softcap:    # as the model's forward does after its head
                        lg = torch.tanh(lg / model.cfg.final_logit_softcap) * model.cfg.final_logit_softcap
                    tops.append((lg if n_ctx[name] is None else _scored(lg, n_ctx[name])).argmax(-1))
                    a, b = _nll(lg, seq, n_ctx[name])
                    nll, count = nll + a, count + b
                top = torch.cat(tops)
                key = f"{name}: layers {layers}, lm_head {head_act}"
                res["agreement"][key] = _score(top, ref_top[name], ref_gap[name])
                res["agreement"][key]["perplexity_ratio"] = math.exp(nll / count - ref_nll[name])
    if base is not None:
        llama_top = torch.from_numpy(base["top"].reshape(-1).astype(np.int64))
        res["agreement"]["llama: ternlm dense fp32 vs llama.cpp's F32 base"] = _score(
            ref_top["llama"], llama_top, ref_gap["llama"])
    for k, v in res["agreement"].items():
        near = (f" · where they differ the reference's top-2 logit gap is {v['flip_gap_median']:.3f} median, "
                f"{v['flip_gap_max']:.3f} max ({v['share_below_max_flip_gap']:.1%} of positions have a gap that small)"
                if v["flips"] else "")
        ppl = f" · perplexity {v['perplexity_ratio'] - 1:+.3%} vs dense" if "perplexity_ratio" in v else ""
        print(f"{args.model}: {k}: {v['agreement']:.2%} of {res['tokens'][k.split(':')[0]]}{ppl}{near}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--write-text", type=Path, help="write the text for llama-perplexity and exit")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--kld-base", type=Path, help="llama-perplexity --kl-divergence-base output (dense F32 run)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.write_text:
        write_text(args.write_text, args.tokens)
    elif not args.model:
        ap.error("-m MODEL is required")
    else:
        run(args)


if __name__ == "__main__":
    main()
