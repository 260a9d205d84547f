"""A draft model: a small model of the same tokenizer proposes the next tokens by greedy decoding.

Why: prompt lookup (drafter.py) drafts only text the conversation already holds; a small model of the same
family (qwen2.5-coder-0.5b for the 1.5b) guesses fresh text too. Its guesses are verified exactly as prompt
lookup's are (sequence.py `_verify`: a drafted token is kept only if it is the token the target samples there),
so the answer cannot change; a draft model costs only time: per engine step, one small forward per draft position
for all the step's drafting requests together (draft_batch.py), not one per request.

The draft model is an Engine of its own, with its own slots, records and reuse: draft slot i serves the request
in target slot i, so a conversation's next turn reuses the draft model's KV as it reuses the target's. Its record
follows [RECORD-WHERE-FED]: drafting k tokens feeds the request's not-yet-seen tokens (one step; a long prompt's
first draft in chunks), then k - 1 drafted tokens one by one; `verified` cuts the draft slot back to what the
target kept, so the record vouches only for tokens that were fed and kept.

Tiers: with a cache (Engine.load), the draft model has tiers of its own (`share_cache`: the same disk directory
and Redis, its blocks told apart by its weights' namespace; the RAM tier split between the two models by KV bytes
a token). A draft slot is placed as a request's slot is (Engine.place: the slot's prefix, else RAM / disk / Redis
blocks), what it is about to lose is saved first, a finished request's slot is published, and shutdown persists
it: after a restart, or when a conversation comes back after its slot served others, the draft model reloads
its KV instead of prefilling the whole conversation again.

A failing draft model (an exception in its forward, its slot's context) never fails a request: `draft_many` resets
the draft slots it was feeding and re-raises, and the engine lets those requests go on without drafts (Engine.step).

Same tokenizer means the same token list and special ids (not the same name): ids are what the drafter hands
the target. A hybrid draft model is refused (its recurrent state cannot be cut back past rejected tokens); a hybrid
target is not: its verify steps rewind its own state ([VERIFY-REWIND]), the draft slot is cut back as always.

One policy choice: with a draft model every draft comes from it, never from prompt lookup first. Lookup is
cheaper per token, but where the answer repeats the prompt the draft model predicts the repeat too, and one
drafter per request keeps the pacing (drafter.DraftPace) and the draft slot's bookkeeping simple.
"""
from __future__ import annotations

import dataclasses

from .draft_batch import Lane, draft_together
from .drafter import DraftAsk, DraftPace
from ...invariants import check
from ...kv.slots import Slot
from ...kv.store import CacheConfig
from ..sequence import Restored

FIRST_DRAFT = 4          # a small model's draft costs a forward per token: start shorter than lookup's
MAX_DRAFT = 8
MISSES_BEFORE_PAUSE = 3
PAUSE = 8


def vocabulary_mismatch(target, draft) -> str | None:
    """Why two tokenizers do not give ids the same meaning (None: they do): size, each token's spelling,
    special tokens, BOS/EOS and stop ids. Pure; reads the whole vocabulary (~0.1 s for 150k tokens)."""
    if target.vocab_size != draft.vocab_size:
        return f"vocabulary sizes differ ({target.vocab_size} vs {draft.vocab_size})"
    for name in ("bos_id", "eos_id", "stop_ids"):
        a, b = getattr(target, name, None), getattr(draft, name, None)
        if a != b:
            return f"{name} differ ({a!r} vs {b!r})"
    if not (hasattr(target, "id_to_token") and hasattr(draft, "id_to_token")):
        return "a tokenizer cannot list its vocabulary"
    for i in range(target.vocab_size):
        a, b = target.id_to_token(i), draft.id_to_token(i)
        if a != b:
            return f"token {i} differs ({a!r} vs {b!r})"
        if getattr(target, "is_special", lambda _: False)(i) != getattr(draft, "is_special", lambda _: False)(i):
            return f"token {i} ({a!r}) is special in one tokenizer only"
    return None


def share_cache(cache: CacheConfig, target_cfg, draft_cfg) -> tuple[CacheConfig, CacheConfig]:
    """(the target's, the draft model's) tiers from one --cache configuration: the RAM tier split by KV elements
    a token (attention layers x KV heads x head size: both hold about as many tokens), the disk directory, its
    budget and Redis shared (blocks are keyed by namespace, which holds the weights' digest). Pure."""
    def elems(cfg) -> int:
        return len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim
    t, d = elems(target_cfg), elems(draft_cfg)
    draft_ram = cache.ram_bytes * d // (t + d)
    return (dataclasses.replace(cache, ram_bytes=cache.ram_bytes - draft_ram),
            dataclasses.replace(cache, ram_bytes=draft_ram))


class DraftModel:
    """The drafter factory for Engine(draft=...): one ModelDrafter per request, on the draft engine's slot
    paired with the request's target slot. `engine`: the draft model's Engine (speculative off, at least as
    many slots as the target; Engine.load(draft_model=...) builds one)."""

    def __init__(self, engine):
        self.engine = engine       # engine.core.Engine (not imported: core.py imports this module)
        self.vocab = engine.config.vocab_size

    def check(self, target) -> None:
        """Raises ValueError unless this draft model can draft for `target`: same tokenizer (vocabulary), no
        recurrent state in the draft model (a hybrid target is fine: its verify steps rewind, sequence.py
        [VERIFY-REWIND]; the draft slot is cut back as for any target), a draft slot for every target slot.
        Side effect: drafts stay below the smaller of the two models' vocabularies (embedding rows past the
        tokenizer's may differ)."""
        why = vocabulary_mismatch(target.tokenizer, self.engine.tokenizer)
        if why:
            raise ValueError(f"the draft model's tokenizer is not the target's: {why}")
        if self.engine.slots[0].state is not None:
            raise ValueError("a hybrid draft model cannot draft: its recurrent state cannot be cut back")
        if self.engine.num_slots < target.num_slots:
            raise ValueError(f"the draft model has {self.engine.num_slots} slots for the target's {target.num_slots}")
        self.vocab = min(self.vocab, target.config.vocab_size)   # a draft id must be a target id

    def __call__(self, slot: int, prompt: list[int], cache_salt: str) -> "ModelDrafter":
        return ModelDrafter(self, self.engine.slots[slot], prompt, self.engine.namespace(cache_salt))

    def draft_many(self, asks: list[DraftAsk]) -> list[list[int]]:
        """Each ask's greedy draft (asks' drafters: ModelDrafters of this factory, distinct slots), the draft
        model's steps batched over all of them (draft_batch.py: one forward per draft position). Side effects:
        feeds and records the draft slots; on an exception, resets every asking drafter's slot (empty record:
        nothing half-fed is ever reused) and re-raises."""
        lanes = [a.drafter.lane(a.limit) for a in asks]       # a paused drafter: a lane of k = 0, drafts []
        try:
            draft_together(self.engine.runner, [lane for lane in lanes if lane.k], self.vocab,
                           self.engine.tokenizer.stop_ids)
        except Exception:
            for a in asks:
                a.drafter.fail()
            raise
        return [lane.out for lane in lanes]

    def finished(self, slot: int) -> None:
        """The request in target slot `slot` ended: its draft slot's blocks go to a shared tier (Redis), as the
        target's do. Side effect: queues Redis writes."""
        store = self.engine.store
        if store is not None:
            store.publish(self.engine.slots[slot])

    def persist(self) -> int:
        """Shutdown (no request running): the draft slots and the draft RAM tier to disk. Returns blocks on
        disk."""
        return self.engine.persist_cache()


class ModelDrafter:
    """One request's drafter on one draft slot (drafter.Drafter's interface). Not thread-safe: the request's
    sequence is its only user, on the engine's thread. Invariant between calls, once a draft ran: the slot's
    record is a prefix of `tokens` plus at most the last draft's tokens (`verified` cuts those back)."""

    def __init__(self, factory: DraftModel, slot: Slot, tokens: list[int], namespace: bytes):
        self.factory = factory
        self.engine = factory.engine              # the draft model's engine.Engine
        self.slot = slot
        self.namespace = namespace
        self.tokens: list[int] = list(tokens)
        self.pace = DraftPace(FIRST_DRAFT, MAX_DRAFT, MISSES_BEFORE_PAUSE, PAUSE)
        self._placed = False                      # the slot's reuse decided (first draft)
        self.reused = 0                           # positions of the draft slot reused at the first draft
        self.restored = Restored()                # ... and where they came from (slot, RAM, disk, Redis)
        self._drafted_from = 0                    # len(tokens) when the last draft was made

    def extend(self, tokens: list[int]) -> None:
        """Append tokens the request produced (verified). Side effects: `tokens`, the pace. No model work."""
        self.tokens += tokens
        self.pace.advanced(len(tokens))

    def draft(self, limit: int) -> list[int]:
        """This request's draft alone: the factory's batched draft of one (`draft_many`). Side effects: its."""
        return self.factory.draft_many([DraftAsk(self, limit)])[0]

    def lane(self, limit: int) -> Lane:
        """This request's part of a batched draft (draft_batch.Lane): the tokens its slot has not seen and up to
        min(limit, the adaptive length) tokens to draft; k = 0 (nothing to do) when paused, limit < 1 or the
        draft model's context is full. Side effects: places the slot (`_sync`) when k > 0."""
        n = len(self.tokens)
        k = min(limit, self.pace.length, self.engine.ctx - n + 1)   # feeds n + k - 1 positions
        if k < 1 or self.pace.paused:
            return Lane(self.slot, [], 0)
        self._sync()
        self._drafted_from = n
        return Lane(self.slot, self.tokens[len(self.slot.record):], k)   # >= 1 id: _sync leaves one

    def verified(self, drafted: int, accepted: int) -> None:
        """How the last draft fared: the draft slot keeps the tokens it was fed that the target kept, the rest
        is cut from its record [RECORD-WHERE-FED]; the pace adapts. Side effects: both."""
        if drafted > 0:
            self.slot.truncate(min(len(self.slot.record), self._drafted_from + accepted))
        self.pace.verified(drafted, accepted)

    def fail(self) -> None:
        """A batched draft this drafter was part of raised: empty the slot's record (whatever was half-fed is
        never reused); the engine drops this drafter. Side effect: the slot."""
        self.slot.reset(self.namespace)
        self.reused = 0

    def _sync(self) -> None:
        """Make the slot's record a prefix of `tokens` that leaves at least one token to feed (fresh logits).
        The first time, place it like a request (Engine.place: namespace, min_reuse, the tiers; what the slot
        loses is saved to them first); later the invariant holds and
        only a record as long as `tokens` (no token arrived: cannot happen in a Sequence) is cut by one."""
        slot, rec = self.slot, self.slot.record
        if not self._placed:
            self._placed = True
            self.restored = self.engine.place(slot, self.tokens, self.namespace)
            self.reused = self.restored.tokens
            return
        keep = min(len(rec), len(self.tokens) - 1)
        if keep < len(rec):
            slot.truncate(keep)
        check(rec.fed == self.tokens[:len(rec)], "a draft slot's record is a prefix of the request's tokens")
