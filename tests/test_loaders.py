"""GGUF and Hugging Face folder loaders.

Oracles we did not write: transformers' own GGUF loader (smollm2: dequantization and llama Q/K
un-permutation), transformers' save_pretrained (HF folders) and gguf.quants.dequantize (our torch
dequantizers, bit for bit). Small GGUFs written with gguf.GGUFWriter cover qwen2/qwen3 layouts,
every supported tensor type and the error paths.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter, RopeScalingType
from gguf.quants import dequantize as np_dequantize

from ternlm.models.config import SUPPORTED_ARCHS, UnsupportedModelError
from ternlm.models import gguf as ggufmod
from ternlm.models.gguf import dequantize, load_gguf, unpermute_rows
from ternlm.models.hf import load_hf_folder
from ternlm.models.registry import REGISTRY, model_path

RNG = np.random.default_rng(1234)

# Byte offsets of the fp16 scale fields in each block type: random bytes there could be NaN/inf,
# which would make "bit-exact" comparisons about NaN payloads rather than about our arithmetic.
_F16_FIELDS = {QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
               QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
_BLOCK = {QT.Q8_0: (32, 34), QT.Q4_0: (32, 18), QT.Q4_1: (32, 20), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24),
          QT.Q4_K: (256, 144), QT.Q5_K: (256, 176), QT.Q6_K: (256, 210), QT.Q2_K: (256, 84)}


def random_blocks(qtype: QT, n_blocks: int) -> np.ndarray:
    """Random GGML blocks (n_blocks, type_size) uint8 with finite fp16 scales."""
    _, type_size = _BLOCK[qtype]
    raw = RNG.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in _F16_FIELDS.get(qtype, []):
        raw[:, off:off + 2] = (RNG.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


# ---------------------------------------------------------------------------------------------
# Dequantizers against gguf.quants.dequantize, bit for bit.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", list(_F16_FIELDS), ids=lambda q: q.name)
def test_dequantizer_is_bit_exact(qtype, monkeypatch):
    monkeypatch.setattr(ggufmod, "_CHUNK_BLOCKS", 7)  # several jobs, the last one short
    block_size, _ = _BLOCK[qtype]
    raw = random_blocks(qtype, 50)
    expected = np_dequantize(raw, qtype).reshape(-1).astype(np.float32)
    got = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, 50 * block_size, torch.float32)
    assert np.array_equal(bits(got), expected.view(np.uint32))
    got_bf16 = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, 50 * block_size, torch.bfloat16)
    assert torch.equal(got_bf16, torch.from_numpy(expected).to(torch.bfloat16))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_float_types(qtype):
    values = torch.randn(96)
    stored = {QT.F32: values, QT.F16: values.half(), QT.BF16: values.bfloat16()}[qtype]
    raw = stored.view(torch.uint8) if qtype != QT.BF16 else stored.view(torch.int16).view(torch.uint8)
    got = dequantize(raw, qtype, 96, torch.float32)
    assert torch.equal(got, stored.float())


def converter_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What convert_hf_to_gguf does to llama Q/K rows (as described in its source):
    reshape(n_head, 2, rows_per_head // 2, ...).swapaxes(1, 2)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_converter():
    w = torch.randn(6 * 8, 5)   # 6 heads of 8 rows
    assert torch.equal(unpermute_rows(converter_permute(w, 6), 6), w)
    b = torch.randn(6 * 8)
    assert torch.equal(unpermute_rows(converter_permute(b, 6), 6), b)
    assert not torch.equal(converter_permute(w, 6), w)


# ---------------------------------------------------------------------------------------------
# The real smollm2 file against transformers' GGUF loader.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_path(smollm2_gguf) -> Path:
    return smollm2_gguf  # conftest: model_path("smollm2-135m"), fetched once


@pytest.fixture(scope="module")
def gguf_f32(smollm2_path):
    return load_gguf(smollm2_path, torch.float32, sha256=REGISTRY["smollm2-135m"].sha256)


@pytest.fixture(scope="module")
def smollm2_oracle(hf_smollm2) -> dict[str, torch.Tensor]:
    """conftest's transformers model, loaded by transformers' own GGUF reader and dequantizer."""
    return hf_smollm2.state_dict()


def test_smollm2_config(gguf_f32):
    c = gguf_f32.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.head_dim, c.intermediate_size) == (49152, 64, 1536)
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.qkv_bias and not c.qk_norm
    assert "lm_head.weight" not in gguf_f32.weights
    assert gguf_f32.sha256 == REGISTRY["smollm2-135m"].sha256
    assert gguf_f32.chat_template and "im_start" in gguf_f32.chat_template
    assert gguf_f32.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)  # (out, in)
    assert gguf_f32.weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_smollm2_tensors_match_transformers(gguf_f32, smollm2_oracle):
    ours = gguf_f32.weights
    assert set(ours) <= set(smollm2_oracle)
    assert set(smollm2_oracle) - set(ours) == {"lm_head.weight"}  # tied: transformers lists it anyway
    for name, tensor in ours.items():
        ref = smollm2_oracle[name]
        assert tensor.dtype == torch.float32 and tensor.shape == ref.shape, name
        assert torch.equal(tensor, ref) or (tensor - ref).abs().max().item() <= 1e-6, name


def test_smollm2_bf16_is_the_f32_load_rounded(smollm2_path, gguf_f32):
    bf16 = load_gguf(smollm2_path, torch.bfloat16, sha256=REGISTRY["smollm2-135m"].sha256)
    assert bf16.config == gguf_f32.config
    for name, tensor in bf16.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, gguf_f32.weights[name].to(torch.bfloat16)), name


def test_sha256_is_computed_when_not_given(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh hash index: really hashes
    loaded = load_gguf(smollm2_path, torch.bfloat16)
    assert loaded.sha256 == REGISTRY["smollm2-135m"].sha256
    assert (tmp_path / "ternlm" / "sha256-index.json").is_file()


def assert_same_fields(path: Path) -> None:
    """FastGGUFReader's metadata fields are the gguf package's own, part for part."""
    stock, fast = GGUFReader(path, "c"), ggufmod.FastGGUFReader(path)
    assert list(stock.fields) == list(fast.fields)
    for key, a in stock.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes()), key
        assert a.contents() == b.contents(), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in stock.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors]


def test_fast_reader_fields_equal_the_packages_smollm2(smollm2_path):
    assert_same_fields(smollm2_path)    # a 49,152-token vocabulary and its merges


def _mapped_rss(path: Path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    total, hit, target = 0, False, str(path.resolve())
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:          # a mapping's header line
            hit = head[-1] == target
        elif hit and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_dropped_pages_leave_the_resident_set_and_read_the_same(smollm2_path):
    """FastGGUFReader.drop_pages (load_gguf, after each tensor is converted): the tensors' pages leave
    the resident set, and reading them again gives the same bytes."""
    reader = ggufmod.FastGGUFReader(smollm2_path)
    tensors = [t for t in reader.tensors if t.n_bytes >= 1 << 20]
    before = [t.data.tobytes() for t in tensors]          # every page of them touched
    touched, size = _mapped_rss(smollm2_path), sum(int(t.n_bytes) for t in tensors)
    for t in tensors:
        reader.drop_pages(int(t.data_offset), int(t.n_bytes))
    assert touched - _mapped_rss(smollm2_path) >= 0.9 * size
    assert [t.data.tobytes() for t in tensors] == before


def test_fast_reader_fields_equal_the_packages_every_array_kind(tmp_path):
    path = tmp_path / "arrays.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_array("t.strings", ["", "a", "ünï", "x" * 300, "\n"])
    w.add_array("t.empty", [])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_uint32("t.scalar", 7)
    w.add_string("t.string", "solo")
    w.add_tensor("w", np.zeros((2, 3), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_fields(path)


# ---------------------------------------------------------------------------------------------
# Small GGUFs written here: qwen2/qwen3 layouts, all tensor types, error paths.
# ---------------------------------------------------------------------------------------------

def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (so the GGUF carries a real byte-level vocab)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _add_tokenizer(w: GGUFWriter, vocab: int) -> None:
    tokens = _byte_alphabet() + ["ab", "<|endoftext|>"]
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    types = [1] * vocab
    types[257] = 3  # control
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(257)
    w.add_chat_template(TEMPLATE)


class TinyGGUF:
    """Writes a small GGUF for ``arch`` and remembers what each HF tensor must load as."""

    HIDDEN, FFN, VOCAB, LAYERS, HEADS, KV_HEADS = 256, 512, 320, 2, 4, 2
    # Per layer, the type of each projection (each block type appears at least once).
    LAYER_TYPES = [
        {"attn_q": QT.F32, "attn_k": QT.F16, "attn_v": QT.Q8_0, "attn_output": QT.Q4_0,
         "ffn_gate": QT.Q4_K, "ffn_up": QT.Q5_K, "ffn_down": QT.Q6_K},
        {"attn_q": QT.BF16, "attn_k": QT.F32, "attn_v": QT.Q4_1, "attn_output": QT.Q5_0,
         "ffn_gate": QT.Q5_1, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_K},
    ]

    def __init__(self, path: Path, arch: str, *, tied: bool, head_dim: int | None = None,
                 extra_metadata=None, extra_tensors=None, layer_types=None):
        self.arch, self.tied = arch, tied
        self.head_dim = head_dim or self.HIDDEN // self.HEADS
        self.expected: dict[str, torch.Tensor] = {}
        w = GGUFWriter(path, arch)
        w.add_block_count(self.LAYERS)
        w.add_context_length(4096)
        w.add_embedding_length(self.HIDDEN)
        w.add_feed_forward_length(self.FFN)
        w.add_head_count(self.HEADS)
        w.add_head_count_kv(self.KV_HEADS)
        if head_dim is not None:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_rope_freq_base(1_000_000.0)
        w.add_layer_norm_rms_eps(1e-6)
        _add_tokenizer(w, self.VOCAB)
        for add in extra_metadata or ():
            add(w)

        q_rows, kv_rows = self.HEADS * self.head_dim, self.KV_HEADS * self.head_dim
        self._quant(w, "token_embd.weight", "model.embed_tokens.weight", (self.VOCAB, self.HIDDEN), QT.Q6_K)
        self._float(w, "output_norm.weight", "model.norm.weight", (self.HIDDEN,), QT.F32)
        if not tied:
            self._quant(w, "output.weight", "lm_head.weight", (self.VOCAB, self.HIDDEN), QT.Q5_K)
        for i, types in enumerate(layer_types or self.LAYER_TYPES):
            hf = f"model.layers.{i}."
            self._float(w, f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", (self.HIDDEN,), QT.F32)
            self._float(w, f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", (self.HIDDEN,), QT.F32)
            permute = arch == "llama"
            self._float(w, f"blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", (q_rows, self.HIDDEN),
                        types["attn_q"], heads=self.HEADS if permute else None)
            self._float(w, f"blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", (kv_rows, self.HIDDEN),
                        types["attn_k"], heads=self.KV_HEADS if permute else None)
            self._quant(w, f"blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight", (kv_rows, self.HIDDEN),
                        types["attn_v"])
            self._quant(w, f"blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight", (self.HIDDEN, q_rows),
                        types["attn_output"])
            self._quant(w, f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", (self.FFN, self.HIDDEN),
                        types["ffn_gate"])
            self._quant(w, f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", (self.FFN, self.HIDDEN),
                        types["ffn_up"])
            self._quant(w, f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", (self.HIDDEN, self.FFN),
                        types["ffn_down"])
            if arch == "qwen2":
                for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                    self._float(w, f"blk.{i}.attn_{proj}.bias", hf + f"self_attn.{proj}_proj.bias", (rows,), QT.F32)
            if arch == "qwen3":
                self._float(w, f"blk.{i}.attn_q_norm.weight", hf + "self_attn.q_norm.weight", (self.head_dim,), QT.F32)
                self._float(w, f"blk.{i}.attn_k_norm.weight", hf + "self_attn.k_norm.weight", (self.head_dim,), QT.F32)
        for name, shape, qtype in extra_tensors or ():
            self._quant(w, name, None, shape, qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    def _float(self, w, gguf_name, hf_name, shape, qtype, heads=None):
        """A float tensor whose stored values are exactly representable, so expected == HF weight."""
        value = torch.randn(shape)
        if qtype == QT.F16:
            value = value.half().float()
        elif qtype == QT.BF16:
            value = value.bfloat16().float()
        stored_value = converter_permute(value, heads) if heads else value
        if qtype == QT.F32:
            w.add_tensor(gguf_name, stored_value.numpy())
        elif qtype == QT.F16:
            w.add_tensor(gguf_name, stored_value.numpy().astype(np.float16))
        else:
            raw = stored_value.bfloat16().view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(gguf_name, raw.reshape(*shape[:-1], shape[-1] * 2), raw_dtype=QT.BF16)
        self.expected[hf_name] = value

    def _quant(self, w, gguf_name, hf_name, shape, qtype):
        """Random blocks; expected = gguf-py's own dequantization of those bytes, in (out, in)."""
        block_size, type_size = _BLOCK[qtype]
        n_blocks = int(np.prod(shape)) // block_size
        raw = random_blocks(qtype, n_blocks).reshape(*shape[:-1], shape[-1] // block_size * type_size)
        w.add_tensor(gguf_name, raw, raw_dtype=qtype)
        if hf_name is not None and qtype in _F16_FIELDS:
            self.expected[hf_name] = torch.from_numpy(np_dequantize(raw, qtype).copy()).reshape(shape)


@pytest.mark.parametrize("arch,tied,head_dim", [
    ("llama", False, None),
    ("qwen2", True, None),
    ("qwen3", True, 32),   # head_dim != hidden / heads, as in real qwen3 files
])
def test_tiny_gguf_loads_exactly(tmp_path, arch, tied, head_dim):
    path = tmp_path / f"{arch}.gguf"
    tiny = TinyGGUF(path, arch, tied=tied, head_dim=head_dim)
    loaded = load_gguf(path, torch.float32)
    c = loaded.config
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == (arch, 2, 256, 512)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, head_dim or 64)
    assert (c.vocab_size, c.rope_theta, c.max_position_embeddings) == (320, 1_000_000.0, 4096)
    assert c.tie_word_embeddings == tied
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert loaded.chat_template == TEMPLATE
    assert set(loaded.weights) == set(tiny.expected)
    for name, value in tiny.expected.items():
        assert loaded.weights[name].shape == value.shape, name
        assert np.array_equal(bits(loaded.weights[name]), bits(value)), name
    bf16 = load_gguf(path, torch.bfloat16)
    for name, value in tiny.expected.items():
        assert torch.equal(bf16.weights[name], value.to(torch.bfloat16)), name


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as err:
        load_gguf(path, torch.float32)
    assert "mamba" in str(err.value)
    for arch in SUPPORTED_ARCHS:
        assert arch in str(err.value)


def test_gguf_rope_scaling_is_read_and_unknown_kinds_rejected(tmp_path):
    """yarn/linear metadata becomes the config's Rope (parity: tests/test_arch_parity.py); a kind this
    engine does not implement is refused by name rather than run as plain RoPE."""
    path = tmp_path / "yarn.gguf"
    TinyGGUF(path, "qwen2", tied=True, extra_metadata=[lambda w: w.add_rope_scaling_type(RopeScalingType.YARN),
                                                        lambda w: w.add_rope_scaling_factor(4.0),
                                                        lambda w: w.add_rope_scaling_orig_ctx_len(1024)])
    rope = load_gguf(path, torch.float32).config.rope
    assert (rope.kind, rope.factor, rope.original_context) == ("yarn", 4.0, 1024)
    path = tmp_path / "odd.gguf"
    TinyGGUF(path, "qwen2", tied=True, extra_metadata=[lambda w: w.add_string("qwen2.rope.scaling.type", "ntk-odd")])
    with pytest.raises(UnsupportedModelError, match="rope scaling 'ntk-odd'"):
        load_gguf(path, torch.float32)


def test_gguf_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "q2k.gguf"
    types = [dict(TinyGGUF.LAYER_TYPES[0], ffn_up=QT.Q2_K), TinyGGUF.LAYER_TYPES[1]]
    TinyGGUF(path, "llama", tied=True, layer_types=types)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_up\.weight.*Q2_K"):
        load_gguf(path, torch.float32)


def test_gguf_unknown_tensor_is_rejected(tmp_path):
    path = tmp_path / "extra.gguf"
    TinyGGUF(path, "llama", tied=True, extra_tensors=[("blk.0.ffn_gate_exps.weight", (8, 256), QT.Q8_0)])
    with pytest.raises(UnsupportedModelError, match="ffn_gate_exps"):
        load_gguf(path, torch.float32)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders written by transformers.
# ---------------------------------------------------------------------------------------------

def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(200)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)


def _hf_config(arch: str, **overrides):
    import transformers as tf
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, rope_theta=500000.0)
    common.update(overrides)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[arch]
    return cls(**common)


def _save_hf_model(folder: Path, arch: str, **overrides):
    """A random-weight transformers model saved as safetensors + tokenizer; returns its state_dict."""
    import transformers as tf
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[arch]
    torch.manual_seed(0)
    model = cls(_hf_config(arch, **overrides)).float()
    with torch.no_grad():
        for p in model.parameters():  # init leaves norms at 1 and biases at 0: make every tensor distinct
            p.normal_()
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    return model.state_dict()


HF_CASES = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
}


@pytest.fixture(scope="module", params=list(HF_CASES))
def hf_folder(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(f"hf-{arch}")
    state = _save_hf_model(folder, arch, **HF_CASES[arch])
    return arch, folder, state


def test_hf_folder_loads_exactly(hf_folder):
    arch, folder, state = hf_folder
    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
    loaded = load_hf_folder(folder, torch.float32)
    c = loaded.config
    overrides = HF_CASES[arch]
    assert c.arch == arch
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (300, 64, 128, 2)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, overrides.get("head_dim", 16))
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (500000.0, 1e-6, 1024)
    assert c.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert c.qkv_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert loaded.chat_template == TEMPLATE
    assert len(loaded.sha256) == 64 and loaded.source == folder
    expected = {k: v for k, v in state.items() if not (c.tie_word_embeddings and k == "lm_head.weight")}
    assert set(loaded.weights) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded.weights[name], value), name
    bf16 = load_hf_folder(folder, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.weights.values())
    assert bf16.sha256 == loaded.sha256


def _rewrite_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    folder = tmp_path / "llama"
    _save_hf_model(folder, "llama", num_hidden_layers=1)
    return folder


def test_hf_unsupported_model_type(llama_folder):
    _rewrite_config(llama_folder, model_type="mamba", architectures=["MambaForCausalLM"])
    with pytest.raises(UnsupportedModelError) as err:
        load_hf_folder(llama_folder, torch.float32)
    assert "mamba" in str(err.value)
    for arch in SUPPORTED_ARCHS:
        assert arch in str(err.value)


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    dict(rope_scaling={"type": "llama3", "factor": 2.0}),      # llama3 without its parameters
], ids=["unknown-kind", "incomplete"])
def test_hf_unsupported_rope_scaling_is_rejected(llama_folder, changes):
    _rewrite_config(llama_folder, **changes)
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        load_hf_folder(llama_folder, torch.float32)


def test_hf_attention_output_bias_is_rejected(tmp_path):
    folder = tmp_path / "biased"
    _save_hf_model(folder, "llama", num_hidden_layers=1, attention_bias=True)  # adds o_proj.bias too
    with pytest.raises(UnsupportedModelError, match="o_proj.bias"):
        load_hf_folder(folder, torch.float32)


def test_hf_bin_only_folder_is_refused(llama_folder):
    for f in llama_folder.glob("*.safetensors"):
        f.unlink()
    (llama_folder / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(UnsupportedModelError, match=r"\.bin"):
        load_hf_folder(llama_folder, torch.float32)


# ---------------------------------------------------------------------------------------------
# Opt-in: the 491 MB qwen2.5-coder-0.5b (Q4_K/Q6_K/Q5_0/Q8_0, qwen2 biases) against transformers.
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow

def test_qwen_coder_tensors_match_transformers():
    from transformers import AutoModelForCausalLM
    path = model_path("qwen2.5-coder-0.5b", progress=False)
    ours = load_gguf(path, torch.float32, sha256=REGISTRY["qwen2.5-coder-0.5b"].sha256)
    c = ours.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("qwen2", 24, 896, 14, 2)
    assert c.qkv_bias and not c.qk_norm and c.vocab_size == 151936
    oracle = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(ours.weights) <= set(oracle)
    for name, tensor in ours.weights.items():
        assert tensor.shape == oracle[name].shape, name
        assert torch.equal(tensor, oracle[name]) or (tensor - oracle[name]).abs().max().item() <= 1e-6, name
