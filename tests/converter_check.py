"""Checks tests/hybrid_to_gguf.py against llama.cpp's own converter, tensor by tensor: a script, not a test (the
tests read nothing outside the repository; this reads the converter's source, llama-cpp-python's sdist).

    python tests/converter_check.py /path/to/llama.cpp-0.3.36-*/src        # prints one line a case, then ALL EQUAL

For each case (the tests' tiny qwen35 and qwen35moe, f32 and Q8_0): the transformers model saved as a folder, the
converter run on it (--no-mtp), our writer run on a copy, and both files compared: every metadata key but the
tokenizer's and general.*, every tensor's name, type, shape and bytes. The converter's pre-tokenizer table does
not know the tests' vocabulary, so its lookup is answered "qwen2" (the tokenizer is not what is checked).
Exit status 1 when anything differs.
"""
from __future__ import annotations

import copy
import subprocess
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

sys.path.insert(0, str(Path(__file__).parent))
from hybrid_to_gguf import write_qwen35_gguf  # noqa: E402
from test_hybrid import hf_qwen35  # noqa: E402
from test_hybrid_moe import hf_qwen35moe  # noqa: E402
from test_loaders import _save_tokenizer  # noqa: E402

_RUN = """import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _kv(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("tokenizer.", "general.", "GGUF."))}


def compare(ours: Path, theirs: Path) -> list[str]:
    """What differs between two GGUF files (metadata but the tokenizer's and general.*; tensors)."""
    a, b = GGUFReader(ours), GGUFReader(theirs)
    diffs = [f"metadata {k}: ours {_kv(a).get(k)!r}, converter {_kv(b).get(k)!r}"
             for k in sorted(set(_kv(a)) | set(_kv(b))) if _kv(a).get(k) != _kv(b).get(k)]
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    diffs += [f"tensor {n} only in {'ours' if n in ta else 'the converter'}" for n in sorted(set(ta) ^ set(tb))]
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        same = x.data.tobytes() == y.data.tobytes()
        if (x.tensor_type, x.shape.tolist()) != (y.tensor_type, y.shape.tolist()) or not same:
            diffs.append(f"tensor {n}: ours {x.tensor_type.name} {x.shape.tolist()}, converter "
                         f"{y.tensor_type.name} {y.shape.tolist()}, bytes equal {same}")
    return diffs


def main(src: str) -> int:
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name, hf in (("qwen35", hf_qwen35(seed=3)), ("qwen35moe", hf_qwen35moe(seed=3))):
            folder = Path(tmp) / name
            hf.save_pretrained(folder)
            _save_tokenizer(folder)
            for outtype, quant in (("f32", None), ("q8_0", QT.Q8_0)):
                theirs, ours = Path(tmp) / f"{name}-{outtype}-converter.gguf", Path(tmp) / f"{name}-{outtype}.gguf"
                subprocess.run([sys.executable, "-c", _RUN, src, str(folder), "--no-mtp", "--outtype", outtype,
                                "--outfile", str(theirs)], check=True, capture_output=True)
                write_qwen35_gguf(copy.deepcopy(hf), ours, quant)
                diffs = compare(ours, theirs)
                print(f"{name} {outtype}: {len(GGUFReader(ours).tensors)} tensors, "
                      f"{'equal' if not diffs else f'{len(diffs)} differences'}")
                for d in diffs:
                    print("   ", d)
                failed |= bool(diffs)
    print("DIFFERENT" if failed else "ALL EQUAL")
    return int(failed)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
