"""Reasoning models: the thinking apart from the answer (`<think>…</think>answer`).

What the server returns (the shapes vLLM and DeepSeek's API use): `message.reasoning_content` holds
the thinking, `message.content` the answer; streamed, `delta.reasoning_content` chunks come before the
answer's `delta.content`, and the chunks concatenate to the non-streamed fields exactly.

When a choice thinks:
  - its text opens with `<think>` (Qwen3, whose template leaves the model to open it), or
  - the prompt already ends inside an open `<think>` (DeepSeek-R1 distills' generation prompt opens
    it: the model's text starts with the thinking itself);
and the thinking ends at the first `</think>`. A choice that ends before `</think>` (max_tokens) is
all thinking. The newlines just inside the tags are not part of the thinking, and whitespace right
after `</think>` is not part of the answer: templates put them there, and a template that renders
`reasoning_content` back (`<think>\n{{ reasoning }}\n</think>`, Qwen3 strips it the same way) then
reproduces the generated tokens, so the next turn reuses the KV of the thinking too. Everything else — a template with no `<think>`, `--reasoning-format none` — is content as is.

Pure text processing: no engine, no HTTP. `Split` is the whole answer, `Splitter` the streaming form.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("auto", "none")


def template_thinks(template: str | None) -> bool:
    """Whether a chat template knows thinking blocks (auto mode looks for them only then)."""
    return bool(template) and CLOSE in template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open `<think>` (its last OPEN comes after its last CLOSE)."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and prompt_text.rfind(CLOSE) < at and not prompt_text[at + len(OPEN):].strip()


@dataclass(frozen=True)
class Split:
    reasoning: str | None        # None: the choice did not think (no field is sent)
    content: str


def split(text: str, started: bool) -> Split:
    """A whole answer -> thinking and content. `started`: the prompt opened `<think>` already."""
    s = Splitter(started)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return Split(r1 + r2 if s.thought else None, c1 + c2)


class Splitter:
    """The streaming form of `split`: feed text deltas, get (reasoning, content) parts safe to send.
    Holds back only what could still be the start of a tag (or the whitespace after `</think>`)."""

    def __init__(self, started: bool):
        self._buf = ""
        self._state = "think" if started else "start"     # start -> think -> gap -> answer
        self.thought = started                             # a thinking block exists (send the field)
        self._lead = True                                  # in think: newlines after <think> still dropped

    @property
    def thinking(self) -> bool:
        """Text fed now is (or may still be) thinking: before the answer's first character or inside."""
        return self._state in ("start", "think")

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state == "start":                     # before the first non-blank character
                body = self._buf.lstrip()
                if not body:
                    return reasoning, content
                if body.startswith(OPEN):
                    self._buf, self._state, self.thought = body[len(OPEN):], "think", True
                    continue
                if OPEN.startswith(body):                  # "<thi": could still open a block
                    return reasoning, content
                self._state = "answer"                     # no thinking: everything is content as is
                continue
            if self._state == "think":
                if self._lead:
                    self._buf = self._buf.lstrip("\n")
                    if not self._buf:
                        return reasoning, content
                    self._lead = False
                at = self._buf.find(CLOSE)
                if at >= 0:
                    reasoning += self._buf[:at].rstrip("\n")
                    self._buf, self._state = self._buf[at + len(CLOSE):], "gap"
                    continue
                keep = _partial_suffix(self._buf, CLOSE)        # "…\n\n</th": all of it may end the thinking
                head = self._buf[:len(self._buf) - keep]
                keep += len(head) - len(head.rstrip("\n"))
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return reasoning, content
            if self._state == "gap":                       # whitespace after </think> is dropped
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "answer"
                continue
            content += self._buf
            self._buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, now that the choice ended."""
        buf, self._buf = self._buf, ""
        if self._state == "think":
            return buf, ""
        if self._state == "start":
            return "", buf
        return "", buf if self._state == "answer" else ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
