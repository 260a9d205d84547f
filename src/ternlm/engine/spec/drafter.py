"""Prompt lookup: draft the next tokens of a request by finding its last few tokens earlier in the conversation.

Why this works for chat: a coding assistant's answer repeats the code the user pasted or its own previous
answer, and a chat that rewrites a document repeats most of it. When the last n generated tokens (n from
MAX_NGRAM down to MIN_NGRAM) occurred before, the tokens that followed their most recent earlier occurrence are
a cheap guess of what comes next; the engine verifies the guess in one forward pass (sequence.py) and keeps
only what the model itself would have produced, so a draft can cost time but never change an answer.

Adaptive length: a draft that was taken whole doubles the next one (up to MAX_DRAFT); a rejection shrinks it
to one more than what was taken; after a few drafts in a row with nothing taken, drafting pauses (fresh text
has nothing to look up, and each rejected row is work), longer each time it keeps missing, and resumes with
one-token drafts.

[FORCED-DRAFT] A request under a grammar (json_schema, tools, regex) drafts first what the grammar forces next
(a key, `": "`, a closing brace: grammar.Constraint.forced), whether or not the conversation holds it; lookup
drafts where nothing is forced. A draft model's drafts do not take this path (its slot is fed its own guesses).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MAX_NGRAM = 4            # longest suffix looked up (longer: fewer, better drafts)
MIN_NGRAM = 2            # a single token repeats everywhere: too weak a guess
MAX_DRAFT = 16           # rows a verify step adds at most
FIRST_DRAFT = 8
MISSES_BEFORE_PAUSE = 3  # drafts in a row with nothing accepted before drafting pauses...
PAUSE = 8                # ...for this many tokens (doubling while drafts keep missing, up to MAX_PAUSE)
MAX_PAUSE = 128


class Drafter(Protocol):
    """What a Sequence asks of its drafter (sequence.py `draft_ask`, `_verify`); one per request. `draft` drafts
    for this request alone; a step drafts for all its requests at once through the factory's `draft_many`."""
    tokens: list[int]                  # the request's tokens the drafter has seen: prompt, then output

    def extend(self, tokens: list[int]) -> None: ...
    def draft(self, limit: int) -> list[int]: ...
    def verified(self, drafted: int, accepted: int) -> None: ...


@dataclass(frozen=True)
class DraftAsk:
    """One request's call for a draft after a step (Sequence.draft_ask): its drafter, already told the tokens the
    request produced, the most tokens the draft may hold (what the answer and the context leave room for), and
    the request's grammar state (grammar.Constraint, after the pending token; None without a grammar)."""
    drafter: Drafter
    limit: int                         # >= 1
    constraint: object | None = None


class DrafterFactory(Protocol):
    """Engine(draft=...): makes each speculating request's drafter and drafts for a step's requests together.
    `check(target)` raises ValueError when it cannot draft for that engine (Engine.__init__ calls it once);
    `__call__(slot, prompt, cache_salt)` is called by Engine.open with the request's slot index (a draft model
    pairs its own slot i with it); `draft_many(asks)` returns one draft per ask, in order (a draft model: one
    forward per draft position for all of them); `finished(slot)`: the request in that slot ended (a draft model
    publishes its slot to a shared tier); `persist()`: shutdown, what the factory keeps goes to disk (returns
    blocks on disk). If `draft_many` raises, the engine drops the asking requests' drafters (they go on without
    drafts); a factory that holds state for them cleans it up before raising."""
    def check(self, target) -> None: ...
    def __call__(self, slot: int, prompt: list[int], cache_salt: str) -> Drafter: ...
    def draft_many(self, asks: list[DraftAsk]) -> list[list[int]]: ...
    def finished(self, slot: int) -> None: ...
    def persist(self) -> int: ...


class PromptLookups:
    """The default factory: every request drafts by prompt lookup (no model work: one request after another)."""
    def check(self, target) -> None:
        pass

    def __call__(self, slot: int, prompt: list[int], cache_salt: str) -> "PromptLookup":
        return PromptLookup(prompt)

    def draft_many(self, asks: list[DraftAsk]) -> list[list[int]]:
        """Each ask's draft: [FORCED-DRAFT] what its grammar forces next where it forces something, else its lookup
        draft (PromptLookup.draft). Reads the grammar state without advancing it."""
        return [(a.constraint.forced(a.limit) if a.constraint is not None else []) or a.drafter.draft(a.limit)
                for a in asks]

    def finished(self, slot: int) -> None:
        pass

    def persist(self) -> int:
        return 0


class DraftPace:
    """How long the next draft may be (the adaptive length and back-off above, for any drafter): `length`,
    `paused` (tokens left before drafting resumes). Side effects only through its methods."""

    def __init__(self, first: int = FIRST_DRAFT, most: int = MAX_DRAFT,
                 misses_before_pause: int = MISSES_BEFORE_PAUSE, pause: int = PAUSE):
        self.first, self.most, self.misses_before_pause, self.pause = first, most, misses_before_pause, pause
        self.length = first
        self.paused = 0
        self._misses = 0
        self._next_pause = pause

    def advanced(self, tokens: int) -> None:
        """The request moved on by `tokens`: a pause runs down."""
        self.paused = max(0, self.paused - tokens)

    def verified(self, drafted: int, accepted: int) -> None:
        """How a draft fared: taken whole doubles the next length, a rejection shrinks it to one more than
        what was taken, MISSES_BEFORE_PAUSE drafts in a row with nothing taken pause drafting."""
        if drafted <= 0:
            return
        if accepted == drafted:
            self.length = min(self.most, 2 * self.length)
        else:
            self.length = max(1, accepted + 1)
        if accepted:
            self._misses, self._next_pause = 0, self.pause
            return
        self._misses += 1
        if self._misses >= self.misses_before_pause:
            # text with nothing to look up (fresh prose) must cost ~nothing: each pause that follows another
            # with no draft taken in between is twice as long (up to MAX_PAUSE), and drafting resumes with
            # one token, growing only as drafts are taken whole
            self.paused, self._misses, self.length = self._next_pause, 0, 1
            self._next_pause = min(MAX_PAUSE, 2 * self._next_pause)


class PromptLookup:
    """One request's drafter over its tokens (prompt, then what it generated). Not thread-safe: the request's
    sequence is its only user. Memory: one dict entry per (n, position), n in MIN_NGRAM..MAX_NGRAM."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        # n-gram -> where the token after its most recent occurrence (excluding the current suffix) stands
        self._next: dict[tuple[int, ...], int] = {}
        self.pace = DraftPace()
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the prompt, or tokens the request produced). Side effects: the index."""
        for t in tokens:
            end = len(self.tokens)           # n-grams ending just before t now have a continuation: t
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._next[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(t)
        self.pace.advanced(len(tokens))

    def draft(self, limit: int) -> list[int]:
        """Up to min(limit, the adaptive length) tokens that followed the latest earlier occurrence of the
        longest suffix found; [] when nothing matches, drafting is paused or limit < 1. Pure."""
        k = min(limit, self.pace.length)
        if k < 1 or self.pace.paused:
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
        """How a draft fared: adapts the next length and pauses after repeated misses (DraftPace)."""
        self.pace.verified(drafted, accepted)
