"""`ternlm info`: what a bug report needs. CPU model and the ISA flags that matter, torch and its CPU
capability, what each --dtype resolves to here (or why it is refused), the native kernels (built on
first use, as a server would: whether they build here is part of a bug report), threads, cache
directories. Loads no model."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def gather() -> dict:
    """Everything `ternlm info` prints, as plain data. Imports torch; may build the native kernels
    into the cache (kernels/build.py), nothing else."""
    import torch

    from . import __version__
    from .cpu import CpuInfo, choose_dtype, kernel_fingerprint, probe
    from .kernels.build import Unavailable
    from .kernels.build import load as load_kernels
    from .models.registry import cache_root
    from .server.cli import default_kv_dir

    cpu: CpuInfo = probe()
    dtypes = {}
    for name in ("auto", "float32", "bfloat16", "float16"):
        try:
            c = choose_dtype(name, cpu)
            dtypes[name] = {"dtype": c.dtype, "kernel": c.kernel, "reason": c.reason,
                            "fingerprint": kernel_fingerprint(c, cpu)}
        except ValueError as e:
            dtypes[name] = {"refused": str(e)}
    k = load_kernels()
    native = ({"available": False, "reason": k.reason} if isinstance(k, Unavailable)
              else {"available": True, "isa": k.isa, "digest": k.digest})
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "ternlm": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": cpu.model, "cores_usable": affinity, "isa_class": cpu.isa_class,
                "flags": sorted(cpu.flags), "onednn_max_isa": cpu.onednn_max_isa or None},
        "torch": {"version": cpu.torch_version, "cpu_capability": cpu.torch_capability,
                  "onednn": cpu.mkldnn, "onednn_bf16": cpu.mkldnn_bf16},
        "dtype": dtypes,
        "native_kernels": native,
        "threads": {"torch": torch.get_num_threads(),
                    **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if os.environ.get(k)}},
        "cache": {"models": str(cache_root() / "models"), "kv": default_kv_dir()},
    }


def _print(info: dict, out) -> None:
    c, t = info["cpu"], info["torch"]
    lines = [
        f"ternlm {info['ternlm']} · Python {info['python']} · {info['platform']}",
        f"cpu       {c['model']} · {c['cores_usable']} usable cores",
        f"isa       class {c['isa_class']} · flags {' '.join(c['flags']) or '(none that matter)'}"
        + (f" · ONEDNN_MAX_CPU_ISA={c['onednn_max_isa']}" if c["onednn_max_isa"] else ""),
        f"torch     {t['version']} · cpu capability {t['cpu_capability']} · oneDNN "
        f"{'yes' if t['onednn'] else 'no'} · oneDNN bf16 {'yes' if t['onednn_bf16'] else 'no'}",
    ]
    for name, d in info["dtype"].items():
        label = f"--dtype {name}"
        lines.append(f"{label:18s}refused: {d['refused']}" if "refused" in d
                     else f"{label:18s}{d['dtype']}, {d['kernel']} ({d['reason']})")
    n = info["native_kernels"]
    lines.append("native    " + (f"{n['isa']} build {n['digest']} (attention; --weights gguf, the default for GGUF models)"
                                 if n["available"] else f"unavailable: {n['reason']} (torch attention; dense weights only)"))
    th = info["threads"]
    lines.append("threads   torch " + str(th["torch"]) + "".join(f" · {k}={v}" for k, v in th.items() if k != "torch"))
    lines.append(f"cache     models {info['cache']['models']} · kv {info['cache']['kv']}")
    attn = f"native:{n['isa']}:{n['digest']}" if n["available"] else "torch"
    # --weights auto on a GGUF model: gguf (float32 activations) where the kernels built, else dense (weights.py)
    weights = f"gguf:{n['isa']}:{n['digest']}" if n["available"] else "dense"
    fp = info["dtype"]["float32" if n["available"] else "auto"].get("fingerprint", "-")
    lines.append(f"kernel fingerprint (auto, a GGUF model): {fp};weights={weights};attention={attn};"
                 f"kv={'float16' if n['available'] else 'float32'}")
    print("\n".join(lines), file=out)


def cmd_info(args) -> int:
    info = gather()
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print(info, sys.stdout)
    return 0


def add_info_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="CPU, torch, dtype choices, threads, cache dirs (for bug reports)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    return p
