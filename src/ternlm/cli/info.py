"""`ternlm info`: what a bug report needs. CPU model and the ISA flags that matter, torch and its CPU
capability, what each --dtype resolves to here (or why it is refused), the native kernels (built on
first use, as a server would: whether they build here is part of a bug report), threads, cache
directories. Loads no model; with `-m FILE.gguf` of a mixture of experts, reads its header for the expert
cache it would get (what is mapped from the file, what stays resident, the budget and why)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

from ..kv.kvtype import KV_CHOICES


def gather() -> dict:
    """Everything `ternlm info` prints, as plain data. Imports torch; may build the native kernels
    into the cache (kernels/build.py), nothing else."""
    import torch

    from .. import __version__
    from ..cpu import CpuInfo, choose_dtype, kernel_fingerprint, probe
    from ..kernels.build import Unavailable
    from ..kernels.build import load as load_kernels
    from ..paths import cache_root
    from ..server.cli import default_kv_dir

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
              else {"available": True, "isa": k.isa, "digest": k.digest, "int8_path": k.int8_path})
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


def experts_info(model: str, expert_cache: str = "auto", ctx: int | None = None, slots: int = 1,
                 kv_dtype: str = "auto") -> dict:
    """A GGUF's experts and the cache `Engine.load` would plan for them with these flags (--weights
    gguf sizes: quantized experts ~ their file bytes). Reads the header only. {} for a dense model."""
    import torch

    from ..engine.core import _expert_budget
    from ..models.gguf import FastGGUFReader, _expert_memory, config_from_gguf
    reader = FastGGUFReader(model)
    cfg = config_from_gguf(reader)
    if not cfg.num_experts:
        return {}
    experts, rest = _expert_memory(reader, torch.float32, keep_quantized=True)
    plans: list = []
    budget = _expert_budget(expert_cache, {"ctx": ctx, "slots": slots, "kv_dtype": kv_dtype}, plans)(cfg, experts, rest)
    return {"model": model, "arch": cfg.arch, "layers": cfg.num_layers, "experts": cfg.num_experts,
            "active": cfg.experts_per_token, "expert_bytes": experts, "resident_rest_bytes": rest,
            "streamed": budget is not None, "budget": budget, "reason": plans[0].reason}


def kv_info(model: str, kv_dtype: str = "auto", slots: int = 1, memory: str | None = None) -> dict:
    """The KV a serve of `model` would hold (fit.budget_for: auto resolved as the load resolves it): its format,
    bytes a token, and the longest context that fits for `slots` slots beside the model in `memory` (a size) or
    in this host's available memory. Reads the header only."""
    from ..engine.fit import available_memory, budget_for, longest_ctx
    from ..sizes import parse_size
    b = budget_for(model, kv_dtype=kv_dtype, slots=slots, ctx=None)
    have = available_memory() if memory is None else None
    avail = parse_size(memory) if memory is not None else have.bytes
    return {"kv_dtype": b.kv_dtype, "kv_bytes_per_token": b.kv_per_token, "slots": slots,
            "memory": avail, "memory_source": "--memory" if memory is not None else have.source,
            "longest_ctx": longest_ctx(b, avail) if avail is not None else None}


def recurrent_info(model: str, state_interval: int = 64, kv_dtype: str = "float32") -> dict:
    """A hybrid GGUF's recurrent state (kv/recurrent.py): bytes a snapshot holds, and a token's share of them at
    one snapshot every `state_interval` positions, beside the KV bytes a token takes. Reads the header only.
    {} for a model with no recurrent layer."""
    from ..engine.fit import kv_bytes_per_token
    from ..kv.recurrent import recurrent_shape
    from ..models.gguf import FastGGUFReader, config_from_gguf
    cfg = config_from_gguf(FastGGUFReader(model))
    shape = recurrent_shape(cfg)
    if shape is None:
        return {}
    from ..kv.recurrent import SNAPSHOT_BUDGET
    return {"arch": cfg.arch, "layers": cfg.num_layers, "recurrent_layers": shape.layers,
            "recurrent_kind": {"deltanet": "gated DeltaNet", "mamba2": "Mamba-2",
                               "shortconv": "gated short conv"}[cfg.kind(cfg.recurrent_layers[0])],
            "snapshot_bytes": shape.nbytes, "state_interval": state_interval, "snapshot_budget": SNAPSHOT_BUDGET,
            "snapshot_bytes_per_token": shape.nbytes / state_interval,
            "attention_layers": len(cfg.attention_layers),
            "kv_bytes_per_token": kv_bytes_per_token(len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim,
                                                     kv_dtype)}


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
    lines.append("native    " + (f"{n['isa']} build {n['digest']} (attention; --weights gguf, the default for GGUF models; "
                                 f"--activations int8 by {n['int8_path']} integer products)"
                                 if n["available"] else f"unavailable: {n['reason']} (torch attention; dense weights only)"))
    th = info["threads"]
    lines.append("threads   torch " + str(th["torch"]) + "".join(f" · {k}={v}" for k, v in th.items() if k != "torch"))
    lines.append(f"cache     models {info['cache']['models']} · kv {info['cache']['kv']}")
    attn = f"native:{n['isa']}:{n['digest']}" if n["available"] else "torch"
    # --weights auto on a GGUF model: gguf (int8 activations; a dense model: fp32) where the kernels built, else
    # dense (weights.py)
    weights = f"gguf:{n['isa']}:{n['digest']}" if n["available"] else "dense"
    fp = info["dtype"]["float32" if n["available"] else "auto"].get("fingerprint", "-")
    lines.append(f"kernel fingerprint (auto, a GGUF model): {fp};weights={weights};attention={attn};"
                 f"kv={'float16' if n['available'] else 'float32'};activations={'int8' if n['available'] else 'fp32'}")
    if e := info.get("experts"):
        from ..sizes import format_size
        how = (f"streamed: {format_size(e['expert_bytes'])} of expert slabs mapped from the file, read on demand "
               f"into a cache of {format_size(e['budget'])}" if e["streamed"]
               else f"resident: {format_size(e['expert_bytes'])} converted at load")
        lines.append(f"experts   {e['arch']} {e['layers']} layers x {e['experts']} experts ({e['active']} active) · "
                     f"{how} · {format_size(e['resident_rest_bytes'])} of other weights resident")
        lines.append(f"          expert cache: {e['reason']}")
    elif "experts" in info:
        lines.append("experts   none (a dense model)")
    if k := info.get("kv"):
        from ..sizes import format_size
        room = (f"longest context in {format_size(k['memory'])} ({k['memory_source']}), {k['slots']} slot(s) beside "
                f"the model: {k['longest_ctx']} tokens" if k["memory"] is not None else "available memory unknown")
        lines.append(f"kv        {k['kv_dtype']} · {format_size(k['kv_bytes_per_token'])} a token · {room}")
    if r := info.get("recurrent"):
        from ..sizes import format_size
        lines.append(f"recurrent {r['arch']}: {r['recurrent_layers']} of {r['layers']} layers {r.get('recurrent_kind', 'gated DeltaNet')} · "
                     f"{format_size(r['snapshot_bytes'])} a state snapshot, one every {r['state_interval']} positions "
                     f"and at each prefill's end and message start: {format_size(int(r['snapshot_bytes_per_token']))} "
                     f"a token on the grid, up to {format_size(r['snapshot_budget'])} a slot (the newest kept) · KV "
                     f"{format_size(r['kv_bytes_per_token'])} a token (the {r['attention_layers']} attention layers' "
                     f"only)")
    print("\n".join(lines), file=out)


def cmd_info(args) -> int:
    info = gather()
    if args.model:
        info["experts"] = experts_info(args.model, args.expert_cache, args.ctx, args.slots)
        info["recurrent"] = recurrent_info(args.model, args.state_interval)
        info["kv"] = kv_info(args.model, args.kv_dtype, args.slots, args.memory)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print(info, sys.stdout)
    return 0


def add_info_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="CPU, torch, dtype choices, threads, cache dirs (for bug reports)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-m", "--model", default=None, metavar="FILE.gguf",
                   help="a GGUF: the expert cache a mixture of experts would get, a hybrid model's recurrent state "
                        "bytes (reads the header only)")
    p.add_argument("--expert-cache", default="auto", metavar="SIZE", help="as serve's (auto | resident | a size)")
    p.add_argument("--ctx", type=int, default=None, help="as serve's: sizes the KV budget beside the experts")
    p.add_argument("--slots", type=int, default=1, help="as serve's: sizes the KV budget beside the experts")
    p.add_argument("--state-interval", type=int, default=64, help="as serve's: a hybrid model's snapshot grid")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_CHOICES),
                   help="as serve's: the KV format whose bytes a token and longest context are shown")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="the longest context as if this much memory were available (default: this host's)")
    p.set_defaults(func=cmd_info)
    return p
