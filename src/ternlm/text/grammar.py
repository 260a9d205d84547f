"""Constrained decoding: a grammar (JSON schema, JSON object, regex, Lark) masks each sampled token.

Why llguidance: it is a Rust library with no torch dependency (xgrammar pins torch; outlines-core
precomputes an index per schema, seconds for a large one), compiles a JSON schema lazily in
milliseconds, and computes one token mask in tens of microseconds on CPU (benchmarks/RESULTS.md,
"Structured outputs"). Its tokenizer is built from our `tokenizers` backend's JSON, so the mask
speaks exactly the ids the model samples.

Isolation: a `Constraint` is one request's matcher. `mask` rewrites only the logits row it is given
(the sequence's own row, cloned), so requests in one batched step never see each other's masks.

    spec = GrammarSpec("json_schema", json.dumps(schema))
    compiler.check(spec)                         # ValueError with llguidance's message if invalid
    c = compiler.constraint(spec)                # per request
    logits = c.mask(logits); tok = sample(logits); c.advance(tok)
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..invariants import check

KINDS = ("json_object", "json_schema", "regex", "lark")

# No free whitespace between JSON tokens: a small model at temperature 0 otherwise tends to emit
# newlines forever inside an object; ", " and ": " keep the output readable.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. kind: one of KINDS; source: the JSON schema (as JSON
    text), the regex or the Lark grammar ("" for json_object)."""
    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")

    def llguidance(self) -> str:
        """The grammar in llguidance's serialized form. Does not validate (GrammarCompiler.check does)."""
        import llguidance as llg
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        return llg.LLMatcher.grammar_from_lark(self.source)


class GrammarCompiler:
    """Per engine: the llguidance tokenizer (built once, lazily: ~0.2 s for a 49k vocabulary) and
    constraint factory. Thread-safe: routes validate on their threads while the worker builds matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        """tokenizer: ternlm.text.tokenizer.Tokenizer (its `backend` is a tokenizers.Tokenizer).
        vocab_size: the model's logits width (may exceed the tokenizer's: padding rows, always masked)."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll = None
        self._lock = threading.Lock()

    def _lltok(self):
        with self._lock:
            if self._ll is None:
                import llguidance as llg
                tok = self._tokenizer
                stops = sorted(t for t in tok.stop_ids if t < tok.vocab_size)
                self._ll = llg.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                           eos_token=stops or tok.eos_id)
            return self._ll

    def check(self, spec: GrammarSpec) -> None:
        """Raises ValueError naming what is wrong with the grammar (bad schema, bad regex)."""
        import llguidance as llg
        try:
            grammar = spec.llguidance()
        except Exception as e:   # a schema llguidance cannot read at all
            raise ValueError(str(e)) from None
        err = llg.LLMatcher.validate_grammar(grammar, self._lltok())
        if err:
            raise ValueError(err)

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh matcher for one request. Raises ValueError for an invalid grammar."""
        import llguidance as llg
        m = llg.LLMatcher(self._lltok(), spec.llguidance(), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return Constraint(m, self._lltok().vocab_size, self.vocab_size)


class Constraint:
    """One request's grammar state. Not thread-safe (the worker is its only user)."""

    def __init__(self, matcher: Any, tok_vocab: int, vocab_size: int):
        self._m = matcher
        self._tok_vocab = tok_vocab
        self.vocab_size = vocab_size
        self._bits = np.zeros((tok_vocab + 31) // 32, dtype=np.int32)   # one bit per tokenizer id

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool: the ids the grammar allows next. Does not advance the matcher."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        check(not self._m.is_error(), f"grammar matcher failed: {self._m.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self._tok_vocab]
        out = torch.zeros(self.vocab_size, dtype=torch.bool)   # ids past the tokenizer: never allowed
        out[:self._tok_vocab] = torch.from_numpy(bits.astype(np.bool_))
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (vocab,) fp32 -> a new tensor with disallowed ids at -inf (the input is untouched)."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token_id: int) -> None:
        """The sampled id was taken (stop ids included). Raises ValueError if the grammar rejects it
        (it cannot, when sampled from a masked row)."""
        if not self._m.consume_token(int(token_id)):
            raise ValueError(f"the grammar rejected token {token_id}: {self._m.get_error()}")

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` ids the grammar forces next from here (llguidance's fast-forward tokens: the bytes no
        choice can avoid, tokenized canonically; a keyword, a key, `":`), or []. Does not advance the matcher.
        A guess as good as certain, not a promise: another tokenization of the same bytes stays allowed, which is
        why they are only ever drafts ([FORCED-DRAFT], drafter.py), verified like any other."""
        ids = self._m.compute_ff_tokens() if limit > 0 else []
        return [int(t) for t in ids[:limit] if 0 <= int(t) < self.vocab_size]

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()


def json_schema_source(schema: Any) -> str:
    """The schema as compact JSON text (what GrammarSpec carries)."""
    return json.dumps(schema, separators=(",", ":"))
