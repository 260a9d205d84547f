"""Issue 37's conversation replays on a sliding-window model (gemma3-270m), ternlm against llama.cpp.

A 30-turn synthetic conversation (long user turns: >= 8,000 prompt tokens by the end), replayed by a
client that sends the whole history every turn with its previous answer as it received it, so the
template re-renders that answer (Gemma's: `<start_of_turn>model\\n{answer | trim}<end_of_turn>`).
One variant per run (benchmarks/replay_variants.py): append, trim (the last sentence of each answer cut
before it is sent back) or edit (the user message of turn t-2 edited every turn: each prompt diverges ~3
turns back, far beyond the 512-token window from the end).

Contenders, interleaved turn by turn (the order rotates each turn), each with its own history:
`ternlm serve --slots 1` (reuse), `ternlm serve --no-prefix-kv` (its answers must be bit-identical to
the reuse server's, token ids turn by turn: a mismatch is printed and exits 1), and llama-cpp-python's
server (one context, same file). Prompts are rendered here with ternlm's renderer and the built-in
Gemma template (the file has none) and sent as token ids to ternlm's /v1/completions and as text to
llama.cpp's (benchmarks/replay_common.py says why and how its processed tokens are read).

Per turn and contender: prompt tokens, tokens processed, client TTFT (streamed, first text chunk).
ternlm's reuse is checked exactly every turn: the record (previous prompt ids + returned ids, cut to
GET /slots's token count) against the new ids gives LCP; processed must be prompt - min(LCP, prompt - 1).

    .venv/bin/python benchmarks/swa_replay.py --variant append|trim|edit [--turns 30] [--out DIR]

Writes DIR/<variant>.json and DIR/<variant>.md (per-turn table, summary, KV sizes).
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from replay_common import (Answer, LlamaCpp, Renderer, Ternlm, command_line, expected_reuse, lcp,  # noqa: E402
                           md_table)
from replay_variants import VARIANTS, add_answer, add_user  # noqa: E402

REUSE, NO_REUSE, LLAMA = "ternlm-reuse", "ternlm-no-reuse", "llama.cpp"


@dataclass
class Side:
    """One contender's conversation: its server, its own history, and (ternlm) the ids its slot holds."""
    label: str
    server: Ternlm | LlamaCpp
    history: list[dict]
    record: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def ask(side: Side, r: Renderer, a, adds_bos: bool) -> tuple[Answer, dict]:
    """Send the side's history, return the answer and its per-turn row. Side effect: the server's KV (and
    side.record for ternlm) now holds this turn."""
    text = r.text(side.history)
    ids = r.ids(text)
    if isinstance(side.server, LlamaCpp):
        prompt = r.for_llamacpp(text, adds_bos)
        their = side.server.tokenize(prompt)
        ans = side.server.complete(prompt, a.max_tokens)
        return ans, {"prompt": len(their), "processed": ans.processed, "reused": ans.cached,
                     "same_ids_as_ternlm_tokenizer": their == ids}
    k = expected_reuse(side.record, ids, a.min_reuse) if side.label == REUSE else 0
    before = side.record
    ans = side.server.complete(ids, a.max_tokens)
    side.record = (ids + (ans.tokens or []))[:side.server.slot_tokens()]
    exact = ans.prompt_tokens == len(ids) and ans.cached == k and ans.processed == len(ids) - k
    return ans, {"prompt": ans.prompt_tokens, "processed": ans.processed, "reused": ans.cached,
                 "lcp": lcp(before, ids) if side.label == REUSE else None,
                 "expected_processed": len(ids) - k, "exact": exact}


def replay(a) -> dict:
    from ternlm.bench.multiturn import synthetic_conversations
    from ternlm.models.registry import REGISTRY, cached_file
    from ternlm.models.templates import GEMMA_TEMPLATE

    gguf = cached_file(REGISTRY[a.model]) if a.model in REGISTRY else Path(a.model)
    r = Renderer(a.template.read_text() if a.template else GEMMA_TEMPLATE, gguf)
    conv = synthetic_conversations(1, a.turns, a.system_words, a.user_words, a.seed)[0]
    flags = ["-m", a.model, "--slots", "1", "--ctx", str(a.ctx), "--min-reuse", str(a.min_reuse)]
    makers = {REUSE: lambda: Ternlm(REUSE, *flags), NO_REUSE: lambda: Ternlm(NO_REUSE, *flags, "--no-prefix-kv"),
              LLAMA: lambda: LlamaCpp(gguf, a.port, a.ctx, a.llama_threads, a.llama_logits_all)}
    first = [{"role": "system", "content": conv.system}] if conv.system else []
    mismatches = []
    with ExitStack() as stack:
        sides = [Side(n, stack.enter_context(makers[n]()), list(first)) for n in a.contenders]
        adds_bos = False
        for s in sides:                    # warm-up: one short untimed answer each
            hello = [{"role": "user", "content": "Hello."}]
            if isinstance(s.server, LlamaCpp):
                adds_bos = s.server.tokenize("x")[:1] == [r.tok.bos_id]
                s.server.complete(r.for_llamacpp(r.text(hello), adds_bos), 4)
            else:
                ids = r.ids(r.text(hello))
                s.record = (ids + (s.server.complete(ids, 4).tokens or []))[:s.server.slot_tokens()]
        for t, user in enumerate(conv.user_turns, 1):
            order = sides[(t - 1) % len(sides):] + sides[:(t - 1) % len(sides)]
            for s in order:
                add_user(s.history, user, a.variant, t)
                ans, row = ask(s, r, a, adds_bos)
                sent = add_answer(s.history, ans.text, a.variant)
                s.rows.append({"turn": t, **row, "ttft_s": ans.ttft_s, "server_prefill_s": ans.server_prefill_s,
                               "e2e_s": ans.e2e_s, "why": ans.why, "answer": ans.text, "sent_back": sent,
                               "tokens": ans.tokens, "finish_reason": ans.finish_reason})
                print(f"turn {t:2d} {s.label:16s} prompt {row['prompt']:5d} processed {row['processed']:5d} "
                      f"ttft {ans.ttft_s:6.2f} s  {(ans.why or '')[:90]}", file=sys.stderr, flush=True)
            if a.out:          # partial results after every turn: a run cut short still leaves its turns
                a.out.mkdir(parents=True, exist_ok=True)
                (a.out / f"{a.variant}.partial.json").write_text(json.dumps({s.label: s.rows for s in sides}))
            by = {s.label: s.rows[-1] for s in sides}
            if REUSE in by and NO_REUSE in by and (by[REUSE]["tokens"] != by[NO_REUSE]["tokens"]
                                                   or by[REUSE]["answer"] != by[NO_REUSE]["answer"]):
                mismatches.append(t)
                print(f"MISMATCH turn {t}: reuse {by[REUSE]['answer'][:80]!r} vs no-reuse "
                      f"{by[NO_REUSE]['answer'][:80]!r}", file=sys.stderr, flush=True)
        kv = {s.label: s.server.kv_memory() for s in sides if s.label != NO_REUSE}
    return {"command": command_line(), "variant": a.variant, "model": a.model, "gguf": str(gguf),
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "identical_answers": not mismatches if REUSE in a.contenders and NO_REUSE in a.contenders else None,
            "mismatched_turns": mismatches, "kv": kv, "turns": {s.label: s.rows for s in sides}}


def summary(res: dict) -> dict:
    """Totals per contender and the issue's two targets (ternlm-reuse against llama.cpp)."""
    t = res["turns"]
    out = {n: {"prompt": sum(x["prompt"] for x in rows), "processed": sum(x["processed"] or 0 for x in rows),
               "ttft_s": sum(x["ttft_s"] for x in rows),
               "server_prefill_s": sum(x["server_prefill_s"] or 0 for x in rows)} for n, rows in t.items()}
    if REUSE in t:
        out[REUSE]["exact_turns"] = sum(bool(x["exact"]) for x in t[REUSE])
        out[REUSE]["turns"] = len(t[REUSE])
    if REUSE in t and LLAMA in t:
        more = [x["turn"] for x, y in zip(t[REUSE], t[LLAMA]) if (x["processed"] or 0) > (y["processed"] or 0)]
        out["targets"] = {"turns_ternlm_processed_more": more,
                          "ttft_ratio_ternlm_over_llamacpp": out[REUSE]["ttft_s"] / out[LLAMA]["ttft_s"]}
    return out


def markdown(res: dict, summ: dict) -> str:
    t = res["turns"]
    names = list(t)
    head = ["turn"] + [f"{n} {c}" for n in names for c in ("prompt", "processed", "TTFT s")]
    if REUSE in t:
        head[1:1] = ["LCP", "expected", "exact"]
    rows = []
    for i in range(len(t[names[0]])):
        row = [i + 1]
        if REUSE in t:
            x = t[REUSE][i]
            row += [x["lcp"], x["expected_processed"], "yes" if x["exact"] else "**NO**"]
        for n in names:
            x = t[n][i]
            row += [x["prompt"], x["processed"], f"{x['ttft_s']:.2f}"]
        rows.append(row)
    lines = [f"### {res['variant']}: {res['model']}, {len(rows)} turns", "", f"`{res['command']}`", "",
             md_table(head, rows), ""]
    for n in names:
        s = summ[n]
        ex = f", ternlm processed = prompt - min(LCP, prompt-1) on {s['exact_turns']}/{s['turns']} turns" \
            if "exact_turns" in s else ""
        lines.append(f"- {n}: {s['processed']:,} of {s['prompt']:,} prompt tokens processed "
                     f"({100 * (1 - s['processed'] / s['prompt']):.1f}% reused), total TTFT {s['ttft_s']:.2f} s "
                     f"(server-side prefill {s['server_prefill_s']:.2f} s){ex}")
    if "targets" in summ:
        g = summ["targets"]
        lines.append(f"- target, never more tokens processed than llama.cpp: "
                     f"{'met' if not g['turns_ternlm_processed_more'] else 'MISSED on turns ' + str(g['turns_ternlm_processed_more'])}")
        lines.append(f"- target, total TTFT <= 1/2 llama.cpp's: ternlm/llama.cpp = "
                     f"{g['ttft_ratio_ternlm_over_llamacpp']:.3f} ({'met' if g['ttft_ratio_ternlm_over_llamacpp'] <= 0.5 else 'MISSED'})")
    if res["identical_answers"] is not None:
        lines.append(f"- answers (token ids) {REUSE} == {NO_REUSE} every turn: "
                     f"{'yes' if res['identical_answers'] else 'NO, turns ' + str(res['mismatched_turns'])}")
    for n, kv in res["kv"].items():
        lines.append(f"- KV {n}: {kv.get('kv_bytes_per_token')} B/token, {kv.get('kv_bytes_per_slot', 0) / 2**20:.1f} MiB "
                     f"per slot" + (f" (meta {kv['meta']})" if "meta" in kv else f" (full-size SWA cache: {kv['swa_full']})"))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("-m", "--model", default="gemma3-270m", help="ternlm registry name or .gguf path")
    ap.add_argument("--template", type=Path, default=None, help="jinja file (default: the built-in gemma template)")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--user-words", type=int, default=240)
    ap.add_argument("--system-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--min-reuse", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8100, help="llama.cpp's port")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--llama-logits-all", action="store_true",
                    help="llama-cpp-python server's own default (all positions' logits): see replay_common.py")
    ap.add_argument("--contenders", default=f"{REUSE},{NO_REUSE},{LLAMA}")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/swa-replay"))
    ap.add_argument("--report-partial", action="store_true",
                    help="no replay: write the table from OUT/<variant>.partial.json (a run cut short)")
    a = ap.parse_args()
    a.contenders = a.contenders.split(",")
    if a.report_partial:
        turns = json.loads((a.out / f"{a.variant}.partial.json").read_text())
        a.contenders = list(turns)
        res = {"command": command_line(), "variant": a.variant + " (PARTIAL: run stopped)", "model": a.model,
               "identical_answers": None, "mismatched_turns": [], "kv": {}, "turns": turns}
    else:
        res = replay(a)
    summ = res["summary"] = summary(res)
    a.out.mkdir(parents=True, exist_ok=True)
    name = a.variant + ("-partial" if a.report_partial else "")
    (a.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res, summ)
    (a.out / f"{name}.md").write_text(md)
    print(md)
    if res["identical_answers"] is False:
        print(f"MISMATCH: {REUSE} and {NO_REUSE} answered differently on turns {res['mismatched_turns']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
