"""A converter's f32 GGUF rewritten with K-quant matrices, for parity tests of files llama.cpp's converter cannot write
(its --outtype has no Q4_K; llama-quantize is not built here). Every metadata key and every other tensor is copied as
it is; each 2-D F32 matrix whose input is a multiple of 256 (a K-quant super-block) and whose name is not a norm
becomes random valid blocks of `qtype` (test_qweight.random_blocks); routers (gate_inp) stay F32, as the converter
keeps them. The test then copies the file's dequantized matrices into its transformers model (its own
reference_weights), so both sides run the same numbers.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from test_qweight import random_blocks


def requantize(src: Path, dst: Path, qtype: QT = QT.Q4_K) -> list[str]:
    """Write `src` to `dst` with its eligible matrices as random `qtype` blocks; returns their names."""
    r = GGUFReader(src)
    arch = r.get_field("general.architecture").contents()
    w = GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vtype = f.types[0]
        w.add_key_value(f.name, f.contents(), vtype, sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    replaced = []
    for i, t in enumerate(r.tensors):
        shape = [int(d) for d in reversed(t.shape.tolist())]          # (rows, input), torch's order
        if (t.tensor_type == QT.F32 and len(shape) == 2 and shape[1] % 256 == 0
                and "norm" not in t.name and "gate_inp" not in t.name and not t.name.endswith(".bias")):
            raw = random_blocks(qtype, shape[0], shape[1], seed=i)
            w.add_tensor(t.name, raw.reshape(shape[0], -1), raw_dtype=qtype)
            replaced.append(t.name)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape(shape), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return replaced
