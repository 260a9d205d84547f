"""Memory fit check before a load: do this model, its KV budget and the RAM tier fit in the memory
this process may use? If not, one line that says what would fit, before any weight is read.

Why before the load: a slot's KV grows on demand (kv/slots.py: 256 tokens, doubling up to the
context), so `--ctx 32768 --slots 8` loads fine and is killed by the OOM killer later, mid-answer,
when the conversations grow. The numbers are all known up front (the file's header has the shapes).

What a configuration needs (`Budget`), in bytes, each part at its steady-state maximum:
  model     --weights gguf: the file's size (its blocks are kept, repacked for the kernels);
            dense: parameters x 2 (bf16/fp16) or 4 (fp32), a tied embedding twice (lm_head is its own
            packed copy)
  KV        attention layers x kv_heads x 2 (K and V) x bytes a row (kv/kvtype.py: head_dim x 4 fp32, x 2 fp16;
            head_dim + head_dim / 16 q8_0)
            x ctx (rounded up to the attention block, as slots allocate) x slots
  RAM tier  serve's --cache-ram (the tier fills up to its budget), when prefix reuse is on
  draft     --draft-model: its weights (as the target's, same --weights) and its KV, one slot per target
            slot; a draft slot holds the target's tokens (plus a draft), so its KV counts at the target's
            context too (an overestimate where the draft model's own context is shorter); its engine has no
            tiers; one OVERHEAD for the process, model / 8 over both models' weights
  overhead  OVERHEAD + model / 8: tokenizer, RoPE tables, the kernels' layouts, allocator slack. Measured
            steady RSS added by a load, KV aside: smollm2 (94 MiB file) +28 MiB over the file, qwen2.5
            0.5b (469 MiB) +94, 1.5b (1,066 MiB) +216 (--weights gguf); dense smollm2 fp32 +46, qwen 0.5b
            bf16 +71 over parameters x bytes. The load's own peak is ~1.02x the steady set with int8
            activations (issue 61: each matrix read straight into its int layout, the model taking the
            loader's tensors layer by layer: 1.5b +1,222 peak for +1,197 steady), so it is not modelled apart.
Available: MemAvailable, or the cgroup's limit minus its usage (inactive file pages are reclaimable,
so not counted as used) where that is lower (v2 memory.max up the tree; v1 memory.limit_in_bytes and
the hierarchical limit).
"""
from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from ..sizes import format_size
from ..kv.kvtype import kv_type

log = logging.getLogger("ternlm")

OVERHEAD = 256 << 20            # fixed part of the overhead (see the module docstring)
ATTN_BLOCK = 256                # = models.llama.ATTN_BLOCK (slot capacity is a multiple); not imported: no torch here
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_UNLIMITED = 1 << 60            # cgroup v1 writes "no limit" as ~2^63 (rounded to a page)


class DoesNotFit(ValueError):
    """The configuration needs more memory than is available; str() is the one line for the user
    (a ValueError, so the CLI prints it as `ternlm: error: ...` and exits 2, no traceback)."""

    def __init__(self, fit: "Fit"):
        super().__init__(fit.line)
        self.fit = fit


@dataclass(frozen=True)
class Budget:
    """What one configuration needs, in parts. Pure data."""
    model: int               # bytes the weights take in memory
    kv_per_token: int        # bytes of K and V for one token of one slot, every attention layer
    ctx: int                 # tokens a slot may grow to (already rounded up to ATTN_BLOCK)
    slots: int
    ram_tier: int = 0        # serve's --cache-ram budget; 0 where there is no RAM tier
    dense: bool = False      # dense weights: --weights gguf is a smaller choice to suggest (GGUF models)
    state_per_slot: int = 0  # a hybrid model's recurrent state and its snapshots, at most, per slot (kv/recurrent.py)
    draft_model: int = 0     # --draft-model: bytes its weights take (0: none)
    draft_kv_per_token: int = 0   # its K and V per token of one (paired) slot, all its layers
    kv_dtype: str = "float32"     # the KV format kv_per_token counts (kv/kvtype.py; auto resolved)

    def __post_init__(self) -> None:
        if min(self.model, self.kv_per_token, self.ctx, self.slots) < 1 or \
                min(self.ram_tier, self.draft_model, self.draft_kv_per_token) < 0:
            raise ValueError(f"invalid budget {self}")

    @property
    def weights(self) -> int:
        """Both models' weights."""
        return self.model + self.draft_model

    @property
    def kv_token(self) -> int:
        """K and V of one token of one slot, with its draft slot's."""
        return self.kv_per_token + self.draft_kv_per_token

    @property
    def kv(self) -> int:
        return self.kv_token * self.ctx * self.slots

    @property
    def overhead(self) -> int:
        return OVERHEAD + self.weights // 8

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state_per_slot * self.slots + self.ram_tier + self.overhead


@dataclass(frozen=True)
class Available:
    bytes: int | None        # None: nothing to read here (no /proc): the check is skipped
    source: str              # "MemAvailable", "cgroup limit", or why it is unknown


@dataclass(frozen=True)
class Fit:
    ok: bool
    needed: int              # bytes (Budget.total)
    available: int | None    # bytes; None when unknown (ok is then True)
    line: str                # one line for the user: what it needs, what is there, what would fit


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """K and V of one token in one slot, `layers` attention layers (config.attention_layers: a hybrid model's
    recurrent layers hold none), as kv/slots.py allocates them: rows of kv/kvtype.py's format `kv_dtype`."""
    return kv_type(kv_dtype).bytes_per_token(layers, kv_heads, head_dim)


def slot_tokens(ctx: int) -> int:
    """The most positions a slot allocates for a context of `ctx` tokens (a multiple of the block)."""
    return -(-ctx // ATTN_BLOCK) * ATTN_BLOCK


# ---------------------------------------------------------------------------------------------
# The decision: pure.
# ---------------------------------------------------------------------------------------------

def check(budget: Budget, available: Available, slots_flag: bool = False) -> Fit:
    """Compare a budget with the available memory. Pure. `slots_flag`: the command has --slots (serve),
    so fewer slots is a suggestion. When it does not fit, the line names the largest --ctx (a multiple
    of 1,024, or of 256 below that) and --slots that would, and a --cache-ram where the tier is the
    difference; else that the model alone is too large."""
    b = budget
    parts = f"model {_gib(b.model)}" + (f" + draft model {_gib(b.draft_model)}" if b.draft_model else "")
    parts += f" + KV {_gib(b.kv)} for {_n(b.slots, 'slot')} x {b.ctx} tokens" + (" (both)" if b.draft_model else "")
    if b.state_per_slot:
        parts += f" + recurrent state {_gib(b.state_per_slot * b.slots)}"
    if b.ram_tier:
        parts += f" + RAM tier {_gib(b.ram_tier)}"
    parts += f" + {_gib(b.overhead)} overhead"
    if available.bytes is None:
        return Fit(True, b.total, None, f"needs ~{_gib(b.total)} ({parts}); available memory unknown "
                                        f"({available.source}): not checked")
    have = f"{_gib(available.bytes)} available ({available.source})"
    head = f"needs ~{_gib(b.total)} ({parts}), {have}"
    if b.total <= available.bytes:
        return Fit(True, b.total, available.bytes, head)
    return Fit(False, b.total, available.bytes, f"{head}: {_suggest(b, available.bytes, slots_flag)}")


def _suggest(b: Budget, available: int, slots_flag: bool) -> str:
    """`try A or B (...)`: each option alone makes the budget fit (tests/test_fit.py checks it)."""
    tries = _kv_tries(b, available - b.weights - b.overhead - b.ram_tier, slots_flag)   # the tier as set
    tier_room = available - b.weights - b.overhead - b.kv - b.state_per_slot * b.slots   # KV as set
    if b.ram_tier and tier_room >= 0:
        tries.append(f"--cache-ram {tier_room // (256 << 20) * 256}MiB")
    if not tries and b.ram_tier:   # neither alone: a smaller KV with no tier at all
        tries = [f"--cache-ram 0 {t}" for t in _kv_tries(b, available - b.weights - b.overhead, slots_flag)]
    if not tries:                  # not one block of tokens per slot beside the model, even without a tier
        smaller = "--weights gguf or a smaller model" if b.dense else "a smaller model"
        alone = "the models alone need" if b.draft_model else "the model alone needs"
        return f"{alone} ~{_gib(b.weights + b.overhead)}: try {smaller} (--no-fit-check loads anyway)"
    return f"try {' or '.join(tries)} (--no-fit-check loads anyway)"


def _kv_tries(b: Budget, kv_room: int, slots_flag: bool) -> list[str]:
    """The largest --ctx (for b.slots) and --slots (for b.ctx) whose KV (and each slot's recurrent state)
    fits in kv_room bytes; where neither does, one slot with the largest --ctx."""
    tries = []
    state = b.state_per_slot
    if (ctx := _round_ctx((kv_room - state * b.slots) // (b.kv_token * b.slots))) > 0:
        tries.append(f"--ctx {ctx}")
    if slots_flag and (slots := kv_room // (b.kv_token * b.ctx + state)) >= 1:
        tries.append(f"--slots {slots}")
    if not tries and slots_flag and b.slots > 1 and (ctx := _round_ctx((kv_room - state) // b.kv_token)) > 0:
        tries.append(f"--slots 1 --ctx {ctx}")    # neither alone: one slot, shorter
    return tries


def longest_ctx(b: Budget, available: int) -> int:
    """The longest --ctx (rounded as the suggestions are) whose KV for b.slots fits in `available` bytes beside
    everything else b holds; 0 when not one block does. Pure."""
    room = available - b.weights - b.overhead - b.ram_tier - b.state_per_slot * b.slots
    return _round_ctx(room // (b.kv_token * b.slots))


def _round_ctx(tokens: int) -> int:
    """A context to suggest: a multiple of 1,024 (of 256 below that); 0 when under one block."""
    if tokens <= 0:
        return 0
    step = 1024 if tokens >= 1024 else ATTN_BLOCK
    return tokens // step * step


def _gib(n: int) -> str:
    return format_size(n)


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}" + ("" if k == 1 else "s")


# ---------------------------------------------------------------------------------------------
# Available memory: /proc/meminfo and the cgroup's limit.
# ---------------------------------------------------------------------------------------------

def available_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> Available:
    """MemAvailable, or the memory cgroup's headroom where lower. Reads files only."""
    try:
        meminfo = (proc / "meminfo").read_text()
    except OSError as e:
        return Available(None, f"no {proc / 'meminfo'}: {e.strerror}")
    kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    if kib is None:
        return Available(None, "no MemAvailable in /proc/meminfo")
    best = Available(kib * 1024, "MemAvailable")
    room = _cgroup_headroom(proc, cgroup)
    if room is not None and room < best.bytes:
        best = Available(max(room, 0), "cgroup limit")
    return best


def _cgroup_headroom(proc: Path, root: Path) -> int | None:
    """Bytes this process's memory cgroup (and its ancestors) may still grow by; None: no limit."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        rel = path.strip().lstrip("/")
        if hid == "0" and controllers == "":                         # v2 (unified, or hybrid's unified/)
            rooms += [r for base in (root, root / "unified") if (r := _v2_headroom(base, rel)) is not None]
        elif "memory" in controllers.split(","):
            if (r := _v1_headroom(root / "memory", rel)) is not None:
                rooms.append(r)
    return min(rooms) if rooms else None


def _v2_headroom(base: Path, rel: str) -> int | None:
    """min over the cgroup and its ancestors of memory.max - (memory.current - inactive_file)."""
    here = base / rel if (base / rel).is_dir() else base     # a namespaced container sees its own at the root
    rooms = []
    for d in [here, *here.parents]:
        limit = _read_int(d / "memory.max")
        if limit is not None:
            used = (_read_int(d / "memory.current") or 0) - _stat(d / "memory.stat", "inactive_file")
            rooms.append(limit - used)
        if d == base:
            break
    return min(rooms) if rooms else None


def _v1_headroom(base: Path, rel: str) -> int | None:
    """min(limit_in_bytes, hierarchical_memory_limit) - (usage_in_bytes - total_inactive_file)."""
    d = base / rel if (base / rel).is_dir() else base
    limits = [x for x in (_read_int(d / "memory.limit_in_bytes"),
                          _stat(d / "memory.stat", "hierarchical_memory_limit", None)) if x is not None]
    limit = min(limits, default=None)
    if limit is None or limit >= _UNLIMITED:
        return None
    used = (_read_int(d / "memory.usage_in_bytes") or 0) - _stat(d / "memory.stat", "total_inactive_file")
    return limit - used


def _read_int(path: Path) -> int | None:
    """An integer file's value; None when absent, unreadable or "max" (v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str, default: int | None = 0) -> int | None:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return default


# ---------------------------------------------------------------------------------------------
# A configuration's budget, from the model's header (GGUF metadata or config.json + safetensors
# headers): no weight is read.
# ---------------------------------------------------------------------------------------------

def budget_for(model: str, *, dtype: str = "auto", weights: str = "auto", kv_dtype: str = "auto",
               ctx: int | None = None, slots: int = 1, ram_tier: int = 0, expert_cache: str = "auto",
               draft_model: str | None = None) -> Budget:
    """The Budget of loading `model` (registry name, .gguf path, HF folder) with these flags, resolved
    as Engine.load resolves them. Side effects: a registry model not yet cached is fetched (with
    progress, as the load would); --weights may build the native kernels (cached; kernels/build.py).
    Raises what the load would for a bad name or flag (ValueError and its subclasses).
    Mixture-of-experts files: the experts count only as `--expert-cache` keeps them (resident: all; a
    size: that many bytes; auto: nothing, since the engine then keeps what fits and streams the rest).
    draft_model: its weights and its slots' KV are added (the module docstring's "draft"), resolved the same way."""
    from ..cpu import choose_dtype, probe
    from ..models.registry import REGISTRY, cached_file, resolve
    from .weights import choose_weights

    choose_dtype(dtype, probe())        # an unusable --dtype fails here as in Engine.load
    if model in REGISTRY and (cached := cached_file(REGISTRY[model])) is not None:
        path, kind = cached, "gguf"     # only its header is read here; Engine.load verifies its sha256 next
    else:
        r = resolve(model)              # a registry model not cached yet is fetched here, with progress
        path, kind = r.path, r.kind
    wchoice = choose_weights(weights, dtype, kind == "gguf")
    dense = wchoice.mode != "gguf"
    elem = WEIGHT_BYTES[choose_dtype(wchoice.dtype, probe()).dtype]
    shape = _gguf_shape(path) if kind == "gguf" else _hf_shape(path)
    layers, kv_heads, head_dim, max_ctx, params, tied_embed, expert_bytes, recurrent, aside = shape
    model_bytes = (params + tied_embed) * elem if dense else path.stat().st_size - aside
    if expert_bytes and expert_cache != "resident":
        from ..sizes import parse_size
        kept = 0 if expert_cache == "auto" else min(parse_size(expert_cache), expert_bytes)
        model_bytes = max(model_bytes - expert_bytes, 0) + kept
    # Transformer._choose_kv_dtype: auto is fp16 where every layer runs fused in C (--weights gguf);
    # a model whose layers stay in torch gets fp32, twice this: rare, and the load logs why.
    kv = kv_dtype if kv_dtype != "auto" else ("float32" if dense or recurrent else "float16")
    tokens = slot_tokens(min(ctx or max_ctx, max_ctx))          # Engine: min(ctx or the model's, the model's)
    draft = budget_for(draft_model, dtype=dtype, weights=weights, kv_dtype=kv_dtype, ctx=ctx, slots=slots) \
        if draft_model is not None else None     # Engine.load: the same flags, its own engine, no tiers
    return Budget(model_bytes, kv_bytes_per_token(layers, kv_heads, head_dim, kv), tokens, slots, ram_tier,
                  dense=dense and kind == "gguf", state_per_slot=recurrent, kv_dtype=kv,
                  draft_model=draft.model if draft else 0, draft_kv_per_token=draft.kv_per_token if draft else 0)


def _state_bytes(cfg) -> int:
    """A slot's recurrent state with as many snapshots as it may keep (kv/recurrent.py); 0 without."""
    from ..kv.recurrent import RecurrentState, recurrent_shape
    shape = recurrent_shape(cfg)
    if shape is None:
        return 0
    return shape.nbytes * (1 + RecurrentState.snapshots_for(shape))


def _gguf_shape(path: Path) -> tuple[int, int, int, int, int, int, int, int, int]:
    """(attention layers (a slot's KV holds no other), kv_heads, head_dim, context, parameters, tied embedding's
    parameters or 0, bytes of expert tensors, a slot's recurrent state bytes, bytes of the blocks set aside
    ([MTP-ASIDE]: in the file, never loaded)) from the GGUF header (FastGGUFReader maps the file; reads no tensor
    data)."""
    from ..models.gguf import FastGGUFReader, config_from_gguf
    reader = FastGGUFReader(path)
    cfg = config_from_gguf(reader)
    sizes = {t.name: int(t.n_elements) for t in reader.tensors}
    tied = sizes.get("token_embd.weight", 0) if cfg.tie_word_embeddings else 0
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    aside = sum(int(t.n_bytes) for t in reader.mtp_tensors)
    return (len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings, sum(sizes.values()),
            tied, experts, _state_bytes(cfg), aside)


def _hf_shape(folder: Path) -> tuple[int, int, int, int, int, int, int, int, int]:
    """The same from config.json and the safetensors files' JSON headers (no tensor is read)."""
    from ..models.hf import config_from_hf, run_name, text_part
    outer = json.loads((folder / "config.json").read_text())
    text = text_part(outer)          # a vision-language folder: its language model (what loads)
    sizes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        sizes |= {name: n for stored, n in _safetensors_sizes(file).items()
                  if (name := run_name(stored, text is not outer)) is not None}
    cfg = config_from_hf(text, set(sizes))
    tied = sizes.get("model.embed_tokens.weight", 0) if cfg.tie_word_embeddings else 0
    return (len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings, sum(sizes.values()),
            tied, 0, _state_bytes(cfg), 0)


def _safetensors_sizes(file: Path) -> dict[str, int]:
    """Tensor name -> element count from a safetensors header (u64 length, then JSON)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    sizes = {}
    for name, info in header.items():
        if name != "__metadata__":
            count = 1
            for d in info["shape"]:
                count *= int(d)
            sizes[name] = count
    return sizes


# ---------------------------------------------------------------------------------------------
# The call sites' one call.
# ---------------------------------------------------------------------------------------------

def require_fit(model: str, *, slots_flag: bool = False, **flags) -> Fit:
    """budget_for(model, **flags) against available_memory(). Logs the line when it fits; raises
    DoesNotFit (one line) when it does not. A model or flag budget_for cannot read (a bad path, an
    unsupported file, a failed download) is not checked: the load then reports it as it always has
    (serve: in its loading thread, exit status 1). Side effects: budget_for's."""
    try:
        budget = budget_for(model, **flags)
    except (LookupError, ValueError, OSError, RuntimeError) as e:
        log.info("memory: not checked (%s)", e)
        return Fit(True, 0, None, f"not checked: {e}")
    fit = check(budget, available_memory(), slots_flag=slots_flag)
    if not fit.ok:
        raise DoesNotFit(fit)
    log.info("memory: %s", fit.line)
    return fit
