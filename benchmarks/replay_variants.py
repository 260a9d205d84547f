"""How a replaying client grows its history each turn, shared by benchmarks/swa_replay.py and
hybrid_replay.py (issues 37 and 47). One variant per run:

  append   the history grows by the answer and the next user message
  trim     the client cuts the last sentence of each answer before sending it back
  edit     from turn 3 on, the client edits (prefixes "[edited] " to) its 3rd-from-last user message, i.e. the
           user message of turn t-2, every turn: each prompt diverges ~3 turns back

Pure functions on a list of OpenAI messages; they mutate only the list (and its dicts) they are given."""
from __future__ import annotations

VARIANTS = ("append", "trim", "edit")
EDIT = "[edited] "


def trim(text: str) -> str:
    """The answer without its last sentence (up to its last '.', '!', '?' or newline before the final
    character); with no earlier sentence end, without its last word."""
    body = text.rstrip()
    cut = max(body.rfind(c, 0, len(body) - 1) for c in ".!?\n")
    if cut > 0:
        return body[:cut + 1].rstrip()
    return body.rsplit(None, 1)[0] if " " in body.strip() else body


def add_user(history: list[dict], text: str, variant: str, turn: int) -> None:
    """Append turn `turn`'s (1-based) user message; `edit` then edits the user message of turn - 2."""
    history.append({"role": "user", "content": text})
    if variant == "edit" and turn >= 3:
        users = [m for m in history if m["role"] == "user"]
        users[-3]["content"] = EDIT + users[-3]["content"]


def add_answer(history: list[dict], answer: str, variant: str) -> str:
    """Append the answer as the client sends it back (`trim`: cut); returns what was appended."""
    sent = trim(answer) if variant == "trim" else answer
    history.append({"role": "assistant", "content": sent})
    return sent
