"""Prompt lookup: draft the next tokens of a request by finding its last few tokens earlier in the conversation.

Why this works for chat: a coding assistant's answer repeats the code the user pasted or its own previous
answer, and a chat that rewrites a document repeats most of it. When the last n generated tokens (n from
MAX_NGRAM down to MIN_NGRAM) occurred before, the tokens that followed their most recent earlier occurrence are
a cheap guess of what comes next; the engine verifies the guess in one forward pass (sequence.py) and keeps
only what the model itself would have produced, so a draft can cost time but never change an answer.

Adaptive length: a draft that was taken whole doubles the next one (up to MAX_DRAFT); a rejection shrinks it
to one more than what was taken; after a few drafts in a row with nothing taken, drafting pauses (fresh text
has nothing to look up, and each rejected row is work).
"""
from __future__ import annotations

MAX_NGRAM = 4            # longest suffix looked up (longer: fewer, better drafts)
MIN_NGRAM = 2            # a single token repeats everywhere: too weak a guess
MAX_DRAFT = 16           # rows a verify step adds at most
FIRST_DRAFT = 8
MISSES_BEFORE_PAUSE = 3  # drafts in a row with nothing accepted before drafting pauses...
PAUSE = 8                # ...for this many tokens


class PromptLookup:
    """One request's drafter over its tokens (prompt, then what it generated). Not thread-safe: the request's
    sequence is its only user. Memory: one dict entry per (n, position), n in MIN_NGRAM..MAX_NGRAM."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        # n-gram -> where the token after its most recent occurrence (excluding the current suffix) stands
        self._next: dict[tuple[int, ...], int] = {}
        self.length = FIRST_DRAFT
        self._misses = 0
        self._paused = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the prompt, or tokens the request produced). Side effects: the index."""
        for t in tokens:
            end = len(self.tokens)           # n-grams ending just before t now have a continuation: t
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(t)
            self._paused = max(0, self._paused - 1)

    def draft(self, limit: int) -> list[int]:
        """Up to min(limit, the adaptive length) tokens that followed the latest earlier occurrence of the
        longest suffix found; [] when nothing matches, drafting is paused or limit < 1. Pure."""
        k = min(limit, self.length)
        if k < 1 or self._paused:
            return []
        toks = self.tokens
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(toks) < n:
                continue
            at = self._next.get(tuple(toks[-n:]))
            if at is not None:
                return toks[at:at + k]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """How a draft fared: adapts the next length and pauses after repeated misses. Side effects."""
        if drafted <= 0:
            return
        if accepted == drafted:
            self.length = min(MAX_DRAFT, 2 * self.length)
        else:
            self.length = max(1, accepted + 1)
        self._misses = 0 if accepted else self._misses + 1
        if self._misses >= MISSES_BEFORE_PAUSE:
            self._paused, self._misses, self.length = PAUSE, 0, FIRST_DRAFT
