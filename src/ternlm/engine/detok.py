"""Streaming text out of a token stream: ``IncrementalDetokenizer`` turns ids into text deltas that
never split a UTF-8 character, and ``StopMatcher`` cuts the text before the first stop string.

    detok, stop = IncrementalDetokenizer(tokenizer), StopMatcher(["\\n\\n"])
    for token_id in generated:
        emit, stopped = stop.feed(detok.push(token_id))
        ...                                   # send emit; end the stream when stopped
    emit, stopped = stop.feed(detok.flush())  # then stop.flush() if not stopped
"""
from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"  # what decode writes for bytes that are not (yet) a whole UTF-8 character


class IncrementalDetokenizer:
    """Text deltas for a growing list of token ids.

    Each push re-decodes a short window of ids twice, without and with the new tokens, and returns
    the difference (the scheme of HF's TextStreamer and vLLM). The window starts at tokens whose
    text was already sent, so decode-time rules that depend on neighbours (SentencePiece drops the
    first piece's leading space; byte tokens join into characters) see the same context as a full
    decode. Text ending in U+FFFD is held back: the next token may complete the character.

    Invariant: ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids,
    skip_special_tokens)``. Not thread-safe; one instance per generated sequence.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._byte_fallback = bool(getattr(tokenizer, "byte_fallback", False))
        self.ids: list[int] = []   # every id pushed so far
        self._start = 0            # window start: ids[_start:_sent] are context, already sent
        self._sent = 0             # ids before this index have had their text returned
        self._in_byte_run = False  # last (non-skipped) token was a <0xNN> byte token

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete).
        Side effect: grows the internal id list."""
        self.ids.append(int(token_id))
        if self._byte_fallback:
            # A run of <0xNN> tokens is decoded as a whole (an invalid run becomes one U+FFFD per
            # byte), so its text is only final once the run has ended. Skipped special tokens are
            # removed before decoding, so they do not end a run.
            if self._tokenizer.is_byte_token(token_id):
                self._in_byte_run = True
            elif not (self._skip and self._tokenizer.is_special(token_id)):
                self._in_byte_run = False
            if self._in_byte_run:
                return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (e.g. an incomplete character at the end, as U+FFFD).
        Side effect: marks everything as sent; later pushes continue from here."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._sent == len(self.ids):
            return ""
        decode = self._tokenizer.decode
        sent_text = decode(self.ids[self._start:self._sent], skip_special_tokens=self._skip)
        text = decode(self.ids[self._start:], skip_special_tokens=self._skip)
        if not final and (len(text) <= len(sent_text) or text.endswith(_REPLACEMENT)):
            # Nothing new yet (a skipped special token) or a character still incomplete: wait.
            return ""
        # Decoding is prefix-stable at character boundaries, so text starts with sent_text.
        delta = text[len(sent_text):]
        self._start, self._sent = self._sent, len(self.ids)
        return delta


class StopMatcher:
    """Cut streamed text right before the first occurrence of any stop string (OpenAI semantics:
    the stop string itself is not returned).

    ``feed`` holds back the longest tail of the text that could still grow into a stop string, so
    nothing after a stop is ever returned, even when the stop arrives split across many feeds.
    Not thread-safe; one instance per generated sequence.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]  # "" would match everywhere: ignored
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(text safe to emit, whether a stop string was found)``. After a
        stop every feed returns ("", True). Side effect: updates the held-back tail."""
        if self.stopped:
            return "", True
        buf = self._held + text
        keep = self._partial_stop_len(buf)
        hit = self._first_hit(buf)
        # A complete stop at `hit` ends the text there, unless a stop that began earlier may still
        # complete (stops "a" and "<a<", text "<a" then "<": the answer ends at 0, not 1): then wait.
        if hit is not None and len(buf) - keep >= hit:
            self.stopped, self._held = True, ""
            return buf[:hit], True
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of generation: cut before a stop it holds (one that was
        waiting for an earlier, longer stop that never completed), else all of it. Side effect:
        clears it; sets `stopped` when it held a stop."""
        held, self._held = self._held, ""
        if self.stopped:
            return ""
        hit = self._first_hit(held)
        if hit is not None:
            self.stopped = True
            return held[:hit]
        return held

    def _first_hit(self, buf: str) -> int | None:
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self, buf: str) -> int:
        # Longest k such that buf's last k characters are a proper prefix of some stop string.
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best
