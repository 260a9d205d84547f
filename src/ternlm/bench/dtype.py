"""`ternlm bench dtype`: float32 against bfloat16 on this CPU (interleaved A B A B, medians, ratios)
and what `--dtype auto` picks here: the figures behind cpu.py's choice table. The other ISA classes
can be measured on one host by capping oneDNN: `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`
(an AVX2-only CPU: bf16 is refused there and only float32 runs) or `ONEDNN_MAX_CPU_ISA=AVX512_CORE`
(AVX-512 without BF16)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..cpu import choose_dtype, probe
from .common import command_line, median, write_json
from .engine import _prompt_ids, _ternlm


def run(args) -> dict:
    """Loads one engine per runnable dtype; prints a table; writes dtype-<model>-<isa class>.json."""
    from ..engine.core import Engine
    torch.set_num_threads(args.threads)
    cpu = probe()
    runnable = []
    for name in ("float32", "bfloat16"):
        try:
            choose_dtype(name, cpu)
            runnable.append(name)
        except ValueError as e:
            print(f"{name}: {e}")
    engines = {d: Engine.load(args.model, dtype=d, prefix_reuse=False) for d in runnable}
    ids = _prompt_ids(next(iter(engines.values())), args.prompt_tokens)
    rows: dict[str, list[tuple[float, float]]] = {d: [] for d in engines}
    for r in range(args.repeats + 1):            # round 0 warms up, untimed
        for d, e in engines.items():             # A B A B: drift on a shared machine hits both alike
            got = _ternlm(e, ids, args.decode_tokens, ids, [])   # decode after the whole prompt
            if r:
                rows[d].append(got)
    med = {d: {"prefill_tok_s": median([p for p, _ in v]), "decode_tok_s": median([x for _, x in v])}
           for d, v in rows.items()}
    auto = choose_dtype("auto", cpu)
    res = {"command": command_line(), "model": args.model, "threads": args.threads, "repeats": args.repeats,
           "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
           "cpu": {"model": cpu.model, "isa_class": cpu.isa_class, "onednn_max_isa": cpu.onednn_max_isa,
                   "torch_capability": cpu.torch_capability},
           "auto": auto.dtype, "auto_reason": auto.reason, "median": med, "samples": rows}
    print(f"\n{cpu.model}, class {cpu.describe}, {args.threads} threads, median of {args.repeats}:")
    for d, m in med.items():
        print(f"  {d:9s} prefill {m['prefill_tok_s']:7.1f} tok/s ({args.prompt_tokens} tokens)   "
              f"decode {m['decode_tok_s']:6.1f} tok/s")
    if len(med) == 2:
        res["bf16_over_fp32"] = {k: med["bfloat16"][k] / med["float32"][k] for k in med["float32"]}
        print(f"  bf16 / fp32: prefill x{res['bf16_over_fp32']['prefill_tok_s']:.2f}, "
              f"decode x{res['bf16_over_fp32']['decode_tok_s']:.2f}")
    print(f"  --dtype auto -> {auto.dtype} ({auto.reason})")
    path = write_json(Path(args.out), f"dtype-{Path(str(args.model)).name}-{cpu.isa_class}.json", res)
    print(f"wrote {path}")
    return res
