"""One request between steps: what it still has to feed, and what it does with the logits it gets.

A `Sequence` owns everything per request that is not KV: the ids waiting to be fed (the prompt's
tail, then each sampled token), the sampler, the incremental detokenizer and stop matcher, the
output ids and text, and the timings. It never touches the model or the slot's KV: the engine's
step feeds `take(count)` rows of many sequences in one forward pass and hands each one its logits
through `accept`. That split is what lets a single request (Engine.stream) and a batch of eight
(the server's scheduler) run the same code.

    [0, k) reused | [k, n) prefilled (pending, chunk by chunk) | [n, n + generated) decoded

Speculative decoding (lossless): while decoding, `pending` may hold the last sampled token and a draft after it
(drafter.py). The step feeds them all and returns every row's logits; `accept` samples row by row exactly as
plain decoding would (the same bias, grammar mask and per-position draw, sampling.py) and keeps a drafted token
only while it equals the token sampled before it. The first row that differs ends the step: its sampled token is
the next pending one, and the rows after it, fed drafts the model did not produce, leave the slot in one
operation (Slot.reject) before anything can store or reuse them: cut from its record, or, as a hybrid model's
slot cannot cut its recurrent state back past rows it took, back to the state held before the step
(Slot.hold_for_verify) [VERIFY-REWIND], and the step's rows that stand are fed again at the head of the next step (`refeed`), which gives them the same
bits (the scan's per-token steps do not depend on how rows are grouped, [RESUME-EXACT]). A verify row has exactly
the bits of a one-row decode step (batch-invariant kernels, [CHUNKS-EXACT]), so the answer is the same, token for
token, on or off.

Drafting happens between steps, for all of a step's sequences at once (Engine.step: `draft_ask` from each, the
factory's `draft_many` for all, `add_draft` to each), so a draft model runs one forward per draft position for the
whole batch. A drafter that fails is dropped (`stop_drafting`): the request goes on plain.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .detok import IncrementalDetokenizer, StopMatcher
from ..text.grammar import Constraint
from ..invariants import check
from ..kv.record import Reuse
from ..kv.slots import Slot
from .spec.drafter import DraftAsk, Drafter
from .runner import Embed
from .sampling import Sampler


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0          # request start -> first sampled token
    drafted: int = 0             # speculative decoding: drafted tokens verified
    accepted: int = 0            # ... and those the model produced itself (kept)
    draft_failed: bool = False   # its drafter failed mid-request: it went on without drafts


@dataclass(frozen=True)
class Restored:
    """Where a request's reused prefix [0, tokens) came from: first the slot's own KV, then blocks
    loaded from the tiers below it (RAM, then disk, then Redis), then positions copied from a sibling
    choice's live slot (n > 1: one prompt prefilled once), in position order."""
    slot: int = 0
    ram: int = 0
    disk: int = 0
    load_s: float = 0.0          # reading + verifying + copying tier blocks
    sibling: int = 0             # copied from the slot of choice 0 of the same request
    redis: int = 0               # loaded from the shared Redis tier (another replica may have written it)

    @property
    def tokens(self) -> int:
        return self.slot + self.ram + self.disk + self.redis + self.sibling

    @property
    def tier(self) -> str:
        """The slowest tier that contributed: "redis" | "disk" | "ram" | "slot" (own or sibling's) | "none"."""
        return "redis" if self.redis else "disk" if self.disk else "ram" if self.ram else \
            "slot" if self.slot or self.sibling else "none"


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str           # "stop" (EOS, end-of-turn token, stop string) | "length"
    prompt_tokens: int
    cached_tokens: int           # positions reused from the KV: [0, cached_tokens)
    reuse: Reuse
    timings: Timings = field(default_factory=Timings)
    slot: int = 0
    logits: torch.Tensor | None = None   # (generated, vocab) fp32, only with keep_logits=True
    restored: Restored = Restored()      # where [0, cached_tokens) came from


@dataclass(frozen=True)
class Delta:
    """One step of a stream: newly completed text (may be empty while UTF-8 or a stop string is pending).
    token_id is -1 for the final flush of held-back text. logprob/top_logprobs (of the model's raw
    distribution, before sampling filters) only when the stream was asked for logprobs."""
    text: str
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class Limits:
    """How a request stops besides stop strings: max_tokens, the context, the stop token ids."""
    max_tokens: int
    ctx: int
    stop_ids: frozenset[int]


class Sequence:
    """Per-request state. Not thread-safe; the engine's caller (one worker) is its only user."""

    def __init__(self, *, slot: Slot, prompt: list[int], reused: int, reuse: Reuse, restored: Restored,
                 sampler: Sampler, tokenizer, stop: list[str], limits: Limits,
                 embeds: dict[int, Embed], on_chunk: Callable[[int], None] | None,
                 keep_logits: bool, logprobs: int | None, started: float,
                 constraint: Constraint | None = None, drafter: Drafter | None = None):
        self.slot = slot
        self.prompt = prompt
        self.n = len(prompt)
        self.reused = reused
        self.reuse = reuse
        self.restored = restored
        self.pending: list[int] = prompt[reused:]   # ids to feed next, at positions len(record)...
        self.embeds = embeds
        self.on_chunk = on_chunk                     # after each recorded prefill chunk (hooks, faults)
        self.sampler = sampler
        self.limits = limits
        self.keep_logits = keep_logits
        self.logprobs = logprobs
        self.constraint = constraint                 # grammar.py: masks this request's row only
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stopper = StopMatcher(list(stop))
        self.out_ids: list[int] = []
        self.kept: list[torch.Tensor] = []
        self.text: list[str] = []
        self.finish = "length"
        self.done = False
        self.timings = Timings(prefill_tokens=self.n - reused)
        self.started = started
        self._first_step: float | None = None
        self._decode_from: float | None = None       # when the prefill's last chunk returned
        self.drafter = drafter        # drafter.py / draft_model.py: drafts after each sampled token; None: plain
        self.refeed = 0               # [VERIFY-REWIND] pending's first rows: a rewound verify step's rows that stand

    @property
    def prefilling(self) -> bool:
        return self._decode_from is None

    def take(self, count: int) -> tuple[list[int], str]:
        """The next `count` pending ids (1 <= count <= len(pending)) and the logits the step must return
        for them (models.llama.Segment): "none" for a prefill chunk before the last, "last" for the
        prompt's last chunk or a decode token, "all" for a decode token with its draft (every row is
        verified). A decode step feeds all its pending ids. Does not change the sequence: `accept` does,
        once the step returned."""
        check(not self.done and 1 <= count <= len(self.pending),
              f"take({count}) of a sequence with {len(self.pending)} pending ids (done={self.done})")
        check(self.prefilling or count == len(self.pending), "a decode step feeds its token and its whole draft")
        if self._first_step is None:
            self._first_step = time.perf_counter()
        if count < len(self.pending):
            return self.pending[:count], "none"
        return self.pending[:count], "all" if count > 1 and not self.prefilling else "last"

    def accept(self, count: int, logits: torch.Tensor | None) -> list[Delta | Completion]:
        """The step fed `count` pending ids (already recorded in the slot). logits: fp32, the rows `take`
        asked for ((1, vocab) for "last", (count, vocab) for "all"), None for "none". Returns the events for
        the caller: Deltas, and when the request is over, a final flush Delta (if text was held back) and
        the Completion. Side effects: samples, runs on_chunk while prefilling (it may raise); after a
        verify step cuts the rejected draft rows from the slot's record. Drafts nothing: see `draft_ask`."""
        fed = self.pending[:count]
        del self.pending[:count]
        if not self.prefilling and count > 1:
            events = self._verify(fed, logits)
        else:
            events = self._step(count, logits)
        return events

    def draft_ask(self) -> DraftAsk | None:
        """After `accept`: what this sequence asks its drafter for (a draft after the pending token, no longer
        than the answer and the context leave room for), or None (plain, done, prefilling, no room). Side
        effect: tells the drafter the tokens produced since it last heard (Drafter.extend)."""
        if self.done or self.prefilling or self.drafter is None:
            return None
        self.drafter.extend(self.out_ids[len(self.drafter.tokens) - self.n:])
        room = min(self.limits.max_tokens - len(self.out_ids) - 1,
                   self.limits.ctx - len(self.slot.record) - len(self.pending))     # after the pending rows
        return DraftAsk(self.drafter, room, self.constraint) if room >= 1 else None

    def add_draft(self, draft: list[int]) -> None:
        """Append the drafter's answer to `draft_ask` after the pending token: the next step feeds and verifies
        it (`_verify`). Side effect: pending."""
        check(len(self.pending) == self.refeed + 1 and not self.done,
              "a draft follows exactly one pending token (after the rows fed again)")
        self.pending += draft

    def stop_drafting(self) -> None:
        """The drafter failed (Engine.step): drop it, go on plain decoding, and say so in the timings."""
        self.drafter = None
        self.timings.draft_failed = True

    def _step(self, count: int, logits: torch.Tensor | None) -> list[Delta | Completion]:
        """A prefill chunk or a one-token decode step."""
        if self.prefilling:
            if self.pending:                            # a prefill chunk, not the last
                if self.on_chunk is not None:
                    self.on_chunk(len(self.slot.record))
                return []
            now = time.perf_counter()
            self.timings.prefill_s = now - (self._first_step or now)
            self._decode_from = now
            if self.on_chunk is not None:
                self.on_chunk(len(self.slot.record))
        else:
            self.timings.decode_tokens += 1
        check(logits is not None, "the step that ended the pending ids returned no logits")
        return self._sample(logits[-1])

    def _verify(self, fed: list[int], logits: torch.Tensor) -> list[Delta | Completion]:
        """A decode step that fed [*refed, token, *draft] (refed: a rewound step's rows that stand, fed again;
        their logits were sampled then): logits (len(fed), vocab). Row r after them is sampled as plain decoding
        would at that point; the draft's next token is kept only if it is that sample. Rejected rows go in one
        slot operation (Slot.reject): cut from the record, or a hybrid slot goes back to the step's start and
        the rows that stand are fed again next step [VERIFY-REWIND]. Side effects: samples; the slot's record (and state); pending, refeed."""
        j = self.refeed
        draft = fed[j + 1:]
        k = len(draft)
        check(logits is not None and logits.shape[0] == len(fed), "a verify step returns every row's logits")
        events: list[Delta | Completion] = []
        taken = 0
        for r in range(k + 1):
            events += self._sample(logits[j + r], unverified=k - r)
            if self.done or r == k or self.pending[0] != draft[r]:
                break
            taken += 1
        rejected = k - taken          # rows after the last one that stands (a mismatch, a stop, the limit)
        self.refeed = 0
        if rejected:                  # [RECORD-WHERE-FED] the record no longer vouches for them [VERIFY-REWIND]
            again = self.slot.reject(rejected)
            if again and not self.done:   # (done: the record ends at the step's start; the answer is complete)
                self.pending = fed[:again] + self.pending
                self.refeed = again
        self.timings.decode_tokens += 1 + taken
        self.timings.drafted += k
        self.timings.accepted += taken
        if self.drafter is not None:  # (a rewound step's rows may be fed again after the drafter failed)
            self.drafter.verified(k, taken)
        return events

    def _sample(self, logits: torch.Tensor, unverified: int = 0) -> list[Delta | Completion]:
        """Sample the next token from one row's logits (vocab,); `unverified`: rows fed after this one in
        the same step (drafts not yet judged), which the record holds but the answer does not."""
        index = len(self.out_ids)                       # the token's draw (sampling.draw_seed)
        # bias, penalties (the tokens before this position), grammar mask, then the draw; `logits` (kept,
        # logprobs) stays the model's raw distribution
        tok = self.sampler.sample(logits, index, self.constraint.mask if self.constraint is not None else None)
        self.sampler.push(tok)
        if self.constraint is not None:
            self.constraint.advance(tok)
        if self.keep_logits:
            self.kept.append(logits)
        if not self.out_ids and not self.timings.ttft_s:
            self.timings.ttft_s = time.perf_counter() - self.started
        if tok in self.limits.stop_ids:
            self.finish = "stop"
            return self._finish(by_string=False)
        self.out_ids.append(tok)
        emit, stopped = self.stopper.feed(self.detok.push(tok))
        self.text.append(emit)
        if self.logprobs is None:
            events: list[Delta | Completion] = [Delta(emit, tok)]
        else:
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, self.logprobs) if self.logprobs > 0 else None
            events = [Delta(emit, tok, float(lp[tok]),
                            list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])]
        if stopped:
            self.finish = "stop"
            return events + self._finish(by_string=True)
        if len(self.out_ids) >= self.limits.max_tokens or len(self.slot.record) - unverified >= self.limits.ctx:
            return events + self._finish(by_string=False)
        self.pending = [tok]                            # fed back next step
        return events

    def _finish(self, by_string: bool) -> list[Delta | Completion]:
        self.done = True
        self.close()
        events: list[Delta | Completion] = []
        if not by_string:
            tail, stopped = self.stopper.feed(self.detok.flush())
            if not stopped:
                tail += self.stopper.flush()
            if self.stopper.stopped:          # the last text held a stop string (detok.StopMatcher.flush)
                self.finish = "stop"
            if tail:
                self.text.append(tail)
                events.append(Delta(tail, -1))
        events.append(Completion("".join(self.text), self.out_ids, self.finish, self.n, self.reused, self.reuse,
                                 self.timings, self.slot.index,
                                 torch.stack(self.kept) if self.keep_logits else None, self.restored))
        return events

    def close(self) -> None:
        """The request ends (finished, failed or cancelled): stop the clock, mark the slot used.
        Idempotent. The slot's record already describes exactly what was written."""
        if self._decode_from is not None and not self.timings.decode_s:
            self.timings.decode_s = time.perf_counter() - self._decode_from
        self.pending = []
        self.done = True
        self.slot.touch()
