"""Engine: the Python API. Load a model, render chats, generate with prefix KV reuse.

    engine = Engine.load("smollm2-135m", dtype="float32")
    ids = engine.apply_chat_template(messages, add_generation_prompt=True)
    out = engine.generate(ids, max_tokens=64, temperature=0.0)   # Completion

The engine keeps its slots (KV sequences) between calls, so turn after turn of a conversation
prefills only the new tail. It is not thread-safe: the server's scheduler serialises access.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .cpu import CpuInfo, choose_dtype, kernel_fingerprint, probe
from .kv.blocks import BLOCK_TOKENS
from .kv.record import Reuse, decide_reuse
from .kv.slots import KVShape, Slot
from .kv.store import CacheConfig, StoreIdentity, TieredStore
from .models.llama import ATTN_BLOCK, KV_DTYPE, Transformer
from .models.loaded import LoadedModel
from .runner import Embed, Runner, digest_tensor
from .sampling import Sampler, SamplingParams

log = logging.getLogger("ternlm")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class ChatIds(list):
    """Token ids rendered from chat messages; remembers the messages so a divergence can be located
    in a message ("diverged at token 812 (message 3)"). Behaves exactly like list[int]."""
    messages: list[dict]
    message_ends: Callable[[], list[int]]


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: float = 0.0          # request start -> first sampled token


@dataclass(frozen=True)
class Restored:
    """Where a request's reused prefix [0, tokens) came from: first the slot's own KV, then blocks
    loaded from the tiers below it (RAM, then disk), in position order."""
    slot: int = 0
    ram: int = 0
    disk: int = 0
    load_s: float = 0.0          # reading + verifying + copying tier blocks

    @property
    def tokens(self) -> int:
        return self.slot + self.ram + self.disk

    @property
    def tier(self) -> str:
        """The slowest tier that contributed: "disk" | "ram" | "slot" | "none"."""
        return "disk" if self.disk else "ram" if self.ram else "slot" if self.slot else "none"


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


class Engine:
    def __init__(self, loaded: LoadedModel, *, dtype: torch.dtype | str = "auto", prefix_reuse: bool = True,
                 min_reuse: int = 16, slots: int = 1, ctx: int | None = None, chunk_size: int = 256,
                 cache: CacheConfig | None = None, cpu: CpuInfo | None = None):
        """dtype: "auto" (cpu.py picks from the CPU), a name, or a torch dtype. `cpu`: the CPU to plan
        kernels for (default: this one, probed); it goes into the kernel fingerprint.
        Raises UnsupportedDtypeError for a dtype with no exact kernel here (bf16 on AVX2)."""
        cfg = loaded.config
        self.config = cfg
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.cpu = cpu or probe()
        name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
        self.dtype_choice = choose_dtype(name, self.cpu)
        dtype = DTYPES[self.dtype_choice.dtype]
        self.dtype = dtype
        self.prefix_reuse = prefix_reuse
        self.min_reuse = min_reuse
        self.ctx = min(ctx or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model = Transformer.from_weights(cfg, loaded.weights, dtype,
                                              pack=self.dtype_choice.kernel == "onednn-packed")
        loaded.weights.clear()  # the module holds (fused) copies; free the loader's
        self.runner = Runner(self.model, chunk_size)
        shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KV_DTYPE, self.ctx, ATTN_BLOCK)
        self.slots = [Slot(i, shape) for i in range(slots)]
        # What the KV depends on besides token ids: the weights, the config as loaded, and the kernels
        # (dtype, kernel path, torch version, CPU class): two hosts sharing a cache directory, or one
        # host after a torch upgrade, must never load each other's KV (the bits may differ).
        self.kernel_fingerprint = kernel_fingerprint(self.dtype_choice, self.cpu)
        config_digest = hashlib.sha256(f"{cfg!r}:{loaded.extra_sha256}".encode()).hexdigest()[:32]
        self.model_namespace = f"{loaded.sha256}:{config_digest}:{self.kernel_fingerprint}".encode()
        # Tiers below the slots (RAM, disk); None: a slot's KV is gone once the slot is reused.
        self.store = None
        if cache is not None and prefix_reuse:
            ident = StoreIdentity(loaded.sha256, str(dtype), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                  str(KV_DTYPE).removeprefix("torch."))
            self.store = TieredStore(ident, cache.ram_bytes, cache.disk_dir, cache.disk_bytes)

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, model: str = "smollm2-135m", dtype: str = "auto", cpu: CpuInfo | None = None,
             **kw) -> "Engine":
        """model: registry name, .gguf path or Hugging Face folder. Downloads a registry model on first use.
        dtype: "auto" (the CPU's best exact kernels, logged with the reason) | float32 | bfloat16 | float16;
        an unknown or unsupported dtype raises ValueError before anything is read.
        Side effect: raises glibc's malloc thresholds for the process (malloc.py: ~1.6x faster long
        prefills; TERNLM_MALLOC_TUNE=0 opts out)."""
        from .malloc import keep_large_buffers
        from .models.registry import resolve
        cpu = cpu or probe()
        choice = choose_dtype(dtype, cpu)
        log.info("%s", choice.log_line)
        keep_large_buffers()
        tdtype = DTYPES[choice.dtype]
        t0 = time.perf_counter()
        r = resolve(model)
        if r.kind == "gguf":
            from .models.gguf import load_gguf
            loaded = load_gguf(r.path, tdtype, sha256=r.sha256)
        else:
            from .models.hf import load_hf_folder
            loaded = load_hf_folder(r.path, tdtype)
        engine = cls(loaded, dtype=choice.dtype, cpu=cpu, **kw)
        log.info("loaded %s (%s, %s) in %.2f s", model, loaded.config.arch, choice.dtype, time.perf_counter() - t0)
        return engine

    # ---- text ----------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool, **kw) -> str:
        from .chat import render_chat
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

        def message_ends() -> list[int]:
            # Token offset where each message ends; computed only when a divergence is reported.
            from .chat import message_boundaries
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

    def usable_prefix(self, slot: Slot, prompt: list[int], namespace: bytes) -> int:
        """Positions of `slot` this prompt would actually keep (namespace, taint, [FRESH-LOGITS] and
        min_reuse applied). Does not modify the slot."""
        return decide_reuse(slot.record, prompt, namespace, min_reuse=self.min_reuse,
                            enabled=self.prefix_reuse).tokens

    def pick_slot(self, prompt: list[int], namespace: bytes, slots: list[Slot] | None = None) -> Slot:
        """The slot with the longest usable prefix for this prompt; a miss (nothing usable, e.g. only a
        shared template opening below min_reuse) evicts the least recently used slot rather than a
        warm near-miss. Does not modify any slot."""
        cands = slots if slots is not None else self.slots
        scored = [(self.usable_prefix(s, prompt, namespace), s) for s in cands]
        best_k, best = max(scored, key=lambda ks: (ks[0], -ks[1].last_used))
        return best if best_k > 0 else min(cands, key=lambda s: s.last_used)

    def stream(self, prompt: list[int], *, max_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None,
               stop: list[str] | None = None, embeds: dict[int, torch.Tensor] | None = None,
               digest_embeds: bool = True, cache_salt: str = "", slot: Slot | None = None,
               on_chunk: Callable[[int], None] | None = None,
               keep_logits: bool = False, logprobs: int | None = None,
               ignore_eos: bool = False) -> Iterator[Delta | Completion]:
        """Generate, yielding Delta per sampled token and finally the Completion.
        Closing the generator early (cancellation) stops after the current step; the slot's record
        then describes exactly what was written. Side effects: rewrites the chosen slot's KV/record."""
        from .detok import IncrementalDetokenizer, StopMatcher
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
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, min_p, seed))
        ns = self.namespace(cache_salt)
        emb = {p: Embed(t, digest_tensor(t) if digest_embeds else None) for p, t in (embeds or {}).items()}
        if any(not 0 <= p < n for p in emb):
            raise ValueError("embeds positions must lie inside the prompt")

        slot = slot or self.pick_slot(prompt, ns)
        rec = slot.record
        digests = {p: e.digest or b"" for p, e in emb.items()}
        reuse = decide_reuse(rec, prompt, ns, prompt_digests=digests, min_reuse=self.min_reuse,
                             enabled=self.prefix_reuse)
        if "diverged" in reuse.reason and isinstance(prompt_in, ChatIds):
            # Only now pay for locating the message the divergence fell in.
            reuse = decide_reuse(rec, prompt, ns, prompt_digests=digests, min_reuse=self.min_reuse,
                                 enabled=self.prefix_reuse, message_ends=prompt_in.message_ends())
        restored = self._place(slot, prompt, ns, reuse.tokens, min(digests, default=n))
        k = restored.tokens
        assert len(rec) == k and rec.fed == prompt[:k]
        # [0, k) reused | [k, n) prefilled | [n, n + generated) decoded
        timings = Timings()
        t0 = time.perf_counter()
        logits = self.runner.prefill(slot, prompt[k:], emb, on_chunk)
        timings.prefill_tokens, timings.prefill_s = n - k, time.perf_counter() - t0
        log.info("%s", reuse_line(reuse, n, timings, restored))

        detok = IncrementalDetokenizer(self.tokenizer)
        stopper = StopMatcher(list(stop or []))
        stop_ids = frozenset() if ignore_eos else self.tokenizer.stop_ids
        out_ids: list[int] = []
        kept: list[torch.Tensor] = []
        text: list[str] = []
        finish = "length"
        by_string = False
        t_dec = time.perf_counter()
        try:
            while True:
                tok = sampler.sample(logits)
                if keep_logits:
                    kept.append(logits)
                if not out_ids:
                    timings.ttft_s = time.perf_counter() - t_start
                if tok in stop_ids:
                    finish = "stop"
                    break
                out_ids.append(tok)
                emit, stopped = stopper.feed(detok.push(tok))
                text.append(emit)
                if logprobs is None:
                    yield Delta(emit, tok)
                else:
                    lp = torch.log_softmax(logits, dim=-1)
                    top = torch.topk(lp, logprobs) if logprobs > 0 else None
                    yield Delta(emit, tok, float(lp[tok]),
                                list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
                if stopped:
                    finish, by_string = "stop", True
                    break
                if len(out_ids) >= max_tokens or len(rec) >= self.ctx:
                    break
                logits = self.runner.decode(slot, tok)
                timings.decode_tokens += 1
        finally:
            timings.decode_s = time.perf_counter() - t_dec
            slot.touch()
        if not by_string:
            tail, stopped = stopper.feed(detok.flush())
            if not stopped:
                tail += stopper.flush()
            if tail:
                text.append(tail)
                yield Delta(tail, -1)
        yield Completion("".join(text), out_ids, finish, n, k, reuse, timings, slot.index,
                         torch.stack(kept) if keep_logits else None, restored)

    def _place(self, slot: Slot, prompt: list[int], ns: bytes, k: int, first_embed: int) -> Restored:
        """Make the slot's record a prefix of the prompt: keep the slot's usable prefix [0, k), or a
        longer one loaded from the tiers. Side effects: saves the slot's blocks into the store before
        discarding any of its positions; truncates or resets the slot; may load blocks into it.
        `first_embed`: first position fed from a caller embedding (stored blocks never carry one)."""
        rec, store, n = slot.record, self.store, len(prompt)
        if store is not None and k < len(rec):
            store.save(slot)                   # what the slot is about to lose goes down a tier
        if store is not None:
            limit = min(n - 1, first_embed)    # [FRESH-LOGITS] feed >= 1 token; embeds are prefilled
            refs = store.match(prompt, ns, limit)
            first = k // BLOCK_TOKENS          # blocks [0, first) are in the slot already
            beat = max(k, self.min_reuse - 1)  # the tiers are used only for more than this
            if min(len(refs) * BLOCK_TOKENS, limit) > beat and len(refs) > first:
                got = store.fetch(refs[first:], ns)
                keep = first * BLOCK_TOKENS
                if min(keep + got.tokens, limit) > beat:
                    if keep == 0:
                        slot.reset(ns)
                    else:
                        rec.truncate(keep)
                    # [0, keep) kept from the slot | [keep, len) loaded from tiers | then prefill
                    t0 = time.perf_counter()
                    self.runner.load_blocks(slot, got.blocks)
                    load_s = got.load_s + time.perf_counter() - t0
                    rec.truncate(limit)
                    per = [(t, max(0, min(BLOCK_TOKENS, limit - keep - i * BLOCK_TOKENS)))
                           for i, t in enumerate(got.tiers)]
                    return Restored(keep, sum(c for t, c in per if t == "ram"),
                                    sum(c for t, c in per if t == "disk"), load_s)
        if k == 0:
            slot.reset(ns)
        else:
            rec.truncate(k)
        return Restored(slot=k)

    def persist_cache(self) -> int:
        """Shutdown: write live slots and the RAM tier to the disk tier. Returns blocks on disk.
        Call only when no request runs (it reads every slot)."""
        return self.store.persist(self.slots) if self.store is not None else 0

    def generate(self, prompt: list[int] | str, **kw) -> Completion:
        """Run `stream` to the end. A str prompt is tokenized as raw text (BOS as the model says)."""
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        result = None
        for ev in self.stream(prompt, **kw):
            result = ev
        assert isinstance(result, Completion)
        return result


def reuse_line(reuse: Reuse, n: int, t: Timings, r: Restored = Restored()) -> str:
    """The one log line per request: what was reused and from which tier, or why not."""
    prefill = f"prefill {t.prefill_tokens} tokens in {t.prefill_s:.2f} s"
    if r.ram or r.disk:
        parts = ", ".join(f"{name} {c}" for name, c in (("slot", r.slot), ("ram", r.ram), ("disk", r.disk)) if c)
        return (f"reuse {r.tokens}-token KV prefix (of {n}) from {r.tier} tier ({parts}; "
                f"load {r.load_s * 1e3:.1f} ms), {prefill}")
    if r.slot:
        return f"reuse {r.slot}-token KV prefix (of {n}) from the slot, {prefill}"
    return f"no reuse: {reuse.reason}; {prefill}"
