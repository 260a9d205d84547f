"""Issue 47's replay: a 30-turn conversation on a hybrid model (qwen35: gated DeltaNet + gated attention),
ternlm against llama.cpp's own `llama-server` on the same GGUF and the same token ids every turn.

The model is random (benchmarks/synth_qwen35_gguf.py --ftype q8_0: 24 layers, hidden 1024, Q8_0 as llama.cpp's
converter writes it; made on first use unless -m names a file), so its answers are gibberish and differ between
engines. The history is therefore the client's, not the engines': the assistant turns are FIXED seeded text
(--answer-words, --seed), the same for every contender, so every contender is sent exactly the same prompt
ids every turn. Each turn still generates --max-tokens (16) greedy tokens, to time the first one and to check
that `ternlm serve` with reuse and with --no-prefix-kv answer the same token ids (exit 1 if not). The
generated tokens are not sent back: every engine's slot holds its own answer, so each turn's prompt
diverges from every slot right after the previous prompt (the variants move that point: replay_variants.py).

Contenders, interleaved turn by turn (the order rotates): `ternlm serve --slots 1` (reuse), the same with
--no-prefix-kv, and `llama-server -np 1` (its defaults otherwise: prefix cache, context checkpoints). Prompts
are rendered with ternlm's renderer and the file's own template and sent as ids to both /v1/completions.

Per turn: prompt tokens, tokens each engine processed (ternlm: timings.prompt_n; llama-server: its
timings.prompt_n, with cache_n), client TTFT (first streamed text) and server-side prefill. Checked every
turn: ternlm's processed <= prompt - LCP + --state-interval, LCP = the common prefix of the prompt with the
slot's record (previous prompt + the ids it kept); a hybrid slot resumes at the latest state snapshot at or
before the LCP, and snapshots stand on that grid, at each prefill's end and at each message start it fed
([RESUME-AT-SNAPSHOT]). Also
what vLLM's rule would reuse (VLLM_RULE below). Summary: total TTFT ternlm / llama-server (target <= 3/4),
turns where ternlm processed more than llama-server (target: none), answers reuse == no-reuse.

--tiers: the reuse server gets --cache-dir/--cache-disk; after the replay it is restarted on the same
directory and sent the same prompts again, turn by turn: each turn's processed tokens and where its prefix
came from (timings.cache_reason), and its answer must equal the first pass's. (Tiers are off for hybrid
models until snapshots live in them; the output says so when the server's log does.)

    .venv/bin/python benchmarks/hybrid_replay.py --variant append|trim|edit [--turns 30] [--tiers] [--out DIR]

Writes DIR/<variant>.json and DIR/<variant>.md (per-turn table and summary).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from replay_common import Answer, LlamaServer, Renderer, Ternlm, command_line, lcp, md_table  # noqa: E402
from replay_variants import VARIANTS, add_answer, add_user  # noqa: E402
from ternlm.bench.procs import free_port  # noqa: E402

REUSE, NO_REUSE, LS, RESTARTED = "ternlm-reuse", "ternlm-no-reuse", "llama-server", "ternlm-restarted"
VLLM_BLOCK = 528
VLLM_RULE = ("vLLM keeps a hybrid model's recurrent state only at multiples of its block size (528 tokens for "
             "Qwen3.5-4B, the attention block raised to the state's page size): it reuses floor(min(LCP, prompt-1) "
             "/ 528) * 528 tokens, LCP = the common prefix with the previous turn's prompt")
TTFT_TARGET = 0.75


def vllm_reused(lcp_prev: int, prompt: int, block: int) -> int:
    """What vLLM's block-grid rule reuses of a `prompt`-token prompt sharing `lcp_prev` with the last. Pure."""
    return min(lcp_prev, prompt - 1) // block * block


def fixed_answers(turns: int, words: int, seed: int) -> list[str]:
    """The assistant's turns, the same for every contender: seeded filler with sentence ends (trim cuts one)."""
    from ternlm.bench.common import synthetic_text
    rng = random.Random(seed + 1)
    return [synthetic_text(rng, max(4, round(words * rng.uniform(0.5, 1.5)))) for _ in range(turns)]


def model_file(a) -> Path:
    """-m, or the synthetic Q8_0 qwen35 file in OUT (written on first use: 641 MB, seconds)."""
    if a.model:
        return Path(a.model)
    path = a.out / "qwen35-24x1024-q8_0.gguf"
    if not path.exists():
        import synth_qwen35_gguf as synth
        a.out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        synth.write(tmp, synth.Geometry(), seed=0, ftype="q8_0", log=lambda m: print(m, file=sys.stderr))
        tmp.rename(path)
    return path


@dataclass
class Side:
    """One contender: its server, the ids its slot holds (ternlm), its rows."""
    label: str
    server: Ternlm | LlamaServer
    record: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def ask(side: Side, ids: list[int], a) -> dict:
    """Send `ids`, return the turn's row. Side effect: the server's slot (and side.record) holds this turn."""
    before = side.record
    ans: Answer = side.server.complete(ids, a.max_tokens)
    row = {"prompt": len(ids), "processed": ans.processed, "reused": ans.cached, "ttft_s": ans.ttft_s,
           "server_prefill_s": ans.server_prefill_s, "e2e_s": ans.e2e_s, "why": ans.why, "answer": ans.text,
           "tokens": ans.tokens, "finish_reason": ans.finish_reason}
    if isinstance(side.server, Ternlm):
        side.record = (ids + (ans.tokens or []))[:side.server.slot_tokens()]
        if ans.prompt_tokens != len(ids):
            raise RuntimeError(f"{side.label}: prompt_tokens {ans.prompt_tokens} != {len(ids)} ids sent")
    if side.label in (REUSE, RESTARTED):
        k = lcp(before, ids)
        row |= {"lcp": k, "bound": len(ids) - min(k, len(ids) - 1) + a.state_interval}
        row["within_bound"] = ans.processed is not None and ans.processed <= row["bound"]
    return row


def _servers(a, gguf: Path, tier_flags: list[str]) -> dict:
    flags = ["-m", str(gguf), "--slots", "1", "--ctx", str(a.ctx), "--min-reuse", str(a.min_reuse),
             "--state-interval", str(a.state_interval), "--threads", str(a.threads)]
    return {REUSE: lambda: Ternlm(REUSE, *flags, *tier_flags),
            NO_REUSE: lambda: Ternlm(NO_REUSE, *flags, "--no-prefix-kv"),
            LS: lambda: LlamaServer(gguf, a.port or free_port(), a.ctx, a.threads, a.llama_server),
            RESTARTED: lambda: Ternlm(RESTARTED, *flags, *tier_flags)}


def replay(a) -> dict:
    gguf = model_file(a)
    from ternlm.text.tokenizer import Tokenizer
    r = Renderer(Tokenizer.from_gguf(str(gguf)).chat_template, gguf)
    from ternlm.bench.multiturn import synthetic_conversations
    conv = synthetic_conversations(1, a.turns, a.system_words, a.user_words, a.seed)[0]
    answers = fixed_answers(a.turns, a.answer_words, a.seed)
    tier_flags = []
    if a.tiers:
        shutil.rmtree(a.cache_dir, ignore_errors=True)         # a cold start: only this replay's blocks
        tier_flags = ["--cache-dir", str(a.cache_dir), "--cache-disk", a.cache_disk]
    makers = _servers(a, gguf, tier_flags)
    history = [{"role": "system", "content": conv.system}] if conv.system else []
    turns, prompts, mismatches, notes = [], [], [], {}
    with ExitStack() as stack:
        sides = [Side(n, stack.enter_context(makers[n]())) for n in a.contenders]
        hello = r.ids(r.text([{"role": "user", "content": "Hello."}]))
        for s in sides:                        # warm-up: one short untimed answer each
            ask(s, hello, a)
        prev: list[int] = []
        for t, user in enumerate(conv.user_turns, 1):
            add_user(history, user, a.variant, t)
            ids = r.ids(r.text(history))
            k = lcp(prev, ids)
            turns.append({"turn": t, "prompt": len(ids), "lcp_prev_prompt": k,
                          "vllm_reused": vllm_reused(k, len(ids), a.vllm_block)})
            for s in sides[(t - 1) % len(sides):] + sides[:(t - 1) % len(sides)]:
                row = ask(s, ids, a)
                s.rows.append({"turn": t, **row})
                print(f"turn {t:2d} {s.label:16s} prompt {len(ids):5d} processed {row['processed']:5d} "
                      f"ttft {row['ttft_s']:6.2f} s  {(row['why'] or '')[:80]}", file=sys.stderr, flush=True)
            by = {s.label: s.rows[-1] for s in sides}
            if REUSE in by and NO_REUSE in by and by[REUSE]["tokens"] != by[NO_REUSE]["tokens"]:
                mismatches.append(t)
                print(f"MISMATCH turn {t}: reuse {by[REUSE]['tokens']} vs no-reuse {by[NO_REUSE]['tokens']}",
                      file=sys.stderr, flush=True)
            add_answer(history, answers[t - 1], a.variant)
            prompts.append(ids)
            prev = ids
        for s in sides:
            if isinstance(s.server, Ternlm) and "KV tiers are off" in s.server.proc.log():
                notes[s.label] = "KV tiers are off for this hybrid model (the server's log)"
    res = {"command": command_line(), "variant": a.variant, "gguf": str(gguf), "vllm_rule": VLLM_RULE,
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "identical_answers": not mismatches if {REUSE, NO_REUSE} <= set(a.contenders) else None,
           "mismatched_turns": mismatches, "by_turn": turns, "turns": {s.label: s.rows for s in sides},
           "notes": notes}
    if a.tiers and REUSE in a.contenders:
        res["tiers"] = tier_pass(a, makers[RESTARTED], prompts, res["turns"][REUSE])
    return res


def tier_pass(a, make, prompts: list[list[int]], first: list[dict]) -> dict:
    """The same prompts to a restarted reuse server on the same tier directory. Side effect: a server process
    for the duration (stopped on the way out)."""
    side, rows = None, []
    with make() as srv:
        side = Side(RESTARTED, srv)
        for t, ids in enumerate(prompts, 1):
            row = ask(side, ids, a)
            row |= {"turn": t, "same_answer_as_first_pass": row["tokens"] == first[t - 1]["tokens"],
                    "first_pass_processed": first[t - 1]["processed"]}
            rows.append(row)
            print(f"turn {t:2d} {RESTARTED:16s} prompt {len(ids):5d} processed {row['processed']:5d} "
                  f"(first pass {row['first_pass_processed']}) {(row['why'] or '')[:70]}", file=sys.stderr, flush=True)
        off = "KV tiers are off" in srv.proc.log()
    return {"rows": rows, "tiers_off": off, "cache_dir": str(a.cache_dir), "cache_disk": a.cache_disk,
            "identical_answers": all(x["same_answer_as_first_pass"] for x in rows)}


def summary(res: dict) -> dict:
    t = res["turns"]
    out = {n: {"prompt": sum(x["prompt"] for x in rows), "processed": sum(x["processed"] or 0 for x in rows),
               "ttft_s": sum(x["ttft_s"] for x in rows),
               "server_prefill_s": sum(x["server_prefill_s"] or 0 for x in rows)} for n, rows in t.items()}
    bt = res["by_turn"]
    out["vllm-rule"] = {"prompt": sum(x["prompt"] for x in bt),
                        "processed": sum(x["prompt"] - x["vllm_reused"] for x in bt)}
    if REUSE in t:
        out[REUSE]["within_bound_turns"] = sum(bool(x["within_bound"]) for x in t[REUSE])
        out[REUSE]["turns"] = len(t[REUSE])
    if REUSE in t and LS in t:
        more = [x["turn"] for x, y in zip(t[REUSE], t[LS]) if (x["processed"] or 0) > (y["processed"] or 0)]
        ratio = out[REUSE]["ttft_s"] / out[LS]["ttft_s"]
        out["targets"] = {"turns_ternlm_processed_more": more, "ttft_ratio_ternlm_over_llama_server": ratio,
                          "ttft_target": TTFT_TARGET, "ttft_met": ratio <= TTFT_TARGET}
    return out


def markdown(res: dict, summ: dict) -> str:
    t, bt = res["turns"], res["by_turn"]
    names = list(t)
    head = ["turn", "prompt", "LCP prev", "vLLM rule processed"]
    if REUSE in t:
        head += ["ternlm LCP", "bound", "ok"]
    head += [f"{n} {c}" for n in names for c in ("processed", "TTFT s")]
    rows = []
    for i, b in enumerate(bt):
        row = [b["turn"], b["prompt"], b["lcp_prev_prompt"], b["prompt"] - b["vllm_reused"]]
        if REUSE in t:
            x = t[REUSE][i]
            row += [x["lcp"], x["bound"], "yes" if x["within_bound"] else "**NO**"]
        row += [v for n in names for v in (t[n][i]["processed"], f"{t[n][i]['ttft_s']:.2f}")]
        rows.append(row)
    lines = [f"### {res['variant']}: {Path(res['gguf']).name}, {len(rows)} turns", "", f"`{res['command']}`", "",
             md_table(head, rows), ""]
    for n in names + ["vllm-rule"]:
        s = summ[n]
        ex = (f"; processed <= prompt - LCP + {res['settings']['state_interval']} on {s['within_bound_turns']}/"
              f"{s['turns']} turns" if "within_bound_turns" in s else "")
        tt = f", total TTFT {s['ttft_s']:.2f} s (server-side prefill {s['server_prefill_s']:.2f} s)" if "ttft_s" in s else ""
        lines.append(f"- {n}: {s['processed']:,} of {s['prompt']:,} prompt tokens processed "
                     f"({100 * (1 - s['processed'] / s['prompt']):.1f}% reused){tt}{ex}")
    lines.append(f"- vLLM rule: {res['vllm_rule']}")
    if "targets" in summ:
        g = summ["targets"]
        lines.append("- target, never more tokens processed than llama-server: " +
                     ("met" if not g["turns_ternlm_processed_more"] else f"MISSED on turns {g['turns_ternlm_processed_more']}"))
        lines.append(f"- target, total TTFT <= 3/4 llama-server's: ternlm/llama-server = "
                     f"{g['ttft_ratio_ternlm_over_llama_server']:.3f} ({'met' if g['ttft_met'] else 'MISSED'})")
    if res["identical_answers"] is not None:
        lines.append(f"- answers (token ids) {REUSE} == {NO_REUSE} every turn: "
                     f"{'yes' if res['identical_answers'] else 'NO, turns ' + str(res['mismatched_turns'])}")
    for n, note in res["notes"].items():
        lines.append(f"- {n}: {note}")
    if "tiers" in res:
        tr = res["tiers"]
        lines += ["", f"#### --tiers: the reuse server restarted on {tr['cache_dir']} (--cache-disk {tr['cache_disk']})", ""]
        if tr["tiers_off"]:
            lines += ["**KV tiers are off for this hybrid model in this build: the restarted server had nothing to load.**", ""]
        lines.append(md_table(["turn", "prompt", "processed", "first pass processed", "from", "same answer"],
                              [[x["turn"], x["prompt"], x["processed"], x["first_pass_processed"], (x["why"] or "")[:60],
                                "yes" if x["same_answer_as_first_pass"] else "**NO**"] for x in tr["rows"]]))
        done, first = sum(x["processed"] for x in tr["rows"]), sum(x["first_pass_processed"] for x in tr["rows"])
        lines += ["", f"- after the restart: {done:,} tokens processed (first pass {first:,}); answers equal the first "
                      f"pass's every turn: {'yes' if tr['identical_answers'] else 'NO'}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, required=True)
    ap.add_argument("-m", "--model", default=None,
                    help="a hybrid .gguf (default: OUT/qwen35-24x1024-q8_0.gguf, written by synth_qwen35_gguf.py)")
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--user-words", type=int, default=40, help="the byte-level synthetic tokenizer: ~6 tokens a word")
    ap.add_argument("--answer-words", type=int, default=30, help="the fixed assistant turns")
    ap.add_argument("--system-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--min-reuse", type=int, default=16)
    ap.add_argument("--state-interval", type=int, default=64, help="ternlm's snapshot grid (serve's flag)")
    ap.add_argument("--vllm-block", type=int, default=VLLM_BLOCK)
    ap.add_argument("--threads", type=int, default=2, help="both engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="llama-server's port (default: a free one)")
    ap.add_argument("--llama-server", default=None, metavar="BIN", help="default: the scripts/build-llamacpp build")
    ap.add_argument("--contenders", default=f"{REUSE},{NO_REUSE},{LS}")
    ap.add_argument("--tiers", action="store_true", help="then restart the reuse server and replay from its tiers")
    ap.add_argument("--cache-dir", type=Path, default=None, help="--tiers' disk tier (default OUT/kv-tiers, emptied first)")
    ap.add_argument("--cache-disk", default="8GiB")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hybrid-replay"))
    a = ap.parse_args()
    a.contenders = a.contenders.split(",")
    a.cache_dir = a.cache_dir or a.out / "kv-tiers"
    print(f"command: {command_line()}", file=sys.stderr, flush=True)
    res = replay(a)
    summ = res["summary"] = summary(res)
    a.out.mkdir(parents=True, exist_ok=True)
    name = a.variant + ("-tiers" if a.tiers else "")
    (a.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res, summ)
    (a.out / f"{name}.md").write_text(md)
    print(md)
    bad = res["identical_answers"] is False or ("tiers" in res and not res["tiers"]["identical_answers"])
    if bad:
        print("MISMATCH: answers differ (see above)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
