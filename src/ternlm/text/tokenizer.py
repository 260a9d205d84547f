"""Text <-> token ids for a model, built from GGUF metadata or a Hugging Face tokenizer folder.

One class, ``Tokenizer``, wraps a ``tokenizers.Tokenizer`` (Rust, fast) that this module assembles
from the vocabulary the file describes, so that ids match what llama.cpp produces for the same file
(one deliberate exception, where we side with the model's own tokenizer.json, is noted at the
regexes below):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. The text is split by the regexes that
  ``tokenizer.ggml.pre`` names (llama.cpp's llama-vocab.cpp keeps one list per pre type, applied one
  after another), bytes are spelled in GPT-2's printable alphabet, then the file's merges apply.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE. Spaces become U+2581 ("▁"), a "▁" is
  put in front of every run of text (``add_space_prefix``), pieces merge by score (highest first),
  and characters the vocabulary lacks fall back to ``<0xNN>`` byte tokens.

In both, tokens typed CONTROL (3), USER_DEFINED (4) or UNKNOWN (2) are matched whole in the text
before anything else, as llama.cpp does with ``parse_special``; BOS/EOS are added by ``encode`` only
when the model asks for them (``add_bos_token``/``add_eos_token``), like a Hugging Face tokenizer.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

# Token types as llama.cpp / gguf-py number them (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn in common chat formats. llama.cpp treats them as end-of-generation by name
# (and as control tokens even when a converter forgot to type them so); we do the same.
STOP_TOKEN_NAMES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")

SPM_SPACE = "\u2581"  # "▁": SentencePiece's visible space

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, by llama.cpp's `tokenizer.ggml.pre` names. Each family is a list of
# regexes applied in turn: every piece the first one cuts is cut again by the next.
# The contractions are written (?i:'s|...) as in the models' own tokenizer.json files. llama.cpp
# spells them '[sS]... because its regex engine lacks (?i:); the two differ only where Unicode case
# folding matters: "'\u017f" (long s) is a contraction here and in Hugging Face, not in llama.cpp.
# ---------------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_EACH_DIGIT = r"\p{N}"  # smollm/starcoder: every digit is its own piece, before the GPT-2 split


@dataclass(frozen=True)
class _PreSpec:
    splits: tuple[str, ...]     # regexes applied in order (see above)
    ignore_merges: bool = False  # llama3: a whole piece that is itself a token is taken without merging


_PRE_FAMILIES: dict[str, _PreSpec] = {
    "gpt2": _PreSpec((_GPT2_SPLIT,)),
    "smollm": _PreSpec((_EACH_DIGIT, _GPT2_SPLIT)),
    "qwen2": _PreSpec((_QWEN2_SPLIT,)),
    "llama-bpe": _PreSpec((_LLAMA3_SPLIT,), ignore_merges=True),
}
# Other names llama.cpp maps to the same regex list (and the same ignore_merges).
_PRE_ALIASES: dict[str, str] = {
    "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
    "smollm": "smollm", "starcoder": "smollm", "refact": "smollm", "codeshell": "smollm",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2",
    "llama-bpe": "llama-bpe", "llama3": "llama-bpe", "llama-v3": "llama-bpe",
}


def supported_pre_types() -> list[str]:
    """Every `tokenizer.ggml.pre` value this module can tokenize (for error messages and docs)."""
    return sorted(_PRE_ALIASES)


def _pre_spec(pre: str | None) -> _PreSpec:
    if pre not in _PRE_ALIASES:
        what = "has no tokenizer.ggml.pre" if pre is None else f"names pre-tokenizer {pre!r}"
        raise ValueError(f"the GGUF {what}, which this tokenizer does not support; "
                         f"supported: {', '.join(supported_pre_types())}")
    return _PRE_FAMILIES[_PRE_ALIASES[pre]]


# ---------------------------------------------------------------------------------------------
# GPT-2's byte alphabet: every byte gets a printable character, so BPE can work on strings.
# Printable Latin-1 bytes stand for themselves; the other 68 take code points 256, 257, ... in
# byte order.
# ---------------------------------------------------------------------------------------------

def _byte_alphabet() -> dict[int, str]:
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


# ---------------------------------------------------------------------------------------------
# Builders: GGUF metadata -> tokenizers.Tokenizer.
# ---------------------------------------------------------------------------------------------

def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise ValueError(f"duplicate token in vocabulary: {t!r} has ids {vocab[t]} and {i}")
        vocab[t] = i
    return vocab


def _split_merge(merge: str) -> tuple[str, str] | None:
    # The separator is the first space after position 0 (a merge may start with a literal space).
    pos = merge.find(" ", 1)
    return (merge[:pos], merge[pos + 1:]) if pos > 0 else None


def _byte_level_backend(tokens: list[str], merges: list[str], pre: _PreSpec) -> _Backend:
    vocab = _vocab_dict(tokens)
    pairs = []
    for m in merges:
        pair = _split_merge(m)
        # tokenizers refuses merges whose parts or result are not tokens. Converted vocabularies
        # have none (every merge result is a token); we drop such merges rather than fail.
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges, highest-scoring result first.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the best-scoring
    token; a BPE model whose merge list is ranked by that score does the same join at every step.
    (Only ties between different tokens of equal score may be broken differently: SentencePiece
    takes the leftmost pair, BPE the lower rank. Real vocabularies have distinct scores.)
    """
    ranked = []
    for i, t in enumerate(tokens):
        if types[i] != NORMAL or len(t) < 2:
            continue
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            # Only ordinary pieces join: byte/control tokens are never the result of a merge.
            if li is not None and ri is not None and types[li] == NORMAL and types[ri] == NORMAL:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _spm_backend(tokens: list[str], types: list[int], scores: list[float],
                 add_space_prefix: bool, unk_id: int | None) -> _Backend:
    vocab = _vocab_dict(tokens)
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, types, scores, vocab),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = _Backend(model)
    # The normalizer runs on each stretch of text between special tokens, so every stretch gets its
    # own "▁" prefix: that is what llama.cpp (and SentencePiece on each chunk) does.
    replace = normalizers.Replace(" ", SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(SPM_SPACE), replace])
                          if add_space_prefix else replace)
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the prefix space of the first piece
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(backend: _Backend, tokens: list[str], types: list[int]) -> set[int]:
    """Make control/unknown tokens (special) and user-defined tokens (not special, so kept by
    ``decode(skip_special_tokens=True)``) match whole in text. Returns the ids of all of them."""
    special, plain = [], []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (CONTROL, UNKNOWN) or (ty == NORMAL and t in STOP_TOKEN_NAMES):
            special.append(i)
        elif ty == USER_DEFINED:
            plain.append(i)
    # normalized=False: matched against the raw text, before "▁" replacement or byte spelling.
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in plain])
    for i in special + plain:
        # They are all in the model's vocabulary already, so tokenizers must reuse the file's id.
        if backend.token_to_id(tokens[i]) != i:
            raise ValueError(f"special token {tokens[i]!r} (id {i}) did not keep its id")
    return set(special) | set(plain)


_GGUF_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)


def _read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """The tokenizer keys of an open gguf.GGUFReader as plain Python values (lists for arrays)."""
    out = {}
    for key in _GGUF_KEYS:
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    return out


# ---------------------------------------------------------------------------------------------
# The tokenizer.
# ---------------------------------------------------------------------------------------------

class Tokenizer:
    """Encode/decode with Hugging Face semantics over a vocabulary read from GGUF or HF files.

    Attributes: ``vocab_size``, ``bos_id``/``eos_id`` and their texts ``bos_token``/``eos_token``
    (None when the model has none), ``add_bos``/``add_eos`` (what ``encode`` adds), ``stop_ids``
    (EOS plus end-of-turn tokens), ``chat_template`` (jinja source or None), ``backend`` (the
    ``tokenizers.Tokenizer``), ``byte_fallback`` (True when <0xNN> byte tokens exist).
    Immutable after construction; safe to share between threads.
    """

    def __init__(self, backend: _Backend, *, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool, stop_ids: Iterable[int], chat_template: str | None,
                 special_ids: Iterable[int], piece_style: str) -> None:
        if add_bos and bos_id is None:
            raise ValueError("add_bos_token is true but the model has no BOS token")
        if add_eos and eos_id is None:
            raise ValueError("add_eos_token is true but the model has no EOS token")
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id = bos_id, eos_id
        self.bos_token = backend.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = backend.id_to_token(eos_id) if eos_id is not None else None
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        self.stop_ids = frozenset(stop_ids)
        self.chat_template = chat_template
        self._special_ids = frozenset(special_ids)
        self._piece_style = piece_style  # "byte_level" | "spm" | "text": how id_to_piece_bytes spells
        # SentencePiece-style vocabularies spell unknown characters as <0xNN> byte tokens; decode
        # turns each run of them into text as a whole (the streaming detokenizer needs to know).
        self.byte_fallback = piece_style == "spm"

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"add_bos={self.add_bos}, stops={sorted(self.stop_ids)})")

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> "Tokenizer":
        """From an open ``gguf.GGUFReader`` or a path to a .gguf file (opened read-only, memory-mapped
        for the duration of this call)."""
        if hasattr(reader_or_path, "fields"):
            return cls.from_gguf_metadata(_read_gguf_metadata(reader_or_path))
        from gguf import GGUFReader
        return cls.from_gguf_metadata(_read_gguf_metadata(GGUFReader(os.fspath(reader_or_path), "r")))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF key/values already read into a mapping (``tokenizer.ggml.*`` names, arrays as
        lists). Lets tests build small vocabularies without writing a file."""
        model = meta.get("tokenizer.ggml.model")
        tokens = list(meta["tokenizer.ggml.tokens"])
        n = len(tokens)
        # llama.cpp renames empty tokens so that every token has a distinct, non-empty text.
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [NORMAL] * n]
        if len(types) < n:
            raise ValueError(f"token_type has {len(types)} entries for {n} tokens")

        def token_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            value = default if value is None else int(value)
            return value if value is not None and 0 <= value < n else None

        if model == "gpt2":
            pre = meta.get("tokenizer.ggml.pre")
            spec = _pre_spec(pre)
            merges = list(meta.get("tokenizer.ggml.merges") or [])
            if not merges:
                raise ValueError("byte-level BPE vocabulary without tokenizer.ggml.merges")
            backend = _byte_level_backend(tokens, merges, spec)
            bos_id, eos_id, unk_id = token_id("bos_token_id", None), token_id("eos_token_id", None), None
            # llama.cpp turns BOS on for llama3 vocabularies unless the file says otherwise.
            add_bos_default = _PRE_ALIASES[pre] == "llama-bpe" and bos_id is not None
            style = "byte_level"
        elif model == "llama":
            scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * n]
            unk_id = token_id("unknown_token_id", 0)
            add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
            backend = _spm_backend(tokens, types, scores, True if add_prefix is None else bool(add_prefix),
                                   unk_id)
            # llama.cpp's defaults for SentencePiece files that do not say otherwise.
            bos_id, eos_id = token_id("bos_token_id", 1), token_id("eos_token_id", 2)
            add_bos_default = True
            style = "spm"
        else:
            raise ValueError(f"tokenizer model {model!r} is not supported; supported: "
                             f"'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)")

        special_ids = _add_special_tokens(backend, tokens, types)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        add_eos = meta.get("tokenizer.ggml.add_eos_token")
        vocab = {t: i for i, t in enumerate(tokens)}
        stops = {eos_id, token_id("eot_token_id", None), token_id("eom_token_id", None)}
        stops |= {vocab[name] for name in STOP_TOKEN_NAMES if name in vocab}
        stops.discard(None)
        return cls(backend, vocab_size=n, bos_id=bos_id, eos_id=eos_id,
                   add_bos=add_bos_default if add_bos is None else bool(add_bos),
                   add_eos=False if add_eos is None else bool(add_eos),
                   stop_ids=stops, chat_template=meta.get("tokenizer.chat_template"),
                   special_ids=special_ids, piece_style=style)

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """From a Hugging Face folder: tokenizer.json, plus tokenizer_config.json for BOS/EOS,
        add_bos_token/add_eos_token and chat_template (or chat_template.jinja), plus
        generation_config.json's eos_token_id for extra stop ids. Reads files only."""
        folder = Path(path)
        backend = _Backend.from_file(str(folder / "tokenizer.json"))
        cfg = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        bos_text = _token_text(cfg.get("bos_token", special_map.get("bos_token")))
        eos_text = _token_text(cfg.get("eos_token", special_map.get("eos_token")))
        bos_id = backend.token_to_id(bos_text) if bos_text else None
        eos_id = backend.token_to_id(eos_text) if eos_text else None

        # Without an explicit flag, Hugging Face adds whatever tokenizer.json's post-processor adds.
        # We add BOS/EOS ourselves (encode never runs the post-processor), so find out what it adds.
        bare = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        add_bos, add_eos = cfg.get("add_bos_token"), cfg.get("add_eos_token")
        if add_bos is None:
            add_bos = bos_id is not None and len(full) > len(bare) and full[0] == bos_id
        if add_eos is None:
            add_eos = eos_id is not None and len(full) > len(bare) and full[-1] == eos_id

        stops = {eos_id}
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        stops |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        stops |= {backend.token_to_id(name) for name in STOP_TOKEN_NAMES}
        stops.discard(None)

        decoder = json.loads(backend.to_str()).get("decoder") or {}
        decoder_text = json.dumps(decoder)
        style = "byte_level" if "ByteLevel" in decoder_text else "spm" if "ByteFallback" in decoder_text \
            else "text"
        return cls(backend, vocab_size=backend.get_vocab_size(with_added_tokens=True), bos_id=bos_id,
                   eos_id=eos_id, add_bos=bool(add_bos), add_eos=bool(add_eos), stop_ids=stops,
                   chat_template=_hf_chat_template(folder, cfg),
                   special_ids=backend.get_added_tokens_decoder().keys(), piece_style=style)

    # ---- encode / decode ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their single ids.
        With ``add_special_tokens``, BOS/EOS are added only where the model asks for them."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_id)
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Incomplete UTF-8 (e.g. half an emoji) decodes to U+FFFD, as in HF."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_piece_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token contributes to the text (llama.cpp's token_to_piece, without
        the first-token space stripping): special tokens give their text, byte tokens one byte."""
        text = self.backend.id_to_token(int(token_id))
        if text is None:
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {self.vocab_size})")
        if token_id in self._special_ids:
            return text.encode("utf-8")
        if self._piece_style == "byte_level":
            if all(c in _CHAR_TO_BYTE for c in text):
                return bytes(_CHAR_TO_BYTE[c] for c in text)
            return text.encode("utf-8")  # not spelled in the byte alphabet (e.g. padding entries)
        if self._piece_style == "spm":
            byte = _BYTE_TOKEN.fullmatch(text)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        return text.encode("utf-8")

    def token_to_id(self, text: str) -> int | None:
        """Id of the token spelled ``text`` in the vocabulary (byte-level spelling for BPE)."""
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's spelling of a token (e.g. "Ġhello", "▁hello"), None when out of range."""
        return self.backend.id_to_token(int(token_id))

    def is_byte_token(self, token_id: int) -> bool:
        """True for SentencePiece byte-fallback tokens ("<0x0A>"), which stand for one raw byte."""
        if not self.byte_fallback:
            return False
        text = self.backend.id_to_token(int(token_id))
        return text is not None and _BYTE_TOKEN.fullmatch(text) is not None

    def is_special(self, token_id: int) -> bool:
        """True for control, unknown and user-defined tokens (those matched whole in text)."""
        return token_id in self._special_ids


# ---------------------------------------------------------------------------------------------
# Hugging Face folder helpers.
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config writes special tokens either as plain strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _hf_chat_template(folder: Path, cfg: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
