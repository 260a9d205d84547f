"""PrefixRecord and the reuse decision. Pure Python: no torch, no model, no slots.

Why a record and not a counter: whether the last sampled token was fed back, whether a chunked
prefill finished, whether generation stopped early all differ per code path. Deriving "what the KV
holds" from `prompt_len + generated - 1` gets one of them wrong and then answers from another
conversation's state. So the runner appends to the record at the one place it writes KV, right
after the write succeeds, and the reuse decision reads only the record.

Invariant: fed[0:len] are exactly the token ids the KV at positions [0, len) was built from.
Positions fed from something their id does not describe (caller-supplied embeddings) carry a
payload digest in `digests`; an input that could not be digested taints the record from there on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from ..invariants import check

_BLOCK = 256  # lcp compares list slices this long at C speed before scanning one element at a time


@dataclass
class PrefixRecord:
    namespace: bytes = b""               # model sha256 + dtype + tenant: what else the KV depends on
    fed: list[int] = field(default_factory=list)       # token ids of KV positions [0, len)
    digests: dict[int, bytes] = field(default_factory=dict)  # position -> payload digest (embeds)
    tainted_from: int | None = None      # first position whose input neither id nor digest describes

    def __len__(self) -> int:
        return len(self.fed)

    def append(self, ids: list[int], digests: dict[int, bytes] | None = None,
               taint_at: int | None = None) -> None:
        """Record that KV positions [len, len + len(ids)) now hold `ids`. Call right after the write.
        `digests`/`taint_at` use absolute positions inside the appended range."""
        start = len(self.fed)
        end = start + len(ids)
        # checked before anything changes: a failed check leaves the record as it was
        check(all(start <= pos < end for pos in digests or ()), "digest position outside the appended range")
        self.fed.extend(ids)
        if digests:
            self.digests.update(digests)
        if taint_at is not None and self.tainted_from is None:
            self.tainted_from = taint_at

    def truncate(self, k: int) -> None:
        """Keep positions [0, k). The KV beyond k is garbage from now on (attention KV of positions
        < k does not depend on later tokens, so truncation is valid)."""
        if k >= len(self.fed):
            return
        del self.fed[k:]
        self.digests = {p: d for p, d in self.digests.items() if p < k}
        if self.tainted_from is not None and self.tainted_from >= k:
            self.tainted_from = None

    def clear(self, namespace: bytes | None = None) -> None:
        """Forget everything (the KV was reallocated or its contents are unknown)."""
        self.fed = []
        self.digests = {}
        self.tainted_from = None
        if namespace is not None:
            self.namespace = namespace


def lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. O(k), block-wise slice compares for speed."""
    n = min(len(a), len(b))
    i = 0
    while i + _BLOCK <= n and a[i:i + _BLOCK] == b[i:i + _BLOCK]:
        i += _BLOCK
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class Reuse:
    """How many leading positions of the KV a request may keep, and why not more."""
    tokens: int
    why: str             # one log-ready phrase: "reuse", "diverged at token 812 of record 2034", ...
    common: int = 0      # lcp of record and prompt before the safety caps (for reporting)
    diverged: str | None = None   # the "diverged at token k of record r" phrase inside `why`, if any
    diverged_at: int | None = None
    # token offset where each chat message ends; called only when `reason` is read (it renders the
    # template several times), so deciding reuse on the engine's thread never pays for it
    message_ends: Callable[[], list[int]] | None = field(default=None, compare=False, repr=False)
    message_roles: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    @cached_property
    def reason(self) -> str:
        """`why`, with the chat message a divergence fell in named: "... of record 2034 (message 3)".
        Computed on first read, on the reader's thread."""
        if self.diverged is None or self.message_ends is None:
            return self.why
        ends = self.message_ends()
        if not ends:
            return self.why
        msg = next((i for i, end in enumerate(ends) if self.diverged_at < end), len(ends))
        roles = self.message_roles or ()
        # the usual cause inside an earlier answer: its template re-renders it (reasoning models drop
        # the thinking from history; others trim whitespace) or the client edited it
        why = (": the template re-rendered the assistant turn (or the client edited it)"
               if msg < len(roles) and roles[msg] == "assistant" else "")
        return self.why.replace(self.diverged, f"{self.diverged} (message {msg}){why}", 1)


def first_digest_mismatch(record: PrefixRecord, prompt_digests: dict[int, bytes], upto: int) -> int | None:
    """First position < upto where the record's payload digest and the prompt's differ (either side
    may have none: a plain token where the other had an embedding is a mismatch too)."""
    positions = [p for p in record.digests if p < upto] + [p for p in prompt_digests if p < upto]
    for p in sorted(set(positions)):
        if record.digests.get(p) != prompt_digests.get(p):
            return p
    return None


def decide_reuse(record: PrefixRecord, prompt: list[int], namespace: bytes, *,
                 prompt_digests: dict[int, bytes] | None = None, min_reuse: int = 16,
                 enabled: bool = True,
                 message_ends: list[int] | Callable[[], list[int]] | None = None,
                 message_roles: tuple[str, ...] | None = None) -> Reuse:
    """Decide how many positions of `record` the prompt may reuse. Does not modify the record.

    [0, k) reused | [k, n) prefilled | [n, n + generated) decoded.
    `message_ends`: token offset where each chat message ends (or a function computing them, called
    only if `reason` is read), to name the message a divergence fell in; `message_roles`: their roles.
    """
    if not enabled:
        return Reuse(0, "reuse disabled")
    if not record.fed:
        return Reuse(0, "empty record")
    if record.namespace != namespace:
        return Reuse(0, "namespace differs")
    n = len(prompt)
    common = k = lcp(record.fed, prompt)
    reason, diverged = "reuse", None
    if k < len(record.fed) and k < n:
        diverged = reason = f"diverged at token {k} of record {len(record.fed)}"
    ends = (lambda: message_ends) if isinstance(message_ends, list) else message_ends
    bad = first_digest_mismatch(record, prompt_digests or {}, k)
    if bad is not None:
        k, reason = bad, f"embedding payload differs at {bad}"
    if record.tainted_from is not None and record.tainted_from < k:
        k, reason = record.tainted_from, f"tainted at {record.tainted_from}"
    if diverged is not None and diverged not in reason:
        diverged = None
    k = min(k, n - 1)  # [FRESH-LOGITS] always feed >= 1 token: never sample from the previous request's logits
    if k < min_reuse:
        why = f"below min_reuse ({max(k, 0)} < {min_reuse})"
        return Reuse(0, why if reason == "reuse" else f"{why}; {reason}", common, diverged, common, ends,
                     message_roles)
    return Reuse(k, reason, common, diverged, common, ends, message_roles)
