"""`ternlm bench spec`: what speculative decoding by prompt lookup (drafter.py) buys, side by side, and that it
never changes an answer.

Two parts. `edit`: a code-editing replay (spec_edits.py) where every answer is the whole file with one small
change, which prompt lookup should draft almost entirely. `mtbench`: MT-Bench chats, fresh text with little to
look up, where drafting must back off (ternlm on / off >= 0.95). Contenders, one run, the same GGUF and the
same prompt ids: ternlm with speculation off and on (`ternlm serve --speculative off|auto`), with --draft-model a
third ternlm drafting with that small model (`ternlm serve --draft-model`: batched drafts), and llama.cpp's
own `llama-server` without speculation and with each n-gram --spec-type its --help lists (read, not assumed:
builds differ), its draft/accept counts from its answers' timings. llama-server runs the edit part only.

Greedy by default; --temperature / --top-p / --presence-penalty sample every timed request instead (seeded
with --seed: ternlm's draw is keyed by (seed, position), so speculation on and off must still answer alike;
llama-server gets the same fields, its own top_k / min_p turned off).

Through HTTP, not in-process: what users see, and the same path (streamed, token ids in) as llama-server's.
Each contender gets a fresh server per repeat (a cold first turn, then its own prefix cache across turns, as
in real use); the order rotates each repeat so drift on a shared host hits all alike. Exit 1 if ternlm's
text with speculation differs from without (the project's first rule)."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .common import bench_model, command_line, write_json
from .multiturn import load_conversations, ternlm_serve_args
from .procs import TernlmServe
from .llamacpp import LLAMA_SERVER, BUILD_HOW, find_bin, llama_server, llama_spec_types
from .sampling_settings import Sampling
from .spec_edits import SOURCE, conversation, expected
from .spec_stream import LLAMA_SERVER, TERNLM, Answer, Target, served_model, stream_ids
from .spec_summary import LLAMA_NONE, TARGET_CHAT, TARGET_EDIT, TERNLM_DRAFT, TERNLM_OFF, TERNLM_ON, \
    all_required_identical, markdown, part, ratios

MT_BENCH = Path(__file__).resolve().parents[3] / "tests" / "data" / "mt_bench_question.jsonl"
PARTS = ("edit", "mtbench")


@dataclass(frozen=True)
class Contender:
    label: str
    kind: str       # TERNLM | LLAMA_SERVER
    spec: str       # ternlm: "auto" | "off"; llama-server: a --spec-type ("none": no speculation)
    extra: tuple[str, ...] = ()   # more `ternlm serve` flags (--draft-model NAME)


def contenders(binary: str | None, spec_types: list[str], draft_model: str | None = None) -> list[Contender]:
    out = [Contender(TERNLM_OFF, TERNLM, "off"), Contender(TERNLM_ON, TERNLM, "auto")]
    if draft_model:
        out.append(Contender(TERNLM_DRAFT, TERNLM, "auto", ("--draft-model", draft_model)))
    if binary:
        out += [Contender(f"llama-server {t}", LLAMA_SERVER, t) for t in ["none", *spec_types]]
    return out


@contextmanager
def serving(c: Contender, args, gguf: Path | None, n_ctx: int, logs: Path):
    """A fresh server for `c`, ready; yields it as a Target. The server is owned from
    the line that starts it and stopped on the way out, pass or fail."""
    if c.kind == TERNLM:
        proc = None
        try:
            proc = TernlmServe(*ternlm_serve_args(args, not args.no_prefix_kv), "--speculative", c.spec, *c.extra,
                               log_path=logs / f"{c.label.replace(' ', '-')}.log").start()
            proc.wait_ready()
            base = f"http://127.0.0.1:{proc.port}"
            yield Target(TERNLM, base, served_model(base), proc.proc.pid)
        finally:
            if proc is not None:
                proc.close()
    else:
        extra = [] if c.spec == "none" else ["--spec-type", c.spec]
        with llama_server(args.llama_server_bin, gguf, args.threads, 1, n_ctx,
                          logs / f"{c.label.replace(' ', '-')}.log", extra) as s:
            yield Target(LLAMA_SERVER, s.base, pid=s.proc.pid)


def _ids(tok, template: str, messages: list[dict]) -> list[int]:
    from ..text.chat import render_chat
    text = render_chat(template, messages, add_generation_prompt=True, bos_token=tok.bos_token,
                       eos_token=tok.eos_token)
    return tok.encode(text, add_special_tokens=False)     # as Engine.apply_chat_template


def _say(c: Contender, r: int, what: str, a: Answer) -> None:
    drafts = f", drafted {a.drafted} accepted {a.accepted}" if a.drafted is not None else ""
    print(f"  [{r + 1}] {c.label:24s} {what}: prompt {a.prompt_tokens} (cached {a.cached_tokens}), "
          f"{a.decode_tokens} tokens, {a.server_tok_s or 0:.1f} tok/s server, {a.client_tok_s or 0:.1f} client, "
          f"{a.wall_s:.1f} s{drafts}", flush=True)


def _chats(c: Contender, r: int, target: Target, tok, template: str, questions, max_tokens: int,
           sampling: Sampling, seed: int) -> list[Answer]:
    """Each question's two turns; the second turn's history holds this contender's own first answer."""
    out = []
    for q in questions:
        msgs = []
        for t, user in enumerate(q.user_turns[:2], 1):
            msgs.append({"role": "user", "content": user})
            a = stream_ids(target, _ids(tok, template, msgs), max_tokens, sampling=sampling, seed=seed)
            msgs.append({"role": "assistant", "content": a.text})
            _say(c, r, f"mt-bench {q.id} turn {t}", a)
            out.append(a)
    return out


def pick_questions(n: int):
    """n MT-Bench questions, one per category in turn (writing, roleplay, reasoning, math, coding, ...)."""
    qs = load_conversations(MT_BENCH, 0, 2)
    cats: dict[str, list] = {}
    for line, q in zip(MT_BENCH.read_text().splitlines(), qs):
        cats.setdefault(json.loads(line).get("category", "?"), []).append(q)
    rounds = [q for i in range(max(map(len, cats.values()))) for qs_ in cats.values() if i < len(qs_)
              for q in [qs_[i]]]
    return rounds[:n]


def _tokenizer(m, chat_template: str | None):
    from ..text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(m.path) if m.gguf else Tokenizer.from_hf_folder(m.path)
    template = chat_template or tok.chat_template
    if not template:
        raise ValueError(f"{m.label} has no chat template (pass --chat-template FILE)")
    return tok, template


def run(args) -> int:
    print(f"command: {command_line()}", flush=True)
    parts = tuple(p for p in PARTS if p in args.parts.split(","))
    if not parts or set(args.parts.split(",")) - set(PARTS):
        raise ValueError(f"--parts: choose from {','.join(PARTS)} (got {args.parts!r})")
    args.threads = args.threads or os.cpu_count() or 1
    m = bench_model(args.model)
    out_dir, logs = Path(args.out), Path(args.out) / "logs"
    binary, note = _llama_server(args.llama_server, m)
    args.llama_server_bin = binary
    spec_types = _spec_types(binary, args.llama_spec_types) if binary else []
    tok, template = _tokenizer(m, args.chat_template)
    source = SOURCE.read_text()
    edit_ids = [_ids(tok, template, msgs) for msgs in conversation(source, args.turns)] if "edit" in parts else []
    questions = pick_questions(args.mt_questions) if "mtbench" in parts else []
    n_ctx = -(-(max(map(len, edit_ids), default=2048) + max(args.max_tokens, args.mt_max_tokens) + 64) // 256) * 256
    args.ctx = args.ctx or n_ctx
    field = contenders(binary, spec_types, getattr(args, "draft_model", None))
    sampling = sampling_of(args)
    print(f"{m.label}: {len(field)} contenders ({', '.join(c.label for c in field)}); parts {', '.join(parts)}; "
          f"edit prompts {[len(x) for x in edit_ids]} tokens; {args.repeats} repeat(s)"
          + (f"\n{note}" if note else ""), flush=True)
    edit_runs: dict[str, list[list[Answer]]] = {c.label: [] for c in field}
    chat_runs: dict[str, list[list[Answer]]] = {c.label: [] for c in field if c.kind == TERNLM}
    servers = []                                          # (contender, repeat, pid): the processes we started
    for r in range(args.repeats):
        k = r % len(field)
        for c in field[k:] + field[:k]:                   # rotated: drift on a shared host hits all alike
            with serving(c, args, m.gguf, max(n_ctx, args.ctx), logs) as target:
                servers.append({"contender": c.label, "repeat": r, "pid": target.pid})
                stream_ids(target, _ids(tok, template, [{"role": "user", "content": "Hello."}]), 4)  # warm-up
                got = []
                for t, ids in enumerate(edit_ids, 1):
                    got.append(stream_ids(target, ids, args.max_tokens, sampling=sampling, seed=args.seed))
                    _say(c, r, f"edit turn {t}", got[-1])
                edit_runs[c.label].append(got)
                if questions and c.kind == TERNLM:
                    chat_runs[c.label].append(_chats(c, r, target, tok, template, questions, args.mt_max_tokens,
                                                     sampling, args.seed))
    result = _result(args, m, parts, edit_runs, chat_runs, source, binary, spec_types, note, questions)
    result["all_required_identical"] = all_required_identical(result)
    result["servers"] = servers
    # --speculative off must mean it: an off contender that drafted measured the wrong thing
    result["ternlm_off_drafted"] = sum(a.drafted or 0 for runs in (edit_runs, chat_runs)
                                       for rep in runs.get(TERNLM_OFF, []) for a in rep)
    write_json(out_dir, f"spec-{m.label}.json", result)
    md = markdown(result)
    (out_dir / f"spec-{m.label}.md").write_text(md)
    print("\n" + md)
    print(f"wrote {out_dir / f'spec-{m.label}.json'} and .md")
    if result["ternlm_off_drafted"]:
        print(f"ERROR: {TERNLM_OFF} drafted {result['ternlm_off_drafted']} tokens: `ternlm serve --speculative off` "
              f"was not honoured")
    return 0 if result["all_required_identical"] and not result["ternlm_off_drafted"] else 1


def sampling_of(args) -> Sampling:
    """--temperature (default 0: greedy) / --top-p / --presence-penalty as one setting."""
    return Sampling(temperature=getattr(args, "temperature", 0.0) or 0.0,
                    top_p=1.0 if getattr(args, "top_p", None) is None else args.top_p,
                    presence=getattr(args, "presence_penalty", None) or 0.0)


def _llama_server(arg: str | None, m) -> tuple[str | None, str | None]:
    """--llama-server: a path, `none`, or unset (the build scripts/build-llamacpp made, if any). Returns the
    binary or None, and the line the page prints when it does not run."""
    if arg == "none":
        return None, "llama-server: not run (--llama-server none)"
    binary = arg if arg and arg != "auto" else find_bin(LLAMA_SERVER)
    if binary is None:
        return None, f"llama-server: not found ({BUILD_HOW}; or --llama-server BIN)"
    if m.gguf is None:
        return None, f"llama-server: skipped ({m.path} is a Hugging Face folder, not a GGUF file)"
    if not Path(binary).exists():
        raise FileNotFoundError(f"--llama-server {binary}: no such file")
    return binary, None


def _spec_types(binary: str, asked: str | None) -> list[str]:
    have = llama_spec_types(binary)
    if asked is None:
        return have
    want = [t for t in asked.split(",") if t and t != "none"]
    if unknown := [t for t in want if t not in have]:
        raise ValueError(f"--llama-spec-types {','.join(unknown)}: this llama-server lists {','.join(have) or 'none'}")
    return want


def _result(args, m, parts, edit_runs, chat_runs, source, binary, spec_types, note, questions) -> dict:
    required = [(TERNLM_ON, TERNLM_OFF, True), (TERNLM_DRAFT, TERNLM_OFF, True)]   # the draft pair: with --draft-model
    info = [(c, LLAMA_NONE, False) for c in edit_runs if c.startswith("llama-server ") and c != LLAMA_NONE]
    info += [(TERNLM_OFF, LLAMA_NONE, False)]
    out_parts = {}
    if "edit" in parts:
        p = part(edit_runs, required + info, expected(source, args.turns))
        out_parts["edit"] = p | {"ratios": ratios(p, TARGET_EDIT)}
    if "mtbench" in parts:
        p = part(chat_runs, required)
        out_parts["mtbench"] = p | {"ratios": ratios(p, TARGET_CHAT)}
    return {"command": command_line(), "model": m.label, "model_path": str(m.path), "dtype": args.dtype,
            "settings": {"threads": args.threads, "draft_model": getattr(args, "draft_model", None), "repeats": args.repeats, "turns": args.turns,
                         "max_tokens": args.max_tokens, "mt_questions": len(questions),
                         "sampling": sampling_of(args).name, "sampling_fields": sampling_of(args).openai_fields(),
                         "seed": getattr(args, "seed", 0),
                         "mt_max_tokens": args.mt_max_tokens, "ctx": args.ctx, "prefix_reuse": not args.no_prefix_kv,
                         "edit_source": str(SOURCE.relative_to(SOURCE.parents[2])),
                         "edit_source_lines": len(source.splitlines()), "questions": [q.id for q in questions]},
            "llama_server": {"binary": binary, "spec_types": spec_types} if binary else None,
            "llama_server_note": note, "parts": out_parts}
