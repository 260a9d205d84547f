"""`ternlm bench multiturn`: replay multi-turn conversations against every configuration through HTTP,
the way a chat client does (the whole transcript resent each turn, the contender's own answers in it),
and measure each turn: prompt and reused tokens, time to first token, prefill and decode tok/s, end to
end. With -m, two real `ternlm serve` processes (prefix reuse on and off) are started and driven exactly
like any `--url` contender (llama.cpp's server, vLLM, ...): one measuring path for all, the chat's
`OpenAIBackend`.

Fairness on a shared machine: contenders take turns batch by batch (A B, then B A, ...), so drift hits
all alike; each server is warmed up with one short request before anything is timed.

Sampling: as vLLM's multi-turn client, no temperature is sent unless --temperature is given (the server's
default: OpenAI's temperature 1 for ternlm); --top-p and --presence-penalty are sent when given. Every
request carries a seed of its own (from --seed, the conversation and the turn), the same for every
contender: a sampled draw is keyed by (seed, position), so the identity check below holds sampled too.

Correctness: ternlm with reuse must answer exactly as ternlm without it (the project's first rule), greedy
or seeded. That pair, plus any `--require-identical A,B`, is required to match turn by turn; a
mismatch is printed, flagged in results.json and makes the exit status 1. Other contenders are compared
with the first one for information only (another engine may round differently).

Concurrency (`--concurrency N`): N conversations replay at once, each on its own client thread, so
the server batches their steps. Token arrival times are recorded per answer, and the summary gives
aggregate decode tok/s, TTFT and inter-token latency (median, p99) (bench/latency.py). With
`--cold-prompt-tokens T`, one unrelated T-token prompt is sent while they stream, and the other streams'
inter-token latency during its prefill is reported beside the rest.

Outputs in --out: results.json (settings, every turn, summaries, comparisons), ttft.png (median time to
first token by turn number, one line per configuration), logs/ (the servers we started).
"""
from __future__ import annotations

import json
import logging
import os
import random
import shlex
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..cli.chat_backends import OpenAIBackend, TurnStats
from .procs import TernlmServe
from .common import bench_model, command_line, synthetic_text, write_json
from .llamacpp import LLAMA_SERVER, llama_server, resolve_bin
from .latency import aggregate_decode_tok_s, gaps, pcts, split_gaps
from .sampling_settings import describe, request_fields

REUSE, NO_REUSE = "ternlm-reuse", "ternlm-no-reuse"


# ---- conversations ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    """What the user says; the assistant turns come from each contender at replay time."""
    id: str
    system: str | None
    user_turns: tuple[str, ...]


def synthetic_conversations(n: int, turns: int, system_words: int, user_words: int, seed: int) -> list[Conversation]:
    """Seeded filler conversations: a system prompt of `system_words` words, then `turns` user messages
    of about `user_words` words each (0.5x to 1.5x, so turns differ in length)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        system = synthetic_text(rng, system_words) if system_words > 0 else None
        users = tuple(synthetic_text(rng, max(1, round(user_words * rng.uniform(0.5, 1.5)))) for _ in range(turns))
        out.append(Conversation(f"synthetic-{i}", system, users))
    return out


def load_conversations(path: Path, n: int, turns: int) -> list[Conversation]:
    """MT-Bench question lines ({"question_id", "turns": [...]}) or OpenAI chats ({"messages": [...]} or a
    bare list): the system message and the user messages are kept, assistant messages are dropped
    (each contender answers for itself). At most `n` conversations (0 = all), `turns` user turns each."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if isinstance(obj, dict) and "turns" in obj:
            cid, system, users = str(obj.get("question_id", lineno)), None, [str(t) for t in obj["turns"]]
        else:
            msgs = obj.get("messages") if isinstance(obj, dict) else obj
            if not isinstance(msgs, list):
                raise ValueError(f"{path}:{lineno}: expected MT-Bench `turns` or OpenAI `messages`")
            cid = str(obj.get("id", lineno)) if isinstance(obj, dict) else str(lineno)
            system = next((m["content"] for m in msgs if m.get("role") == "system"), None)
            users = [m["content"] for m in msgs if m.get("role") == "user"]
        if users:
            out.append(Conversation(cid, system, tuple(users[:turns])))
        if n and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path}: no conversations with a user turn")
    return out


# ---- contenders ---------------------------------------------------------------------------------

@dataclass
class Contender:
    label: str
    url: str
    started: TernlmServe | None = None       # a server this bench started (and stops)
    backend: OpenAIBackend | None = None


def ternlm_serve_args(args, reuse: bool) -> list[str]:
    """The engine flags of this bench passed on to `ternlm serve`; slots = clients so every concurrent
    conversation can keep its own KV."""
    slots = getattr(args, "slots", 0) or max(1, args.clients) + (1 if getattr(args, "cold_prompt_tokens", 0) else 0)
    out = ["-m", args.model, "--dtype", args.dtype, "--weights", getattr(args, "weights", "auto"),
           "--kv-dtype", getattr(args, "kv_dtype", "auto"), "--activations", getattr(args, "activations", "auto"),
           "--min-reuse", str(args.min_reuse), "--chunk", "auto" if args.chunk is None else str(args.chunk),
           "--slots", str(slots)]
    if getattr(args, "step_tokens", 0):
        out += ["--step-tokens", str(args.step_tokens)]
    if args.ctx:
        out += ["--ctx", str(args.ctx)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    return out + ([] if reuse else ["--no-prefix-kv"])


# ---- one conversation, one turn ---------------------------------------------------------------

@dataclass
class TurnResult:
    contender: str
    conversation: str
    turn: int                        # 1-based
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float
    prefill_tok_s: float | None
    decode_tok_s: float | None
    e2e_s: float
    finish_reason: str | None
    measured: str                    # "server": prefill/decode from the server's timings; "client": wall clock
    token_times: list[float] = field(default_factory=list)   # perf_counter() at each content chunk's arrival


def turn_seed(seed: int, conversation: str, turn: int) -> int:
    """The seed of one turn's request: the same for every contender, different per conversation and turn. Pure."""
    return zlib.crc32(f"{seed}/{conversation}/{turn}".encode())


def replay(backend: OpenAIBackend, label: str, conv: Conversation, max_tokens: int,
           on_turn=lambda: None, sampling: dict | None = None, seed: int = 0) -> list[TurnResult]:
    """Send the conversation turn by turn, the whole transcript each time, with `sampling`'s fields (an
    OpenAI body's: temperature, top_p, ...; none: the server's defaults) and turn_seed's seed. Side effect:
    the contender's KV now holds this conversation."""
    sampling = dict(sampling or {})
    temperature = sampling.pop("temperature", None)
    history = [{"role": "system", "content": conv.system}] if conv.system else []
    out = []
    for t, user in enumerate(conv.user_turns, 1):
        history.append({"role": "user", "content": user})
        pieces, stats, times = [], None, []
        for ev in backend.stream(list(history), max_tokens=max_tokens, temperature=temperature,
                                 seed=turn_seed(seed, conv.id, t), sampling=sampling):
            if isinstance(ev, TurnStats):
                stats = ev
            else:
                times.append(time.perf_counter())
                pieces.append(ev)
        text = "".join(pieces)
        history.append({"role": "assistant", "content": text})
        out.append(TurnResult(label, conv.id, t, text, stats.prompt_tokens, stats.cached_tokens,
                              stats.completion_tokens, stats.ttft_s, stats.prefill_tok_s, stats.decode_tok_s,
                              stats.e2e_s, stats.finish_reason, stats.measured, times))
        on_turn()
    return out


# ---- comparisons --------------------------------------------------------------------------------

@dataclass
class Comparison:
    a: str
    b: str
    required: bool
    turns_compared: int = 0
    turns_equal: int = 0
    first_mismatch: dict | None = None   # {conversation, turn, a, b}: where the texts first differ

    @property
    def identical(self) -> bool:
        return self.turns_compared > 0 and self.turns_equal == self.turns_compared


def compare(turns: list[TurnResult], a: str, b: str, required: bool) -> Comparison:
    """Turn-by-turn equality of two contenders' answers. After a first difference the transcripts differ
    too, so later turns are still counted but only the first mismatch is the interesting one."""
    by = {(r.contender, r.conversation, r.turn): r.text for r in turns}
    c = Comparison(a, b, required)
    for (who, conv, turn), text in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if who != a or (b, conv, turn) not in by:
            continue
        other = by[(b, conv, turn)]
        c.turns_compared += 1
        if text == other:
            c.turns_equal += 1
        elif c.first_mismatch is None:
            c.first_mismatch = {"conversation": conv, "turn": turn, a: text, b: other}
    return c


def comparison_pairs(labels: list[str], required: list[tuple[str, str]]) -> list[tuple[str, str, bool]]:
    """Required pairs first (ternlm reuse vs no reuse when both run, then --require-identical), then
    every other contender against the first one, for information."""
    pairs = list(required)
    if REUSE in labels and NO_REUSE in labels:
        pairs.insert(0, (REUSE, NO_REUSE))
    out = [(a, b, True) for a, b in dict.fromkeys(pairs)]
    seen = {frozenset(p[:2]) for p in out}
    for other in labels[1:]:
        if frozenset((labels[0], other)) not in seen:
            out.append((labels[0], other, False))
    return out


# ---- summaries ----------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def median(xs: list[float]) -> float | None:
    return pct(xs, 50)


def summarize(turns: list[TurnResult], wall_s: float) -> dict:
    """One contender's figures: reuse fraction, latency percentiles, medians of rates, throughput."""
    known = [r for r in turns if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt = sum(r.prompt_tokens for r in known)
    cached = sum(r.cached_tokens for r in known)
    ttft = [r.ttft_s for r in turns]
    e2e = [r.e2e_s for r in turns]
    counted = all(r.completion_tokens is not None for r in turns)   # a server without usage: unknown
    done = sum(r.completion_tokens for r in turns) if counted else None
    return {"turns": len(turns), "prompt_tokens": prompt if known else None, "cached_tokens": cached if known else None,
            "reuse_fraction": cached / prompt if known and prompt else None,
            "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "e2e_s": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "p99": pct(e2e, 99)},
            "prefill_tok_s_median": median([r.prefill_tok_s for r in turns if r.prefill_tok_s]),
            "decode_tok_s_median": median([r.decode_tok_s for r in turns if r.decode_tok_s]),
            "itl_s": pcts([g for r in turns for g in gaps(r.token_times)]),
            "decode_tok_s_aggregate": aggregate_decode_tok_s([r.token_times for r in turns]),
            "wall_s": wall_s, "completion_tokens": done,
            "throughput_tok_s": done / wall_s if counted and wall_s else None,
            "turns_per_s": len(turns) / wall_s if wall_s else None}


def by_turn(turns: list[TurnResult]) -> dict[int, dict]:
    """Per turn number: median time to first token and the reuse fraction (over conversations)."""
    out = {}
    for t in sorted({r.turn for r in turns}):
        rs = [r for r in turns if r.turn == t]
        known = [r for r in rs if r.prompt_tokens and r.cached_tokens is not None]
        out[t] = {"ttft_s_median": median([r.ttft_s for r in rs]), "n": len(rs),
                  "reuse_fraction": (sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known)
                                     if known else None)}
    return out


def cold_summary(turns: list[TurnResult], colds: list[ColdResult]) -> dict:
    """The other streams' inter-token latency while a cold prompt prefilled, against the rest."""
    during, outside = split_gaps([r.token_times for r in turns], [(c.sent, c.first) for c in colds])
    d, o = pcts(during), pcts(outside)
    return {"prompt_tokens": [c.prompt_tokens for c in colds], "prefill_s": [c.first - c.sent for c in colds],
            "windows": [[c.sent, c.first] for c in colds],
            "itl_during_s": d, "itl_outside_s": o,
            "p99_during_over_p50_outside": d["p99"] / o["p50"] if d["p99"] and o["p50"] else None}


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class Plan:
    contenders: list[Contender]
    conversations: list[Conversation]
    clients: int
    max_tokens: int
    required: list[tuple[str, str]] = field(default_factory=list)
    cold_tokens: int = 0             # > 0: one unrelated prompt this long per contender batch
    cold_delay_s: float = 3.0
    seed: int = 0
    sampling: dict = field(default_factory=dict)   # the requests' sampling fields (none: the servers' defaults)


@dataclass
class ColdResult:
    """The cold prompt sent while a contender's conversations streamed: its prefill window."""
    contender: str
    sent: float                      # perf_counter() when sent
    first: float                     # ... when its (only) token arrived: the prefill is over
    prompt_tokens: int | None


def cold_prompt(backend: OpenAIBackend, label: str, tokens: int, delay_s: float, seed: int) -> ColdResult:
    """After `delay_s`, send one prompt of ~`tokens` tokens that shares nothing with the conversations
    (a cold prefill) and wait for its single token."""
    time.sleep(delay_s)
    text = f"[{seed}] " + synthetic_text(random.Random(seed ^ 0xC01D), round(tokens / 1.1))   # ~1.1 tokens a word with a chat template
    sent, stats = time.perf_counter(), None
    for ev in backend.stream([{"role": "user", "content": text}], max_tokens=1, temperature=0.0):
        if isinstance(ev, TurnStats):
            stats = ev
    return ColdResult(label, sent, sent + (stats.ttft_s if stats else 0.0), stats.prompt_tokens if stats else None)


def run_plan(plan: Plan, progress) -> tuple[list[TurnResult], dict[str, float], list[ColdResult]]:
    """Batches of `clients` conversations; per batch every contender in turn (order rotated), the
    batch's conversations concurrently on one thread each (plus the cold prompt's thread, if asked).
    Returns (all turns, wall seconds per contender, cold prompts)."""
    turns: list[TurnResult] = []
    colds: list[ColdResult] = []
    wall = {c.label: 0.0 for c in plan.contenders}
    task = progress.add_task("replaying", total=len(plan.contenders) * sum(len(c.user_turns) for c in plan.conversations))
    conv = plan.conversations
    with ThreadPoolExecutor(max_workers=plan.clients + 1) as pool:
        for b, start in enumerate(range(0, len(conv), plan.clients)):
            batch = conv[start:start + plan.clients]
            k = b % len(plan.contenders)
            for c in plan.contenders[k:] + plan.contenders[:k]:      # A B, then B A: drift hits all alike
                progress.update(task, description=f"{c.label}: conversations {start + 1}-{start + len(batch)}")
                t0 = time.perf_counter()
                futs = [pool.submit(replay, c.backend, c.label, cv, plan.max_tokens,
                                    lambda: progress.advance(task), plan.sampling, plan.seed) for cv in batch]
                cold = (pool.submit(cold_prompt, c.backend, c.label, plan.cold_tokens, plan.cold_delay_s,
                                    plan.seed * 1000 + b) if plan.cold_tokens > 0 else None)
                got = [f.result() for f in futs]
                if cold is not None:
                    colds.append(cold.result())
                wall[c.label] += time.perf_counter() - t0
                for g in got:
                    turns.extend(g)
    return turns, wall, colds


def warm_up(c: Contender) -> None:
    """One short untimed request: first-call costs (allocation, kernels, connection) are not a turn's."""
    for _ in c.backend.stream([{"role": "user", "content": "Hello."}], max_tokens=2, temperature=0.0):
        pass


def run(args) -> int:
    """With --llama-server: llama.cpp's llama-server on -m's GGUF as one more contender (labelled `llama-server`,
    after the --url ones), started before and stopped after the replay, pass or fail; then _replay."""
    binary = resolve_bin(LLAMA_SERVER, getattr(args, "llama_server", None))
    if not binary:
        return _replay(args)
    if not args.model:
        raise ValueError("--llama-server needs -m (the GGUF it serves)")
    gguf = bench_model(args.model).gguf
    if gguf is None:
        raise ValueError(f"--llama-server: {args.model} is not a GGUF file")
    urls, labels = list(args.url or []), list(args.label or [])
    labels += [f"url{i + 1}" for i in range(len(labels), len(urls))]
    threads = args.threads or os.cpu_count() or 1
    # one slot per concurrent client, as the ternlm servers get; its defaults otherwise (prefix cache on)
    with llama_server(binary, gguf, threads, max(1, args.clients), args.llama_server_ctx,
                      Path(args.out) / "logs" / "llama-server.log", shlex.split(args.llama_server_args or "")) as s:
        args.url, args.label = [*urls, s.url], [*labels, LLAMA_SERVER]
        return _replay(args)


def _replay(args) -> int:
    """Start what -m asks for, replay, report. Returns the exit status: 1 if a required pair differs."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    for name, v, low in (("--turns", args.turns, 1), ("--max-tokens", args.max_tokens, 1), ("--clients", args.clients, 1),
                         ("--num-conversations", args.num_conversations, 0)):
        if v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    err = Console(stderr=True)
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx2").setLevel(logging.WARNING)   # one INFO line per request otherwise
    out_dir = Path(args.out)
    conversations = (load_conversations(Path(args.conversations), args.num_conversations, args.turns)
                     if args.conversations else
                     synthetic_conversations(args.num_conversations or 4, args.turns, args.system_words,
                                             args.user_words, args.seed))
    urls = list(args.url or [])
    labels = list(args.label or [])
    if len(labels) > len(urls):
        raise ValueError(f"{len(labels)} --label for {len(urls)} --url")
    labels += [f"url{i + 1}" for i in range(len(labels), len(urls))]
    contenders = [Contender(lb, u) for lb, u in zip(labels, urls)]
    if args.model:
        ours = [Contender(REUSE, "")] + ([] if getattr(args, "only_reuse", False) else [Contender(NO_REUSE, "")])
        contenders = ours + contenders
    names = [c.label for c in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender labels must be unique: {names}")
    required = [tuple(p.split(",")) for p in args.require_identical or []]
    for p in required:
        if len(p) != 2 or not set(p) <= set(names):
            raise ValueError(f"--require-identical {','.join(p)}: name two of {', '.join(names)}")
    sampling = request_fields(getattr(args, "temperature", None), getattr(args, "top_p", None),
                              getattr(args, "presence_penalty", None))
    plan = Plan(contenders, conversations, args.clients, args.max_tokens, required,
                getattr(args, "cold_prompt_tokens", 0), getattr(args, "cold_prompt_delay", 3.0), args.seed, sampling)

    try:
        for c in contenders:
            if c.label in (REUSE, NO_REUSE):
                c.started = TernlmServe(*ternlm_serve_args(args, c.label == REUSE),
                                        log_path=out_dir / "logs" / f"{c.label}.log").start()
                c.url = c.started.url
        with err.status("starting servers and warming up ..."):
            for c in contenders:
                if c.started:
                    c.started.wait_ready()
                c.backend = OpenAIBackend(c.url, args.api_key, label=c.label)
                warm_up(c)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err) as progress:
            turns, wall, colds = run_plan(plan, progress)
    finally:
        for c in contenders:
            if c.started:
                c.started.close()

    comparisons = [compare(turns, a, b, req) for a, b, req in comparison_pairs(names, required)]
    result = {
        "command": command_line(), "model": args.model, "dtype": args.dtype if args.model else None,
        "settings": {"conversations": len(conversations), "source": args.conversations or "synthetic",
                     "turns": args.turns, "max_tokens": args.max_tokens, "clients": plan.clients,
                     "cold_prompt_tokens": plan.cold_tokens,
                     # the requests' sampling fields as sent ({}: none, the servers' defaults), seeded per turn
                     "sampling": sampling, "sampling_text": describe(sampling),
                     "temperature": sampling.get("temperature"),
                     "seed": args.seed, "system_words": args.system_words,
                     "user_words": args.user_words},
        "contenders": {c.label: {"url": c.url, "model": c.backend.model if c.backend else None,
                                 "started": c.started is not None} for c in contenders},
        "summary": {n: summarize([r for r in turns if r.contender == n], wall[n]) for n in names},
        "ttft_by_turn": {n: by_turn([r for r in turns if r.contender == n]) for n in names},
        "cold_prompt": {n: cold_summary([r for r in turns if r.contender == n], [c for c in colds if c.contender == n])
                        for n in names} if colds else None,
        "comparisons": [asdict(c) | {"identical": c.identical} for c in comparisons],
        "all_required_identical": all(c.identical for c in comparisons if c.required),
        "turns": [asdict(r) for r in turns],
    }
    path = write_json(out_dir, "results.json", result)
    png = plot(result, out_dir / "ttft.png")
    report(result, Console(width=None if sys.stdout.isatty() else 200), [path, png])
    return 0 if result["all_required_identical"] else 1


# ---- output -------------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> Path:
    """Median time to first token against turn number, one line per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, rows in result["ttft_by_turn"].items():
        xs = sorted(rows, key=int)
        ax.plot([int(x) for x in xs], [rows[x]["ttft_s_median"] * 1e3 for x in xs], marker="o", label=name)
    s = result["settings"]
    ax.set(xlabel="turn", ylabel="time to first token, median (ms)",
           title=f"{s['conversations']} conversations × {s['turns']} turns, {s['clients']} client(s)")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _s(x: float | None, unit: str = " s", digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def report(result: dict, console, paths: list[Path]) -> None:
    """The summary table, TTFT by turn (reuse fraction beside each figure), and the identity verdicts."""
    from rich.table import Table
    summ = result["summary"]
    t = Table(title=f"multi-turn replay · {result['settings']['conversations']} conversations · "
                    f"{result['settings']['clients']} client(s) · {result['settings']['sampling_text']}, "
                    f"max {result['settings']['max_tokens']} tokens")
    for col in ("contender", "turns", "reused", "TTFT p50", "TTFT p90", "TTFT p99", "prefill tok/s", "decode tok/s",
                "e2e p50", "e2e p90", "tok/s (all clients)"):
        t.add_column(col, justify="left" if col == "contender" else "right")
    for name, s in summ.items():
        t.add_row(name, str(s["turns"]), _pct(s["reuse_fraction"]), _s(s["ttft_s"]["p50"]), _s(s["ttft_s"]["p90"]),
                  _s(s["ttft_s"]["p99"]), _s(s["prefill_tok_s_median"], "", 0), _s(s["decode_tok_s_median"], "", 1),
                  _s(s["e2e_s"]["p50"]), _s(s["e2e_s"]["p90"]), _s(s["throughput_tok_s"], "", 1))
    console.print(t)

    ct = Table(title=f"streaming at concurrency {result['settings']['clients']}: aggregate decode, TTFT, "
                     f"inter-token latency (client side)")
    for col in ("contender", "decode tok/s (aggregate)", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"):
        ct.add_column(col, justify="left" if col == "contender" else "right")
    for name, s in summ.items():
        ms = lambda x: "-" if x is None else f"{x * 1e3:.1f} ms"   # noqa: E731
        ct.add_row(name, _s(s["decode_tok_s_aggregate"], "", 1), ms(s["ttft_s"]["p50"]), ms(s["ttft_s"]["p99"]),
                   ms(s["itl_s"]["p50"]), ms(s["itl_s"]["p99"]))
    console.print(ct)
    for name, c in (result.get("cold_prompt") or {}).items():
        d, o = c["itl_during_s"], c["itl_outside_s"]
        fmt = lambda x: "-" if x is None else f"{x * 1e3:.1f} ms"   # noqa: E731
        ratio = c["p99_during_over_p50_outside"]
        console.print(f"{name}: cold prompt of {c['prompt_tokens']} tokens prefilled in "
                      f"{', '.join(f'{x:.2f} s' for x in c['prefill_s'])}; other streams' ITL during it "
                      f"p50 {fmt(d['p50'])} p99 {fmt(d['p99'])} (n={d['n']}), otherwise p50 {fmt(o['p50'])} "
                      f"p99 {fmt(o['p99'])} (n={o['n']}); p99 during / p50 otherwise = "
                      f"{'-' if ratio is None else f'{ratio:.2f}x'}")

    bt = Table(title="time to first token by turn: median (reused fraction of the prompt)")
    bt.add_column("turn", justify="right")
    for name in summ:
        bt.add_column(name, justify="right")
    turns = sorted({int(k) for rows in result["ttft_by_turn"].values() for k in rows})
    for k in turns:
        cells = []
        for name in summ:
            row = result["ttft_by_turn"][name].get(k)
            cells.append("-" if row is None else f"{_s(row['ttft_s_median'])} ({_pct(row['reuse_fraction'])})")
        bt.add_row(str(k), *cells)
    console.print(bt)

    if REUSE in summ and NO_REUSE in summ:
        later = [k for k in turns if k > 1]
        a = median([result["ttft_by_turn"][REUSE][k]["ttft_s_median"] for k in later])
        b = median([result["ttft_by_turn"][NO_REUSE][k]["ttft_s_median"] for k in later])
        if a and b:
            console.print(f"turns 2+: {REUSE} first token x{b / a:.2f} faster than {NO_REUSE} "
                          f"at {_pct(summ[REUSE]['reuse_fraction'])} of prompt tokens reused overall")
    for c in result["comparisons"]:
        what = "required identical" if c["required"] else "reported only"
        if c["identical"]:
            console.print(f"[green]identical output[/] {c['a']} vs {c['b']}: "
                          f"{c['turns_equal']}/{c['turns_compared']} turns ({what})")
        else:
            m = c["first_mismatch"] or {}
            style = "bold red" if c["required"] else "yellow"
            console.print(f"[{style}]{'MISMATCH' if c['required'] else 'differs'}[/] {c['a']} vs {c['b']}: "
                          f"{c['turns_equal']}/{c['turns_compared']} turns equal ({what}); first difference "
                          f"conversation {m.get('conversation')} turn {m.get('turn')}: "
                          f"{m.get(c['a'], '')[:60]!r} vs {m.get(c['b'], '')[:60]!r}")
    console.print(f"command: {result['command']}")
    for p in paths:
        console.print(f"wrote {p}")
