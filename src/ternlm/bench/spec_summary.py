"""`ternlm bench spec`'s figures from its answers, pure: per contender the decode rate over a replay (server
timings and client clock), total time, drafted/accepted; medians over repeats; the ratios the issue sets
targets for; the identical-text checks; and the markdown page (also what the command prints)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from .spec_edits import answered_file
from .spec_stream import Answer

TERNLM_OFF, TERNLM_ON = "ternlm spec off", "ternlm spec on"
TERNLM_DRAFT = "ternlm draft model"      # `--draft-model`: speculation with a small model's drafts
LLAMA_NONE = "llama-server none"
TARGET_EDIT = 2.5     # issue 48: ternlm on / off decode tok/s on the code-editing replay (qwen2.5-coder-1.5b)
TARGET_CHAT = 0.95    # ... and on fresh text (MT-Bench): speculation must back off, not cost


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def totals(answers: list[Answer]) -> dict:
    """One replay's figures: tokens over decode time, summed over its answers (long answers weigh more)."""
    tokens = sum(a.decode_tokens for a in answers)
    decode_s = sum(a.decode_ms for a in answers) / 1e3
    stream_s = sum(a.stream_s for a in answers)
    drafted = [a.drafted for a in answers if a.drafted is not None]
    accepted = [a.accepted for a in answers if a.accepted is not None]
    d, k = (sum(drafted), sum(accepted)) if drafted else (None, None)
    return {"answers": len(answers), "tokens": tokens, "decode_s": decode_s,
            "server_tok_s": tokens / decode_s if decode_s > 0 else None,
            "client_tok_s": sum(a.decode_tokens - 1 for a in answers) / stream_s if stream_s > 0 else None,
            "prefill_s": sum(a.prompt_ms for a in answers) / 1e3, "wall_s": sum(a.wall_s for a in answers),
            "drafted": d, "accepted": k, "acceptance": k / d if d else None}


def medians(per_repeat: list[dict]) -> dict:
    """Each figure's median over repeats."""
    return {key: _median([t[key] for t in per_repeat]) for key in per_repeat[0]}


@dataclass
class Identity:
    a: str
    b: str
    required: bool
    compared: int = 0
    equal: int = 0
    first_mismatch: dict | None = None     # {repeat, turn, a, b}: the texts' first difference

    @property
    def identical(self) -> bool:
        return self.compared > 0 and self.equal == self.compared


def identity(runs: dict[str, list[list[Answer]]], a: str, b: str, required: bool) -> Identity:
    """Answer by answer (same repeat, same turn): the same ids and the same text."""
    out = Identity(a, b, required)
    for r, (xs, ys) in enumerate(zip(runs[a], runs[b])):
        for t, (x, y) in enumerate(zip(xs, ys), 1):
            out.compared += 1
            if x.text == y.text and x.tokens == y.tokens:
                out.equal += 1
            elif out.first_mismatch is None:
                at = next((i for i, (p, q) in enumerate(zip(x.text, y.text)) if p != q), min(len(x.text), len(y.text)))
                out.first_mismatch = {"repeat": r, "turn": t, "char": at, a: x.text[max(0, at - 40):at + 80],
                                      b: y.text[max(0, at - 40):at + 80]}
    return out


def part(runs: dict[str, list[list[Answer]]], pairs: list[tuple[str, str, bool]], expected: list[str] | None = None) -> dict:
    """One part's JSON: per contender medians, per-turn medians, every answer, identity checks."""
    out = {"contenders": {}, "identity": []}
    for name, reps in runs.items():
        row = {"median": medians([totals(rep) for rep in reps]),
               "repeats": [totals(rep) for rep in reps],
               "by_turn": [{"prompt_tokens": rep_t[0].prompt_tokens,
                            "cached_tokens": _median([a.cached_tokens for a in rep_t]),
                            "tokens": _median([a.decode_tokens for a in rep_t]),
                            "server_tok_s": _median([a.server_tok_s for a in rep_t]),
                            "client_tok_s": _median([a.client_tok_s for a in rep_t]),
                            "wall_s": _median([a.wall_s for a in rep_t])}
                           for rep_t in zip(*reps)],
               "answers": [[asdict(a) | {"tokens": len(a.tokens)} for a in rep] for rep in reps]}
        if expected is not None:
            got = [answered_file(a.text) == expected[t] for rep in reps for t, a in enumerate(rep)]
            row["answers_equal_expected_file"] = {"equal": sum(got), "of": len(got)}
        out["contenders"][name] = row
    out["identity"] = [asdict(i) | {"identical": i.identical} for i in
                       (identity(runs, a, b, req) for a, b, req in pairs if a in runs and b in runs)]
    return out


def ratios(p: dict, target: float) -> dict:
    """ternlm on / off (server and client decode tok/s, total time), the draft model's / off (with --draft-model),
    and on / the best llama-server."""
    c = p["contenders"]
    out: dict = {}
    if TERNLM_ON in c and TERNLM_OFF in c:
        on, off = c[TERNLM_ON]["median"], c[TERNLM_OFF]["median"]
        for k in ("server_tok_s", "client_tok_s"):
            out[f"on_over_off_{k}"] = on[k] / off[k] if on[k] and off[k] else None
        out["off_over_on_wall_s"] = off["wall_s"] / on["wall_s"] if on["wall_s"] else None
        r = out["on_over_off_server_tok_s"]
        out["target"] = {"min": target, "met": None if r is None else r >= target}
    if TERNLM_DRAFT in c and TERNLM_OFF in c:
        d, off_s = c[TERNLM_DRAFT]["median"]["server_tok_s"], c[TERNLM_OFF]["median"]["server_tok_s"]
        out["draft_over_off_server_tok_s"] = d / off_s if d and off_s else None
    llama = {n: row["median"]["server_tok_s"] for n, row in c.items() if n.startswith("llama-server")
             and row["median"]["server_tok_s"]}
    if llama:
        best = max(llama, key=llama.get)
        out["llama_server_best"] = {"contender": best, "server_tok_s": llama[best]}
        if TERNLM_ON in c and c[TERNLM_ON]["median"]["server_tok_s"]:
            out["on_over_llama_server_best"] = c[TERNLM_ON]["median"]["server_tok_s"] / llama[best]
        if LLAMA_NONE in llama:
            out["llama_server_best_over_none"] = llama[best] / llama[LLAMA_NONE]
    return out


def all_required_identical(result: dict) -> bool:
    return all(i["identical"] for p in result["parts"].values() for i in p["identity"] if i["required"])


# ---- the page ------------------------------------------------------------------------------------

def _f(x, digits: int = 1, unit: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _int(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def _part_md(title: str, p: dict, target: float, what: str) -> list[str]:
    lines = [f"## {title}", "", what, "",
             "| contender | decode tok/s (server) | decode tok/s (client) | total s | prefill s | tokens | drafted "
             "| accepted | acceptance |" + (" answer = expected file |" if any("answers_equal_expected_file" in r
                                                                                for r in p["contenders"].values()) else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if any("answers_equal_expected_file" in r
                                                                          for r in p["contenders"].values()) else "")]
    for name, row in p["contenders"].items():
        m = row["median"]
        exp = row.get("answers_equal_expected_file")
        lines.append(f"| {name} | {_f(m['server_tok_s'])} | {_f(m['client_tok_s'])} | {_f(m['wall_s'])} | "
                     f"{_f(m['prefill_s'])} | {_int(m['tokens'])} | {_int(m['drafted'])} | {_int(m['accepted'])} | "
                     f"{_pct(m['acceptance'])} |" + (f" {exp['equal']}/{exp['of']} |" if exp else ""))
    r = p["ratios"]
    lines.append("")
    if r.get("on_over_off_server_tok_s") is not None:
        met = r["target"]["met"]
        lines.append(f"- ternlm on / off, decode tok/s: **x{r['on_over_off_server_tok_s']:.2f}** (server), "
                     f"x{_f(r['on_over_off_client_tok_s'], 2)} (client); total time off / on x{_f(r['off_over_on_wall_s'], 2)}; "
                     f"target >= {target}: {'met' if met else 'MISSED'}")
    if r.get("draft_over_off_server_tok_s") is not None:
        lines.append(f"- ternlm draft model / off, decode tok/s: **x{r['draft_over_off_server_tok_s']:.2f}** (server)")
    if "llama_server_best" in r:
        b = r["llama_server_best"]
        lines.append(f"- best llama-server: {b['contender']} at {b['server_tok_s']:.1f} tok/s"
                     + (f" (x{r['llama_server_best_over_none']:.2f} its no-speculation run)"
                        if r.get("llama_server_best_over_none") else "")
                     + (f"; ternlm on / it: **x{r['on_over_llama_server_best']:.2f}**"
                        if r.get("on_over_llama_server_best") else ""))
    for i in p["identity"]:
        what_ = "required" if i["required"] else "for information"
        if i["identical"]:
            lines.append(f"- identical text: {i['a']} == {i['b']}, {i['equal']}/{i['compared']} answers ({what_})")
        else:
            mm = i["first_mismatch"] or {}
            lines.append(f"- {'**MISMATCH**' if i['required'] else 'differs'}: {i['a']} vs {i['b']}, "
                         f"{i['equal']}/{i['compared']} answers equal ({what_}); first at repeat {mm.get('repeat')} "
                         f"turn {mm.get('turn')} char {mm.get('char')}: {mm.get(i['a'], '')!r} vs {mm.get(i['b'], '')!r}")
    names = list(p["contenders"])
    lines += ["", "Per turn, median over repeats: decode tok/s (server)", "",
              "| turn | prompt tokens | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    turns = len(next(iter(p["contenders"].values()))["by_turn"])
    for t in range(turns):
        cells = [_f(p["contenders"][n]["by_turn"][t]["server_tok_s"]) if t < len(p["contenders"][n]["by_turn"])
                 else "-" for n in names]
        pt = next(iter(p["contenders"].values()))["by_turn"][t]["prompt_tokens"]
        lines.append(f"| {t + 1} | {pt} | " + " | ".join(cells) + " |")
    return lines + [""]


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# ternlm bench spec · {result['model']}", "", f"command: `{result['command']}`", "",
             f"{s['threads']} threads; ternlm driven through `ternlm serve` over HTTP (/v1/completions with token ids), "
             f"llama-server through its /completion with the same ids; a fresh server per contender and repeat, "
             f"contenders rotated each repeat; medians of {s['repeats']} repeat(s). Server decode tok/s: "
             f"timings.predicted_n / predicted_ms; client: streamed pieces after the first / their arrival span.", ""]
    if result.get("llama_server_note"):
        lines += [result["llama_server_note"], ""]
    parts = result["parts"]
    if "edit" in parts:
        lines += _part_md("Code-editing replay", parts["edit"], TARGET_EDIT,
                          f"A {s['edit_source_lines']}-line module pasted, then {s['turns']} requests for small changes; "
                          f"each answer is the whole file (max {s['max_tokens']} tokens, "
                          f"{s.get('sampling', 'greedy')}); the history's "
                          f"assistant turns are fixed (the previous file with the change applied), the same for all.")
    if "mtbench" in parts:
        lines += _part_md("MT-Bench chats (fresh text)", parts["mtbench"], TARGET_CHAT,
                          f"{s['mt_questions']} MT-Bench questions x 2 turns (tests/data), max {s['mt_max_tokens']} "
                          f"tokens, {s.get('sampling', 'greedy')}; each contender's own first answer in its second "
                          f"turn's history.")
    lines.append("Result: " + ("every required pair answered identically." if all_required_identical(result)
                               else "**a required pair answered differently (exit 1).**"))
    return "\n".join(lines) + "\n"
