"""Pieces every benchmark shares: statistics, a synthetic conversation, the llama.cpp worker, output."""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not which "
         "river mountain engine garden theory market window history language music science city "
         "travel letter report system network memory signal ocean forest planet kitchen bridge "
         "quickly carefully often never always rarely simply clearly").split()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def synthetic_text(rng: random.Random, words: int) -> str:
    """Plain English-looking filler: deterministic for a seed, tokenizes to ~1.2 tokens per word."""
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
    return " ".join(out) + "."


def synthetic_conversation(rng: random.Random, turns: int, system_words: int, user_words: int,
                           assistant_words: int) -> list[dict]:
    """system + `turns` (user, assistant) pairs; a chat client would resend all of it next turn."""
    msgs = [{"role": "system", "content": synthetic_text(rng, system_words)}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": synthetic_text(rng, user_words)})
        msgs.append({"role": "assistant", "content": synthetic_text(rng, assistant_words)})
    return msgs


def long_chat(engine, history_tokens: int, rng: random.Random) -> list[dict]:
    """A synthetic chat whose rendered prompt is at least `history_tokens` long, ending with a user
    message that asks for a summary (the turn the benchmarks then answer and continue)."""
    msgs = synthetic_conversation(rng, turns=1, system_words=60, user_words=60, assistant_words=80)
    while len(engine.apply_chat_template(msgs)) < history_tokens:
        msgs += synthetic_conversation(rng, 1, 0, 60, 80)[1:]
    msgs.append({"role": "user", "content": "Summarise our conversation in one sentence."})
    return msgs


class LlamaCppWorker:
    """llama-cpp-python in its own venv and process (it must not share our interpreter), driven over
    JSON lines. See benchmarks/llamacpp_worker.py for the commands."""

    def __init__(self, python: str, model_path: Path, threads: int, n_ctx: int):
        worker = Path(__file__).resolve().parents[3] / "benchmarks" / "llamacpp_worker.py"
        self.proc = subprocess.Popen([python, str(worker), str(model_path), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.call({"op": "ping"})

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def write_json(out_dir: Path, name: str, data: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2))
    return path


def command_line() -> str:
    return "ternlm " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "ternlm" else " ".join(sys.argv)
