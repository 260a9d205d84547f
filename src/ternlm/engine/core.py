"""Engine: the Python API. Load a model, render chats, generate with prefix KV reuse.

    engine = Engine.load("smollm2-135m", dtype="float32")
    ids = engine.apply_chat_template(messages, add_generation_prompt=True)
    out = engine.generate(ids, max_tokens=64, temperature=0.0)   # Completion

The engine keeps its slots (KV sequences) between calls, so turn after turn of a conversation
prefills only the new tail. It is not thread-safe: the server's scheduler serialises access.

A request's life, in three parts that each do one thing:
  open    validate, decide reuse (kv/record), plan placement (kv/placement, pure) and act on the plan
          -> a Sequence (sequence.py: sampler, detokenizer, stop matcher, timings, output ids)
  step    one forward pass over rows of many sequences (runner.step), then each sequence samples
  stream  open + step until done: a single request is a batch of one, on the same path as the
          server's scheduler, which steps many sequences at once (continuous batching)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..cpu import CpuInfo, choose_dtype, kernel_fingerprint, probe
from .spec.drafter import DrafterFactory, PromptLookups
from ..text.grammar import GrammarCompiler, GrammarSpec
from ..invariants import check
from ..kernels.build import Kernels
from ..kernels.build import load as load_kernels
from ..kv.blocks import BLOCK_TOKENS
from ..kv.placement import Fetched, plan_placement, plan_tiers, settle_tiers
from ..kv.record import Reuse, decide_reuse
from ..kv.recurrent import recurrent_shape
from ..kv.slots import KVShape, Slot
from ..text.message_marks import message_marks
from ..kv.store import CacheConfig, StoreIdentity, TieredStore
from ..models.llama import ATTN_BLOCK, Transformer
from ..models.loaded import LoadedModel
from ..models.moe import CHUNK_RESIDENT
from .runner import Embed, Feed, Runner, digest_tensor
from .sampling import Penalties, Sampler, SamplingParams
from .sequence import Completion, Delta, Limits, Restored, Sequence, Timings
from .step_plan import Want, plan_step
from .weights import WEIGHTS, WeightsChoice, choose_weights, gguf_parameters

__all__ = ["Engine", "ChatIds", "Completion", "Delta", "Restored", "Sequence", "Timings", "SlotInfo",
           "StepOutcome", "reuse_line"]

log = logging.getLogger("ternlm")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class ChatIds(list):
    """Token ids rendered from chat messages; remembers the messages so a divergence can be located
    in a message ("diverged at token 812 (message 3)"). Behaves exactly like list[int]."""
    messages: list[dict]
    message_ends: Callable[[], list[int]]


@dataclass(frozen=True)
class SlotInfo:
    """A slot as the scheduler and /slots see it (no tensors, no ids)."""
    index: int
    tokens: int                  # positions its KV holds (len of its record)
    last_used: float             # time.monotonic() of its last use; 0.0 = never
    namespace: bytes


@dataclass(frozen=True)
class StepOutcome:
    """One sequence's result of a step: the events it produced, or the error that ended it (its
    record is exact either way: it describes every write that completed)."""
    events: list[Delta | Completion]
    error: BaseException | None = None


class Engine:
    def __init__(self, loaded: LoadedModel, *, dtype: torch.dtype | str = "auto", prefix_reuse: bool = True,
                 min_reuse: int = 16, slots: int = 1, ctx: int | None = None, chunk_size: int | None = None,
                 cache: CacheConfig | None = None, cpu: CpuInfo | None = None,
                 weights: WeightsChoice | None = None, kv_dtype: str = "auto", chat_template: str | None = None,
                 state_interval: int = 64, speculative: bool = True, draft: DrafterFactory | None = None):
        """dtype: "auto" (cpu.py picks from the CPU), a name, or a torch dtype. `cpu`: the CPU to plan
        kernels for (default: this one, probed); it goes into the kernel fingerprint. `weights`: how
        the matrices are held (weights.py; default dense); QWeights in `loaded` stay quantized only
        with a gguf choice. `kv_dtype`: the KV cache's dtype, auto | float32 | float16 (Transformer:
        auto is float16 where every layer runs fused in C, else float32). `chunk_size`: prefill rows a step
        (None: --chunk auto, CHUNK_RESIDENT here; Engine.load plans more where experts stream). `state_interval`: a hybrid model's
        recurrent snapshots every this many positions (kv/recurrent.py). `speculative`: requests draft
        by prompt lookup and verify (sequence.py; lossless) unless they say otherwise. `draft`: makes each
        speculating request's drafter (drafter.DrafterFactory; default prompt lookup; draft_model.DraftModel: a
        small model of the same tokenizer). Raises UnsupportedDtypeError for a dtype with no exact kernel here,
        ValueError for a KV dtype that cannot run or a draft model that cannot draft for this one."""
        cfg = loaded.config
        self.speculative = speculative
        self.config = cfg
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        # --chat-template: the operator's template replaces the file's (or stands in for a missing one)
        self.chat_template = chat_template if chat_template is not None else loaded.chat_template
        self.cpu = cpu or probe()
        name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
        self.dtype_choice = choose_dtype(name, self.cpu)
        dtype = DTYPES[self.dtype_choice.dtype]
        self.dtype = dtype
        self.prefix_reuse = prefix_reuse
        self.min_reuse = min_reuse
        self.ctx = min(ctx or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if cfg.rope is not None and cfg.rope.long_factors is not None:
            # longrope's short or long factors, fixed by the context this engine serves (rope.py);
            # the resolved config is what the KV namespace below records
            cfg = self.config = dataclasses.replace(cfg, rope=cfg.rope.for_context(self.ctx))
        self.weights_choice = weights or WeightsChoice("dense", name, "dense weights", "auto")
        # Native kernels (attention; the quantized matmul with --weights gguf), built for this CPU on
        # first use; without a compiler the torch attention runs instead (and says so once).
        native = self.weights_choice.kernels or load_kernels()
        self.kernels = native if isinstance(native, Kernels) else None
        if self.kernels is None:
            log.warning("native kernels unavailable (%s): torch attention, slower decode", native.reason)
            from ..malloc import keep_large_buffers
            keep_large_buffers()   # its (queries x keys) score buffers would page-fault in every layer
        self.model = Transformer.from_weights(cfg, loaded.weights, dtype,
                                              pack=self.dtype_choice.kernel == "onednn-packed",
                                              kernels=self.kernels,
                                              keep_quantized=self.weights_choice.mode == "gguf",
                                              kv_dtype=kv_dtype, experts=loaded.experts, consume=True)
        self.kv_dtype = self.model.kv_type.name      # float32 | float16 | q8_0 (consume: the loader's tensors are gone)
        # mixture of experts: how the experts are held (Engine.load's plan; None: as given) and what
        # the steps each running sequence took part in cost the expert store (`step`)
        self.expert_plan = None
        self._expert_use: "weakref.WeakKeyDictionary[Sequence, dict[str, int]]" = weakref.WeakKeyDictionary()
        self.runner = Runner(self.model, CHUNK_RESIDENT if chunk_size is None else chunk_size)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size)   # structured outputs (grammar.py)
        # K and V of the attention layers only: a hybrid model's recurrent layers keep a state instead
        shape = KVShape(len(cfg.attention_layers), cfg.num_kv_heads, self.model.kv_type.width(cfg.head_dim),
                        self.model.kv_dtype, self.ctx, ATTN_BLOCK)
        recurrent = recurrent_shape(cfg)         # a hybrid model's per-slot state (kv/recurrent.py), or None
        # ... and the token that opens every message: its slots snapshot the state before each one fed
        self.message_marks = message_marks(self.chat_template, self.tokenizer) if recurrent else frozenset()
        self.slots = [Slot(i, shape, recurrent=recurrent, state_interval=state_interval, marks=self.message_marks)
                      for i in range(slots)]
        # What the KV depends on besides token ids: the weights, the config as loaded, and the kernels
        # (dtype, kernel path, torch version, CPU class): two hosts sharing a cache directory, or one
        # host after a torch upgrade, must never load each other's KV (the bits may differ).
        attn = f"native:{self.kernels.isa}:{self.kernels.digest}" if self.kernels else "torch"
        self.kernel_fingerprint = (f"{kernel_fingerprint(self.dtype_choice, self.cpu)};"
                                   f"{self.weights_choice.fingerprint};attention={attn};kv={self.kv_dtype};"
                                   f"activations={getattr(self.model, 'activations', 'fp32')}")
        config_digest = hashlib.sha256(f"{cfg!r}:{loaded.extra_sha256}".encode()).hexdigest()[:32]
        self.model_namespace = f"{loaded.sha256}:{config_digest}:{self.kernel_fingerprint}".encode()
        # Tiers below the slots (RAM, disk); None: a slot's KV is gone once the slot is reused.
        self.store = None
        self._store_ident = StoreIdentity(loaded.sha256, str(dtype), shape.layers, cfg.num_kv_heads, shape.row,
                                          self.kv_dtype, recurrent.shapes if recurrent is not None else None)
        if cache is not None:
            self.open_store(cache)
        self.drafts = draft if draft is not None else PromptLookups()
        self.drafts.check(self)                  # a draft model of another tokenizer: refused here
        self._draft_failures = 0                 # draft_many calls that raised (`_draft`)

    def open_store(self, cache: CacheConfig) -> None:
        """Put the tiers `cache` describes below the slots (nothing when prefix reuse is off). Call before any
        request (Engine.load gives a draft model its share this way, once the target's size is known). Side
        effects: self.store; the disk tier scans or creates its directory; Redis is connected."""
        if self.prefix_reuse:
            self.store = TieredStore.from_config(self._store_ident, cache)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str = "smollm2-135m", dtype: str = "auto", cpu: CpuInfo | None = None,
             weights: str = "auto", expert_cache: "str | int | None" = "auto", activations: str = "auto",
             draft_model: str | None = None, **kw) -> "Engine":
        """model: registry name, .gguf path or Hugging Face folder. Downloads a registry model on first use.
        dtype: "auto" (the CPU's best exact kernels, logged with the reason) | float32 | bfloat16 | float16;
        weights: auto | gguf | bf16 | fp32 (weights.py; gguf may build the native kernel on first use);
        activations: auto | int8 | fp32, what gguf weights multiply (weights.py; auto: int8 there);
        an unknown or unsupported choice raises ValueError before any weight is read.
        draft_model: a small model (name, path or folder, same tokenizer) whose greedy guesses the requests verify
        (draft_model.py): loaded first with the same dtype, weights, slots and context, its own KV and reuse;
        ValueError when its tokenizer is not this model's.
        expert_cache (a GGUF mixture of experts): bytes = experts stream from the file through a cache
        of that size; "resident" = converted at load; "auto" = resident when they fit in the available
        memory beside the rest and the KV budget, else streamed with what fits (moe.plan_expert_cache).
        Side effect: caps glibc at one malloc arena for the process, fixes its malloc thresholds (high
        while loading, so the loader's temporaries reuse the heap, which is trimmed after; raised to
        1 GiB when the torch attention runs) (malloc.py; TERNLM_MALLOC_TUNE=0 opts out of all of it)."""
        from ..malloc import loading, one_arena, release_freed, streamed_blocks_return
        from ..models.registry import resolve
        cpu = cpu or probe()
        choose_dtype(dtype, cpu)                 # an unusable --dtype or --weights fails before the download
        if weights not in WEIGHTS:
            raise ValueError(f"unknown --weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
        if draft_model is not None:              # its own engine: slots paired with ours, never speculating
            from .spec.draft_model import DraftModel
            keys = ("slots", "ctx", "chunk_size", "min_reuse", "prefix_reuse", "kv_dtype")
            small = cls.load(draft_model, dtype=dtype, cpu=cpu, weights=weights, activations=activations,
                             speculative=False, **{k: kw[k] for k in keys if k in kw})
            kw["draft"] = DraftModel(small)
            log.info("draft model %s: drafts verified by %s", draft_model, model)
        t0 = time.perf_counter()
        r = resolve(model)
        wchoice = choose_weights(weights, dtype, r.kind == "gguf", activations=activations,
                                 params=gguf_parameters(r.path) if r.kind == "gguf" and activations == "auto"
                                 else None)
        choice = choose_dtype(wchoice.dtype, cpu)
        log.info("%s; %s", choice.log_line, wchoice.log_line)
        one_arena()
        tdtype = DTYPES[choice.dtype]
        plans: list = []                         # the expert cache's plan, once the header is read
        with loading():                          # the loader's temporaries reuse the heap, returned after
            if r.kind == "gguf":
                from ..models.gguf import load_gguf
                quantized = wchoice.mode == "gguf"
                loaded = load_gguf(r.path, tdtype, sha256=r.sha256, keep_quantized=quantized,
                                   lanes=quantized and wchoice.kernels.lanes,
                                   int8=quantized and wchoice.kernels.lanes and wchoice.kernels.int8,
                                   expert_budget=_expert_budget(expert_cache, kw, plans))
            else:
                from ..models.hf import load_hf_folder
                loaded = load_hf_folder(r.path, tdtype)
            release_freed()                      # the loader's temporaries, before the model's copies
            if draft_model is not None and kw.get("cache") is not None:   # the draft model's KV in tiers too
                from .spec.draft_model import share_cache
                kw["cache"], small_cache = share_cache(kw["cache"], loaded.config, small.config)
                small.open_store(small_cache)
            engine = cls(loaded, dtype=choice.dtype, cpu=cpu, weights=wchoice, **kw)
            engine.expert_plan = plans[0] if plans else None
        note = getattr(engine.model, "activations_note", "")
        if note:                                 # the model runs other activations than the line above said
            log.info("activations: %s", note)
        if engine.expert_plan is not None and engine.expert_plan.budget is not None:
            streamed_blocks_return()             # after loading(): it sets the serving thresholds
        log.info("loaded %s (%s, %s) in %.2f s", model, engine.config.arch, choice.dtype, time.perf_counter() - t0)
        return engine

    # ---- text ----------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool, **kw) -> str:
        from ..text.chat import render_chat
        if not self.chat_template:
            raise ValueError("this model has no chat template; use raw completion")
        tok = self.tokenizer
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.bos_token, eos_token=tok.eos_token, **kw)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kw) -> ChatIds:
        """Render messages with the model's own template and tokenize (no extra special tokens,
        as Hugging Face's apply_chat_template does)."""
        ids = ChatIds(self.tokenizer.encode(self._render(messages, add_generation_prompt, **kw),
                                            add_special_tokens=False))
        ids.messages = messages

        @functools.cache
        def message_ends() -> list[int]:
            # Token offset where each message ends; computed only when a divergence's reason is
            # read (Reuse.reason), on the reader's thread, once.
            from ..text.chat import message_boundaries
            tok = self.tokenizer
            text = self._render(messages, add_generation_prompt, **kw)
            chars = message_boundaries(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                       bos_token=tok.bos_token, eos_token=tok.eos_token, **kw)
            ends, last = [], 0
            for c in chars:   # a message whose partial render is not a prefix inherits the last end
                last = last if c is None else len(tok.encode(text[:c], add_special_tokens=False))
                ends.append(last)
            return ends
        ids.message_ends = message_ends
        return ids

    def namespace(self, salt: str = "") -> bytes:
        """Cache namespace: model weights + config + kernel fingerprint + tenant salt (API key, cache_salt)."""
        return hashlib.sha256(self.model_namespace + b"\0" + salt.encode()).digest()[:16]

    # ---- compute -------------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """(len(ids), vocab) fp32 logits of one full forward pass; touches no slot."""
        return self.runner.full_logits(list(ids))

    # ---- slots (the scheduler asks through these; it never holds a Slot) ------------------------
    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def chunk_size(self) -> int:
        return self.runner.chunk_size

    def slot_info(self) -> list[SlotInfo]:
        """A snapshot of every slot. Lengths and namespaces are single attribute reads: safe enough
        to call from another thread for reporting while the worker runs."""
        return [SlotInfo(s.index, len(s.record.fed), s.last_used, s.record.namespace) for s in self.slots]

    def usable_prefix(self, slot: Slot | int, prompt: list[int], namespace: bytes) -> int:
        """Positions of `slot` this prompt would actually keep (namespace, taint, [FRESH-LOGITS] and
        min_reuse applied). Does not modify the slot."""
        slot = self.slots[slot] if isinstance(slot, int) else slot
        return slot.resumable(decide_reuse(slot.record, prompt, namespace, min_reuse=self.min_reuse,
                                           enabled=self.prefix_reuse).tokens)

    def pick_slot(self, prompt: list[int], namespace: bytes, among: list[int] | None = None) -> int:
        """Index of the slot with the longest usable prefix for this prompt (among `among`, default
        all); a miss (nothing usable, e.g. only a shared template opening below min_reuse) takes the
        least recently used slot rather than a warm near-miss. Does not modify any slot."""
        cands = [self.slots[i] for i in among] if among is not None else self.slots
        scored = [(self.usable_prefix(s, prompt, namespace), s) for s in cands]
        best_k, best = max(scored, key=lambda ks: (ks[0], -ks[1].last_used))
        return (best if best_k > 0 else min(cands, key=lambda s: s.last_used)).index

    # ---- a request: open, step, stream ---------------------------------------------------------
    def open(self, prompt: list[int], *, max_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
             stop: list[str] | None = None, embeds: dict[int, torch.Tensor] | None = None,
             digest_embeds: bool = True, cache_salt: str = "", slot: Slot | int | None = None,
             on_chunk: Callable[[int], None] | None = None,
             keep_logits: bool = False, logprobs: int | None = None,
             ignore_eos: bool = False, grammar: GrammarSpec | None = None,
             fork_from: Slot | int | None = None, logit_bias: dict[int, float] | None = None,
             speculative: bool | None = None, penalties: Penalties | None = None) -> Sequence:
        """Validate a request and place it in a slot (the chosen one, or the best by pick_slot).
        Returns its Sequence, ready for `step`. Raises ValueError for a bad request, an invalid
        `grammar` included (nothing changed then). Side effects: may save the slot's blocks to the
        store, truncate or reset the slot, load tier blocks into it (each load recorded where fed),
        copy KV from `fork_from` (another slot: choice 0 of the same n > 1 request) where it holds
        more of this prompt than placement found (runner.copy_prefix, recorded where copied).
        `grammar`: constrain every sampled token (grammar.py), this request's logits row only.
        `logit_bias`: token id -> added to its logit before every choice (OpenAI's, -100..100).
        `penalties`: repetition / frequency / presence (sampling.Penalties: OpenAI's, transformers', llama.cpp's
        scopes), counted over exactly the tokens before each position, verify rows too.
        `speculative`: draft and verify (sequence.py: the same answer, token for token); None: the
        engine's default. A hybrid model's slot speculates too: it rewinds its recurrent state to before
        a verify step that had rejected rows and feeds the rows that stand again ([VERIFY-REWIND])."""
        t_start = time.perf_counter()
        prompt_in, prompt = prompt, list(prompt)
        n = len(prompt)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.ctx:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {self.ctx}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary [0, {vocab})")
        bias = tuple(sorted((logit_bias or {}).items()))
        if any(not 0 <= t < vocab for t, _ in bias):
            raise ValueError(f"logit_bias names a token outside the vocabulary [0, {vocab})")
        if any(not -100.0 <= b <= 100.0 for _, b in bias):
            raise ValueError("logit_bias values must lie in [-100, 100]")
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, min_p, seed, bias, penalties or Penalties()),
                          prompt)
        constraint = self.grammars.constraint(grammar) if grammar is not None else None
        ns = self.namespace(cache_salt)
        emb = {p: Embed(t, digest_tensor(t) if digest_embeds else None) for p, t in (embeds or {}).items()}
        if any(not 0 <= p < n for p in emb):
            raise ValueError("embeds positions must lie inside the prompt")

        if slot is None:
            slot = self.pick_slot(prompt, ns)
        slot = self.slots[slot] if isinstance(slot, int) else slot
        digests = {p: e.digest or b"" for p, e in emb.items()}
        chat = isinstance(prompt_in, ChatIds)
        reuse = decide_reuse(slot.record, prompt, ns, prompt_digests=digests, min_reuse=self.min_reuse,
                             enabled=self.prefix_reuse, message_ends=prompt_in.message_ends if chat else None,
                             message_roles=tuple(m.get("role", "") for m in getattr(prompt_in, "messages", ()))
                             if chat else None)
        resumed = slot.resumable(reuse.tokens)
        if resumed != reuse.tokens:              # [RESUME-AT-SNAPSHOT] a recurrent state resumes at a snapshot
            reuse = dataclasses.replace(reuse, tokens=resumed,
                                        why=f"{reuse.why}; recurrent state resumed at {resumed} of {reuse.tokens}")
        restored = self._place(slot, prompt, ns, reuse.tokens, min(digests, default=n))
        if fork_from is not None and self.prefix_reuse:
            src = self.slots[fork_from] if isinstance(fork_from, int) else fork_from
            # the same reuse rules as any prompt: namespace, embeds, [FRESH-LOGITS] (k <= n - 1); a hybrid
            # slot forks at a position where the source holds its recurrent state [RESUME-AT-SNAPSHOT]
            fork = src.resumable(decide_reuse(src.record, prompt, ns, prompt_digests=digests, min_reuse=0).tokens)
            if src is not slot and fork > restored.tokens:   # _place left the slot in namespace ns
                self.runner.copy_prefix(src, slot, fork)
                restored = dataclasses.replace(restored, sibling=fork - restored.tokens)
        k = restored.tokens
        check(len(slot.record) == k and slot.record.fed == prompt[:k],
              f"after placement the slot must hold exactly the prompt's first {k} ids")
        # [0, k) reused | [k, n) prefilled | [n, n + generated) decoded
        stop_ids = frozenset() if ignore_eos else self.tokenizer.stop_ids
        return Sequence(slot=slot, prompt=prompt, reused=k, reuse=reuse, restored=restored, sampler=sampler,
                        tokenizer=self.tokenizer, stop=list(stop or []),
                        limits=Limits(max_tokens, self.ctx, stop_ids), embeds=emb, on_chunk=on_chunk,
                        keep_logits=keep_logits, logprobs=logprobs, started=t_start, constraint=constraint,
                        drafter=self.drafts(slot.index, prompt, cache_salt)
                        if (self.speculative if speculative is None else speculative) else None)

    @staticmethod
    def want(seq: Sequence) -> Want:
        """What `seq` could feed now, for the step planner (step_plan.plan_step)."""
        return Want(len(seq.pending), not seq.prefilling)

    def step(self, work: list[tuple[Sequence, int]]) -> list[StepOutcome]:
        """One forward pass: each (sequence, count) feeds its next `count` pending ids (distinct
        slots). Returns one outcome per item, in order. Side effects: writes each slot's KV and
        record (runner.step, [RECORD-WHERE-FED]); each sequence samples and advances; then the
        speculating ones get their next drafts, all together (`_draft`).
        Isolation: a sequence that cannot run (context overflow) or whose hook or sampling raises
        fails alone; if the forward itself raises, every sequence of the step fails and no record
        changed; a drafter that raises costs its sequences their drafts, not their answers. A failed
        sequence is closed."""
        outcomes: list[StepOutcome | None] = [None] * len(work)
        feeds, live = [], []
        for i, (seq, count) in enumerate(work):
            ids, logits = seq.take(count)            # logits: "none" | "last" | "all" (a draft to verify)
            try:
                seq.slot.ensure_capacity(len(seq.slot.record) + count)
            except Exception as e:           # ContextOverflow: this sequence only
                outcomes[i] = self._fail(seq, e)
                continue
            if logits == "all":
                seq.slot.hold_for_verify()   # [VERIFY-REWIND] Sequence._verify's slot.reject goes back to it
            feeds.append(Feed(seq.slot, ids, seq.embeds or None, logits))
            live.append(i)
        if feeds:
            experts = self.model.experts
            before = experts.stats.snapshot() if experts is not None else None
            try:
                results = self.runner.step(feeds)
            except Exception as e:           # the whole forward failed: no record changed
                for i in live:
                    outcomes[i] = self._fail(work[i][0], e)
                return outcomes
            used = experts.stats.minus(before) if experts is not None else None
            for i, logits in zip(live, results):
                seq, count = work[i]
                was_prefilling = seq.prefilling
                try:
                    outcomes[i] = StepOutcome(seq.accept(count, logits))
                except Exception as e:       # its hook or its sampling: this sequence only
                    outcomes[i] = self._fail(seq, e)
                if used is not None:         # the whole step's expert traffic, to each sequence in it
                    acc = self._expert_use.setdefault(seq, dict.fromkeys(used, 0))
                    for k, v in used.items():
                        acc[k] += v
                    for ev in outcomes[i].events:
                        if isinstance(ev, Completion):   # read by server/schemas.timings
                            ev.experts = dict(self._expert_use.pop(seq, acc))
                if was_prefilling and not seq.prefilling:
                    log.info("%s", reuse_line(seq.reuse, seq.n, seq.timings, seq.restored))
                if seq.done and self.store is not None:
                    self.store.publish(seq.slot)   # shared tier: another replica may take the next turn
                if seq.done:
                    self.drafts.finished(seq.slot.index)   # a draft model publishes its paired slot too
            self._draft([work[i][0] for i in live])
        return outcomes

    def _draft(self, seqs: list[Sequence]) -> None:
        """Draft for every sequence of a step that asks (Sequence.draft_ask), in one call to the factory: a
        draft model then runs one forward per draft position for all of them (draft_model.py), not per
        sequence. A drafter that raises (a draft model's forward, its context) never fails a request: the
        askers go on without drafts (Sequence.stop_drafting; timings.draft_failed), logged with its traceback
        the first time. Side effects: the drafters', each asker's pending ids."""
        asking = [(seq, ask) for seq in seqs if (ask := seq.draft_ask()) is not None]
        if not asking:
            return
        try:
            drafts = self.drafts.draft_many([ask for _, ask in asking])
        except Exception as e:           # speed only: the answers never depended on the drafts
            if not self._draft_failures:
                log.warning("drafting failed; %d request(s) go on without drafts", len(asking), exc_info=True)
            else:
                log.warning("drafting failed again (%s); %d request(s) go on without drafts", e, len(asking))
            self._draft_failures += 1
            for seq, _ in asking:
                seq.stop_drafting()
            return
        for (seq, _), draft in zip(asking, drafts):
            seq.add_draft(draft)

    def kv_stats(self) -> dict:
        """The KV cache's format (kv/kvtype.py), its bytes a token (K and V, every attention layer, one slot) and
        the bytes the slots' caches hold now. Plain reads: safe from another thread (metrics)."""
        cfg = self.config
        return {"kv_dtype": self.kv_dtype,
                "bytes_per_token": self.model.kv_type.bytes_per_token(len(cfg.attention_layers), cfg.num_kv_heads,
                                                                      cfg.head_dim),
                "slot_bytes": sum(s.k.nbytes + s.v.nbytes for s in self.slots)}

    def expert_stats(self) -> dict | None:
        """A mixture of experts' store counters since load (hits, misses, bytes_read, bytes_used,
        rows, evictions) and how the experts are held (streamed, budget, resident_bytes, held,
        experts); None for a dense model. Plain int reads: safe from another thread (metrics)."""
        store = self.model.experts
        if store is None:
            return None
        streamed = bool(store.streamed)
        return {**store.stats.as_dict(), "streamed": streamed, "budget": store.budget,
                "resident_bytes": store.nbytes, "held": len(store),
                "experts": store.total_experts if streamed else len(store),
                "file_bytes": store.file_bytes if streamed else 0}

    @staticmethod
    def _fail(seq: Sequence, error: BaseException) -> StepOutcome:
        seq.close()
        return StepOutcome([], error)

    def stream(self, prompt: list[int], **kw) -> Iterator[Delta | Completion]:
        """Generate, yielding Delta per sampled token and finally the Completion. Takes `open`'s
        keyword arguments. A batch of one: prefill chunks of chunk_size, then one decode per step.
        Closing the generator early (cancellation) stops after the current step; the slot's record
        then describes exactly what was written. Side effects: rewrites the chosen slot's KV/record."""
        seq = self.open(prompt, **kw)
        try:
            while not seq.done:
                count = plan_step([self.want(seq)], self.chunk_size, self.chunk_size)[0]
                out = self.step([(seq, count)])[0]
                if out.error is not None:
                    raise out.error
                yield from out.events
        finally:
            seq.close()

    def place(self, slot: Slot, prompt: list[int], ns: bytes) -> Restored:
        """Place a prompt with no embeds in `slot` as `open` would (reuse from the slot, then the tiers), leaving
        at least one token to feed; for a draft model's slot (draft_model.ModelDrafter), which is fed by the
        draft steps, not by a Sequence. Side effects: `_place`'s."""
        reuse = decide_reuse(slot.record, prompt, ns, min_reuse=self.min_reuse, enabled=self.prefix_reuse)
        return self._place(slot, prompt, ns, slot.resumable(reuse.tokens), len(prompt))

    def _place(self, slot: Slot, prompt: list[int], ns: bytes, k: int, first_embed: int) -> Restored:
        """Make the slot's record a prefix of the prompt, acting on a kv/placement plan: keep the
        slot's usable prefix [0, k), or a longer one loaded from the tiers (whole blocks, then the
        tail entry after them). Side effects: saves the slot's blocks and tail into the store before
        discarding any of its positions; truncates or resets the slot; may load entries into it.
        `first_embed`: first position fed from a caller embedding."""
        rec, store, n = slot.record, self.store, len(prompt)
        facts = dict(n=n, record_len=len(rec), slot_usable=k, first_embed=first_embed, min_reuse=self.min_reuse)
        p = plan_placement(**facts, tier_blocks=0, store=store is not None)   # save_slot never depends on the tiers
        if p.save_slot:
            store.save(slot)                   # what the slot is about to lose goes down a tier
        if store is None:
            self._keep(slot, p.keep, ns)
            return Restored(slot=p.keep)
        limit = min(n - 1, first_embed)
        refs = store.match(prompt, ns, limit)
        t0 = time.perf_counter()
        tail = store.find_tail(prompt, ns, refs, limit, beat=max(k, self.min_reuse - 1))
        tail_s = time.perf_counter() - t0            # a disk tail is read and verified here
        ask = plan_tiers(**facts, tier_blocks=len(refs), tail_tokens=tail.tokens if tail is not None else 0,
                         resumable=slot.resumable if slot.state is not None else None)
        if ask.set_aside:
            store.save(slot)
        if not ask.placement.loads:
            self._keep(slot, ask.placement.keep, ns)
            return Restored(slot=ask.placement.keep)
        first, count = ask.placement.first_block, ask.placement.blocks
        got = store.fetch(refs[first:first + count], ns)
        hybrid = slot.state is not None
        p = settle_tiers(ask, Fetched(
            blocks=len(got.blocks), complete=first + len(got.blocks) == len(refs),
            tail_tokens=tail.tokens if tail is not None else 0,
            tail_whole=tail is not None and tail.tokens == len(tail.block.meta.ids),
            states=tuple(b.state is not None for b in got.blocks) if hybrid else None,
            tail_state=hybrid and tail is not None and tail.block.state is not None), **facts)
        self._keep(slot, p.keep, ns)
        if not p.loads:
            return Restored(slot=p.keep)
        # [0, keep) kept from the slot | [keep, loaded) loaded from tier blocks, then the tail | prefill
        entries = got.blocks[:p.blocks] + ([tail.block] if p.tail else [])
        tiers = got.tiers[:p.blocks] + ([tail.tier] if p.tail else [])
        t0 = time.perf_counter()
        self.runner.load_blocks(slot, entries)
        load_s = got.load_s + time.perf_counter() - t0 + (tail_s if p.tail else 0.0)
        rec.truncate(p.loaded)                 # the last entry may be cut: [FRESH-LOGITS], a divergence
        check(slot.state is None or slot.state.pos == p.loaded,
              "a hybrid slot's tier load ends where its recurrent state does")
        ends = [p.keep + BLOCK_TOKENS * (i + 1) for i in range(p.blocks)] + ([p.loaded] if p.tail else [])
        per, at = {"ram": 0, "disk": 0, "redis": 0}, p.keep
        for tier, end in zip(tiers, ends):
            per[tier] += min(end, p.loaded) - at
            at = min(end, p.loaded)
        return Restored(p.keep, per["ram"], per["disk"], load_s, redis=per["redis"])

    @staticmethod
    def _keep(slot: Slot, keep: int, ns: bytes) -> None:
        """Keep positions [0, keep) of the slot: truncate, or reset into namespace `ns` when 0."""
        if keep == 0:
            slot.reset(ns)
        else:
            slot.truncate(keep)

    def persist_cache(self) -> int:
        """Shutdown: write live slots and the RAM tier to the disk tier. Returns blocks on disk.
        Call only when no request runs (it reads every slot)."""
        return (self.store.persist(self.slots) if self.store is not None else 0) + self.drafts.persist()

    def generate(self, prompt: list[int] | str, **kw) -> Completion:
        """Run `stream` to the end. A str prompt is tokenized as raw text (BOS as the model says)."""
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        result = None
        for ev in self.stream(prompt, **kw):
            result = ev
        check(isinstance(result, Completion), "a stream ends with its Completion")
        return result


def _expert_budget(requested: "str | int | None", kw: dict, plans: list):
    """Engine.load's --expert-cache -> load_gguf's expert_budget: a callable that plans, once the
    header is read, from the experts' and the rest's bytes, the KV budget (slots x ctx at fp32's size:
    a slot's growth peak), a prefill step's work (kw's chunk_size rows) and the available memory
    (fit.available_memory where present, else MemAvailable). With chunk_size None (--chunk auto) and
    experts streamed, the chunk is planned with the cache (moe.streamed_chunk: fewer sweeps of the
    experts) and the cache planned again beside that chunk's work. Side effects: appends the plan to
    `plans`, sets kw["chunk_size"] when it planned one, logs both."""
    from ..models.moe import plan_expert_cache, step_work_bytes, streamed_chunk

    def decide(cfg, experts: int, rest: int) -> int | None:
        ctx = min(kw.get("ctx") or cfg.max_position_embeddings, cfg.max_position_embeddings)
        ctx = -(-ctx // ATTN_BLOCK) * ATTN_BLOCK
        # fp32's size even where the KV will be fp16 (--kv-dtype auto with the layers fused): a slot grows
        # by copying into buffers twice the size, so at its last doubling it holds 1.5x its full KV, and
        # counting the fp16 KV at its size left a 2,048-row chunk's process under an 8 GiB cgroup cap
        # OOM-killed in turn 2 (issue 49's probe, 2026-12-04); fp32's 2x kept it ~0.5 GB under the cap
        kv_elem = 4
        kv = len(cfg.attention_layers) * cfg.num_kv_heads * cfg.head_dim * 2 * kv_elem * ctx * kw.get("slots", 1)
        available = _available_memory() if requested == "auto" else None
        auto = kw.get("chunk_size") is None
        rows = CHUNK_RESIDENT if auto else kw["chunk_size"]
        plan = plan_expert_cache(requested, experts, rest + step_work_bytes(cfg, rows), kv, available)
        if auto and plan.budget is not None and cfg.num_experts:
            rows = streamed_chunk(cfg, plan.budget)
            plan = plan_expert_cache(requested, experts, rest + step_work_bytes(cfg, rows), kv, available)
            kw["chunk_size"] = rows
            log.info("prefill chunk: %d rows (--chunk auto: experts stream, each chunk sweeps them)", rows)
        plans.append(plan)
        if cfg.num_experts:
            log.info("expert cache: %s", plan.reason)
        return plan.budget
    return decide


def _available_memory() -> int | None:
    try:
        from .fit import available_memory       # the cgroup's limit too, where lower
        return available_memory().bytes
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def reuse_line(reuse: Reuse, n: int, t: Timings, r: Restored = Restored()) -> str:
    """The one log line per request: what was reused and from which tier, or why not."""
    prefill = f"prefill {t.prefill_tokens} tokens in {t.prefill_s:.2f} s"
    if r.ram or r.disk or r.redis:
        parts = ", ".join(f"{name} {c}" for name, c in (("slot", r.slot), ("ram", r.ram), ("disk", r.disk),
                                                         ("redis", r.redis)) if c)
        return (f"reuse {r.tokens}-token KV prefix (of {n}) from {r.tier} tier ({parts}; "
                f"load {r.load_s * 1e3:.1f} ms), {prefill}")
    if r.slot:
        return f"reuse {r.slot}-token KV prefix (of {n}) from the slot, {prefill}"
    return f"no reuse: {reuse.why}; {prefill}"   # why, not reason: naming the message renders templates
