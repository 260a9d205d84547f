"""Write a quantized GGUF's weights dequantized to F32 into a new GGUF with the same metadata and tokenizer.

The dense reference for llama.cpp's own quality figures (issue 46): `llama-perplexity --kl-divergence-base`
on this file saves the dense model's log-probabilities, and `--kl-divergence` on the quantized file compares
with them ("Same top p" = top-token agreement). Every tensor is dequantized with llama.cpp's own gguf-py
(`gguf.quants.dequantize`), the package from the llama-cpp-python sdist that builds our llama.cpp peer
(scripts/build-llamacpp --src; its gguf-py/ is put first on sys.path), so the F32 values are exactly GGML's.

    python benchmarks/dequant_gguf.py IN.gguf OUT.gguf [--llama-src DIR]

Streams one tensor at a time (the 1.5B's F32 file is ~6 GiB; only one dequantized tensor is held).
Changes only general.file_type (to ALL_F32) and the tensor types; keys and their order are kept.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _gguf_py(src: Path | None) -> None:
    """Put llama.cpp's gguf-py (the peer's own source: `src`, else scripts/build-llamacpp --src's, which fetches the
    sdist on first use) first on sys.path."""
    if src is None:
        out = subprocess.run([str(ROOT / "scripts" / "build-llamacpp"), "--src"], capture_output=True, text=True,
                             check=True)
        src = Path(out.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(src / "gguf-py"))


def dequantize_file(src: Path, dst: Path) -> int:
    """Write dst: src's keys (file type set to ALL_F32) and every tensor as F32. Returns the tensor count."""
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.ALIGNMENT):
            continue                         # the header's own fields; the writer adds the architecture
        if name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for t in reader.tensors:                # shape: GGML order (ne0 first); numpy's is reversed
        shape = tuple(int(n) for n in reversed(t.shape))
        writer.add_tensor_info(t.name, shape, np.dtype(np.float32), 4 * int(t.n_elements), gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
        writer.write_tensor_data(np.ascontiguousarray(dense.reshape(shape)))
    writer.close()
    return len(reader.tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--llama-src", type=Path, help="llama.cpp's source (default: scripts/build-llamacpp --src's)")
    args = ap.parse_args()
    _gguf_py(args.llama_src)
    n = dequantize_file(args.src, args.dst)
    print(f"wrote {args.dst}: {n} tensors as F32 ({args.dst.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
