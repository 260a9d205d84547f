"""`ternlm chat`: a terminal chat that resends the whole transcript every turn, as real clients do,
and prints after each answer what that turn cost, reuse first:

    ternlm chat -m smollm2-135m                          # the engine in this process
    ternlm chat --url http://127.0.0.1:8000/v1           # any OpenAI-compatible server (openai client)
    reused 2034/2065 · prefill 31 tok in 0.05 s · 48 tok/s · first token 0.07 s

Input: a line ending with a backslash continues on the next line. Commands: /reset, /system TEXT,
/stats, /help, /quit (Ctrl-D too). Ctrl-C during an answer stops it and keeps what was said (as chat
UIs do); at the prompt it discards the line being typed.

Why the answer runs on a worker thread: Ctrl-C raises KeyboardInterrupt in the main thread wherever it
happens to be, which could be the middle of a forward pass or of an HTTP read. So the main thread only
waits on a queue; on Ctrl-C it raises a flag and the worker closes the stream between two tokens: the
engine's documented cancellation (its KV record stays exact) or, over HTTP, closing the response.

`Backend` is also what `ternlm bench multiturn` drives, so the chat's numbers and the benchmark's are
measured by the same code.
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import statistics
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, TextIO

PROMPT, CONTINUE = "you> ", "...> "
HELP = ("a line ending with \\ continues on the next line · /reset forget the conversation · "
        "/system TEXT set the system prompt (empty: none) · /stats session totals · /quit (or Ctrl-D) · "
        "Ctrl-C stops an answer")


# TurnStats and the backends live in chat_backends.py (shared with the benchmarks)
from .chat_backends import Backend, EngineBackend, OpenAIBackend, Thinking, TurnStats, _fill  # noqa: E402,F401


# ---- the REPL -----------------------------------------------------------------------------------

@dataclass
class Chat:
    """The conversation and its commands. History lives here and is resent whole every turn."""
    backend: Backend
    max_tokens: int = 512
    temperature: float = 0.7
    system: str | None = None
    out: TextIO = field(default_factory=lambda: sys.stdout)
    history: list[dict] = field(default_factory=list)     # user/assistant messages, oldest first
    turns: list[TurnStats] = field(default_factory=list)  # completed answers this session
    color: bool = False
    _thinking: bool = False      # the current answer is printing its thinking

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def run(self, read: Callable[[str], str] = input) -> int:
        """Read-eval loop until /quit or end of input. Returns the exit status (0)."""
        self.dim(f"{self.backend.label} · {HELP}")
        while True:
            try:
                text = read_message(read)
            except EOFError:
                self.say("")
                return 0
            except KeyboardInterrupt:
                self.say("")       # discard the line being typed, as a shell does
                continue
            if not text.strip():
                continue
            if text.startswith("/") and not self.command(text):
                return 0
            if not text.startswith("/"):
                self.ask(text)

    def command(self, text: str) -> bool:
        """Run a /command. Returns False for /quit."""
        name, _, arg = text.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            n = len(self.history)
            self.history.clear()
            self.dim(f"(history cleared: {n} messages; system prompt kept)")
        elif name == "/system":
            self.system = arg.strip() or None
            self.dim(f"(system prompt {'set' if self.system else 'cleared'}; history kept)")
        elif name == "/stats":
            self.dim(self.stats())
        elif name == "/help":
            self.dim(HELP)
        else:
            self.dim(f"(unknown command {name}; {HELP})")
        return True

    def ask(self, text: str) -> TurnStats | None:
        """One turn: send the whole transcript + `text`, stream the answer, print the stats line.
        Side effects: appends to the history (a partial answer too, if interrupted after some text)."""
        self.history.append({"role": "user", "content": text})
        self._thinking = False
        try:
            events = self.backend.stream(self.messages(), max_tokens=self.max_tokens, temperature=self.temperature)
            answer, stats, interrupted = pump(events, self._answer, self._think)
        except Exception as e:  # noqa: BLE001 - a failed turn must not end the chat
            self.history.pop()
            self.say("")
            self.dim(f"(error: {type(e).__name__}: {e})")
            return None
        if answer:
            self.history.append({"role": "assistant", "content": answer})
        else:
            self.history.pop()     # nothing said: as if the question was never sent
        if answer and not answer.endswith("\n"):
            self.write("\n")
        if interrupted:
            self.dim("(interrupted)" + ("" if answer else " (question dropped)"))
            return None
        self.turns.append(stats)
        self.dim(stats.line())
        return stats

    def stats(self) -> str:
        if not self.turns:
            return "(no answers yet)"
        t = self.turns

        def total(attr: str) -> float | None:
            xs = [getattr(s, attr) for s in t]
            return None if any(x is None for x in xs) else sum(xs)
        parts = [f"turns {len(t)}"]
        prompt, cached = total("prompt_tokens"), total("cached_tokens")
        if prompt is not None and cached is not None:
            parts.append(f"reused {cached}/{prompt} prompt tokens ({100 * cached / max(prompt, 1):.0f}%)")
        if total("prefill_tokens") is not None and total("prefill_s") is not None:
            parts.append(f"prefill {total('prefill_tokens')} tok in {total('prefill_s'):.2f} s")
        if total("decode_tokens") is not None and total("decode_s"):
            parts.append(f"decode {total('decode_tokens') / total('decode_s'):.0f} tok/s")
        ttfts = [s.ttft_s for s in t if s.ttft_s is not None]
        if ttfts:
            parts.append(f"median first token {statistics.median(ttfts):.2f} s")
        return " · ".join(parts)

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _think(self, text: str) -> None:
        """Thinking, dimmed, under a `thinking:` header printed once per answer."""
        if not self._thinking:
            self._thinking = True
            self.write("\x1b[2mthinking: " if self.color else "thinking: ")
        self.write(f"\x1b[2m{text}\x1b[0m" if self.color else text)

    def _answer(self, text: str) -> None:
        if self._thinking:              # the answer starts on its own line after the thinking
            self._thinking = False
            self.write("\x1b[0m\n\n" if self.color else "\n\n")
        self.write(text)

    def say(self, text: str) -> None:
        self.write(text + "\n")

    def dim(self, text: str) -> None:
        self.say(f"\x1b[2m{text}\x1b[0m" if self.color else text)


def read_message(read: Callable[[str], str] = input) -> str:
    """One message from the user: lines ending with a backslash continue on the next."""
    lines = []
    prompt = PROMPT
    while True:
        line = read(prompt)
        if not line.endswith("\\"):
            lines.append(line)
            return "\n".join(lines)
        lines.append(line[:-1])
        prompt = CONTINUE


_DONE = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def pump(events: Iterator[str | TurnStats], write: Callable[[str], None],
         think: Callable[[str], None] | None = None) -> tuple[str, TurnStats | None, bool]:
    """Drive a backend stream on a worker thread, writing text as it comes, until it ends or Ctrl-C.
    Thinking pieces go to `think` (default: `write`) and are not part of the answer returned.
    Returns (answer text, stats or None, interrupted = no stats came). On Ctrl-C the worker closes the stream at its
    next event and this waits for it, so the backend is idle again when this returns."""
    q: queue.Queue = queue.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for ev in events:
                q.put(ev)
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            q.put(_Raised(e))
        finally:
            events.close()
            q.put(_DONE)

    worker = threading.Thread(target=work, name="ternlm-chat-answer", daemon=True)
    worker.start()
    text: list[str] = []
    stats = None
    interrupted = False      # once set, a worker error (e.g. from closing the stream) is expected
    while True:
        try:   # Ctrl-C may land anywhere in this loop, so the whole body is guarded
            try:
                ev = q.get(timeout=0.1)   # a timed wait so Ctrl-C is seen promptly
            except queue.Empty:
                if not worker.is_alive() and q.empty():
                    break                 # _DONE was taken just before a Ctrl-C
                continue
            if ev is _DONE:
                break
            if isinstance(ev, _Raised):
                if not interrupted:
                    worker.join()
                    raise ev.exc
            elif isinstance(ev, TurnStats):
                stats = ev
            elif isinstance(ev, Thinking):
                (think or write)(ev)
            else:                         # at most one more piece arrives after a Ctrl-C
                text.append(ev)
                write(ev)
        except KeyboardInterrupt:
            interrupted = True
            stop.set()                    # keep draining until the worker says it is done
    worker.join()
    return "".join(text), stats, stats is None   # a Ctrl-C after the last event interrupted nothing


# ---- command line -------------------------------------------------------------------------------

def add_chat_parser(sub, engine_args: Callable[[argparse.ArgumentParser], None],
                    load_engine: Callable[[argparse.Namespace], object]) -> argparse.ArgumentParser:
    """Register `ternlm chat` on the CLI's subparsers. engine_args/load_engine: the CLI's own (-m,
    --dtype, --no-prefix-kv, ... and the loader), so the chat loads models exactly like `serve`."""
    p = sub.add_parser("chat", help="terminal chat (in-process engine, or any OpenAI-compatible server)",
                       description="Chat in the terminal. With -m the engine runs in this process; with --url "
                                   "any OpenAI-compatible server answers (-m then names the served model). "
                                   + HELP)
    engine_args(p)
    default_model = p.get_default("model")
    p.set_defaults(model=None)            # so we can tell `-m X` from the default when --url is given
    p.add_argument("--url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", help="bearer key for --url (default: $OPENAI_API_KEY)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.set_defaults(func=lambda a: cmd_chat(a, load_engine, default_model))
    return p


def cmd_chat(args: argparse.Namespace, load_engine, default_model: str) -> int:
    # Ctrl-C is how a user stops an answer. A parent that started us with SIGINT ignored (a background
    # job of a shell without job control, some wrappers) would make it do nothing: Python installs its
    # KeyboardInterrupt handler only where SIGINT was left at its default.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not getattr(args, "verbose", False):   # a log line per turn (reuse, HTTP request) would clutter the chat
        for name in ("ternlm", "httpx2", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if args.url:
        backend: Backend = OpenAIBackend(args.url, args.api_key, model=args.model)
    else:
        args.model = args.model or default_model
        print(f"loading {args.model} ...", file=sys.stderr, flush=True)
        engine = load_engine(args)
        label = (f"{args.model} in-process ({args.dtype}, prefix reuse "
                 f"{'off' if args.no_prefix_kv else 'on'})")
        backend = EngineBackend(engine, label)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    chat = Chat(backend, max_tokens=args.max_tokens, temperature=args.temperature, system=args.system, color=color)
    return chat.run()


def main(argv: list[str] | None = None) -> int:
    """`python -m ternlm.cli.chat ARGS` == `ternlm chat ARGS` (same parser, same loader)."""
    from ..engine.args import engine_args, load_engine
    ap = argparse.ArgumentParser(prog="ternlm")
    ap.add_argument("-v", "--verbose", action="store_true")
    add_chat_parser(ap.add_subparsers(dest="cmd", required=True), engine_args, load_engine)
    args = ap.parse_args(["chat", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ternlm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
