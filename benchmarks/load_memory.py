"""Where a GGUF load's resident set goes: baseline, peak and steady RSS above it, against the file and
the KV budget (issue 35's targets: peak <= 1.15x, steady <= 1.1x (file + KV budget)), and a breakdown
of the steady set: weights the model holds (by layout, beside GGML's bytes for the same tensors), dense
tensors, RoPE tables, the KV allocated so far, GGUF pages still mapped, and the rest (heap, tokenizer,
code). Also a timeline of RSS (anon / file) sampled during the load with the loader's log lines, so
the peak can be placed in a phase.

    .venv/bin/python benchmarks/load_memory.py -m qwen2.5-coder-0.5b [--weights gguf] [--ctx N] [--json F]
        [--trim-each] [--drop-pages-each] [--slabs] [--tokenizer-first]   (TERNLM_MALLOC_TUNE=0 in the environment: glibc's defaults)

--trim-each and --drop-pages-each measure a loader change without making it: they wrap
ternlm.linear.qweight.from_gguf/to_lanes (looked up at call time by models/gguf.py's load_gguf) so
that after each tensor is converted, glibc's free heap pages go back (malloc_trim(0)) and/or the
tensor's pages of the GGUF mapping are dropped from the resident set (madvise MADV_DONTNEED: clean
private file pages, re-read from the page cache if touched again). --slabs converts each matrix 4,096
rows at a time straight into its preallocated lanes layout (GGML blocks -> row layout -> lanes per slab,
so neither the whole row layout nor the conversion's full-size temporaries ever exist), falling back
to the whole matrix where a slab's scale mode differs from the first's or there is no lanes layout;
not for llama files (their q/k rows are permuted between the two steps). --tokenizer-first builds the
tokenizer as the file is opened and then drops the reader's parsed vocabulary and merges (GGUFReader
keeps two numpy views per string: ~118 MiB for qwen2.5's 151,936 tokens and 151,387 merges) before any
weight is converted, instead of holding them through the weights and building the tokenizer last.
The weights and the tokenizer come out the same.

Measured (qwen2.5-coder-0.5b Q4_K_M, 468.6 MiB file, KV budget 384 MiB at 32,768 tokens, --weights gguf,
above a 228 MiB baseline, commit bac0619): peak +1,858 MiB (3.97x file), steady +566 (1.21x file);
--slabs 1,219; --slabs --drop-pages-each 774; all three 647 (1.38x file, 0.76x file + KV), the steady
set the same. The peak's parts: the full-matrix conversion of the two 151,936-row matrices (token_embd
Q8_0: +680 MiB of int16 and uint8 temporaries; output Q5_0: +800 MiB of nibble/bit temporaries, and
to_lanes' list of slabs plus its torch.cat copy), the GGUF's pages (RssFile grows to the whole file by
the end of the weights), the reader's parsed vocabulary (+118 MiB). The steady set above the file:
Q6_K's q6x16 (53.4 MiB for GGML's 40.9: a byte a 6-bit code then; 4 + 1 + 1 bits, GGML's bytes, since 6ea8fef), RoPE tables at the model's full context
(16 MiB), the tokenizer (~37 MiB) and ~34 MiB of code, grammar tables and heap.

One model per process (VmHWM is the process's; it is reset before the load anyway). Reads only:
the model file is opened a second time after the measurement for its tensor types.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

import ternlm.engine.core  # noqa: F401  imported before the baseline: the baseline holds code, no model
from ternlm.bench.common import bench_model, kv_budget_bytes, measure_load, proc_status

MIB = 1 << 20


class Timeline(logging.Handler):
    """RSS (anon, file) every 20 ms from a thread, and the loader's log lines with their times."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.t0, self.samples, self.events = time.perf_counter(), [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def emit(self, record):
        self.events.append((time.perf_counter() - self.t0, record.getMessage()[:110]))

    def _loop(self):
        while not self._stop.is_set():
            s = proc_status()
            self.samples.append((time.perf_counter() - self.t0, s.get("RssAnon", 0) / 1024, s.get("RssFile", 0) / 1024))
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def mapped_rss_mib(path: Path) -> float:
    """RSS of this process's mappings of `path` (/proc/self/smaps): the GGUF's pages still mapped."""
    total, hit = 0, False
    target = str(path.resolve())
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:          # a mapping's header line
            hit = head[-1] == target
        elif hit and line.startswith("Rss:"):
            total += int(head[1])
    return total / 1024


def held_tensors(root) -> dict[str, int]:
    """Bytes of the distinct tensor storages reachable from `root` (the model), by kind: each
    quantized layout, "dense" (norms, biases, dense matrices), "rope" (cos/sin tables). Deduplicated
    by storage, so a tied embedding / LM head counts once."""
    from ternlm.linear.qweight import QWeight
    seen_obj, seen_store, out = set(), set(), defaultdict(int)

    def add(t: torch.Tensor, kind: str):
        key = t.untyped_storage().data_ptr()
        if key not in seen_store:
            seen_store.add(key)
            out[kind] += t.untyped_storage().nbytes()

    def walk(o, kind: str, depth: int):
        if depth > 8 or id(o) in seen_obj or isinstance(o, (str, bytes, int, float, type(None))):
            return
        seen_obj.add(id(o))
        if isinstance(o, torch.Tensor):
            add(o, kind)
        elif isinstance(o, QWeight):
            for t in (o.codes, o.scale, o.bias, o.high, o.sup):
                if t is not None:
                    add(t, o.fmt)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, kind, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, kind, depth + 1)
        elif isinstance(o, torch.nn.Module) or hasattr(o, "__dict__"):
            attrs = dict(vars(o))
            if isinstance(o, torch.nn.Module):
                attrs |= dict(o._parameters) | dict(o._buffers) | dict(o._modules)
            for k, v in attrs.items():
                walk(v, "rope" if k in ("cos", "sin") else kind, depth + 1)

    walk(root, "dense", 0)
    return dict(out)


def ggml_bytes(path: Path) -> dict[str, int]:
    """The file's tensor bytes by GGML type."""
    from gguf import GGUFReader
    out = defaultdict(int)
    for t in GGUFReader(str(path)).tensors:
        out[t.tensor_type.name] += int(t.n_bytes)
    return dict(out)


SLAB_ROWS = 4096


def _slab_convert(raw, qtype, n, k, real_from, real_lanes):
    """from_gguf + to_lanes, SLAB_ROWS rows at a time into preallocated lanes tensors; None where it
    cannot (see the module docstring)."""
    import ternlm.linear.qweight as qw
    _, block, size, _ = qw._CONVERT[qtype]
    row_bytes = k // block * size
    if n % qw.BLOCK_ROWS or n <= SLAB_ROWS:
        return None
    out, mode = None, None
    for r0 in range(0, n, SLAB_ROWS):
        r1 = min(n, r0 + SLAB_ROWS)
        part = real_lanes(real_from(raw[r0 * row_bytes:r1 * row_bytes], qtype, r1 - r0, k))
        if part is None or (mode is not None and (part.mode != mode or
                                                  (part.mode == "f16s" and not torch.equal(part.bias, out["bias"])))):
            return None
        if out is None:
            mode = part.mode
            out = {f: None if t is None else t if (f == "bias" and mode == "f16s") else
                   torch.empty((n // qw.BLOCK_ROWS, *t.shape[1:]), dtype=t.dtype)
                   for f, t in (("codes", part.codes), ("scale", part.scale), ("bias", part.bias),
                                ("high", part.high), ("sup", part.sup))}
        for f in ("codes", "scale", "bias", "high", "sup"):
            t = getattr(part, f)
            if t is not None and not (f == "bias" and mode == "f16s"):
                if out[f].dtype != t.dtype:
                    return None
                out[f][r0 // qw.BLOCK_ROWS:r1 // qw.BLOCK_ROWS] = t
    return qw.QWeight(part.fmt, out["codes"], out["scale"], out["bias"], out["high"], out["sup"])


def wrap_loader(trim_each: bool, drop_pages_each: bool, slabs: bool = False) -> None:
    """The experiments of the module docstring. Side effect: patches ternlm.linear.qweight for this process."""
    import ternlm.linear.qweight as qw
    libc = ctypes.CDLL("libc.so.6")
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, dontneed = 4096, 4                              # MADV_DONTNEED
    real_from, real_lanes = qw.from_gguf, qw.to_lanes

    def from_gguf(raw, *a, **kw):
        q = (_slab_convert(raw, *a, real_from, real_lanes) if slabs else None) or real_from(raw, *a, **kw)
        if drop_pages_each:                               # the tensor's bytes in the map: q holds copies
            start = raw.data_ptr() // page * page
            libc.madvise(start, -(-(raw.data_ptr() + raw.numel()) // page) * page - start, dontneed)
        return q

    def to_lanes(q):
        out = real_lanes(q)
        if trim_each:
            libc.malloc_trim(0)
        return out

    qw.from_gguf, qw.to_lanes = from_gguf, to_lanes


def tokenizer_first() -> None:
    """The --tokenizer-first experiment. Side effect: patches ternlm.models.gguf for this process."""
    import ternlm.models.gguf as g
    real_tokenizer = g.Tokenizer

    class Reader(g.FastGGUFReader):
        def __init__(self, path):
            super().__init__(path)
            self.tokenizer_built = real_tokenizer.from_gguf(self)
            n_tokens = len(self.fields["tokenizer.ggml.tokens"].data)
            for key in [k for k in self.fields if k.startswith("tokenizer.ggml.")]:
                del self.fields[key]
            # config_from_gguf counts the tokens (len(field.data)): a stand-in with only that
            self.fields["tokenizer.ggml.tokens"] = type("Count", (), {"data": range(n_tokens)})()
            gc.collect()

    class Tok:
        @staticmethod
        def from_gguf(reader):
            return reader.tokenizer_built

    g.FastGGUFReader, g.Tokenizer = Reader, Tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--ctx", type=int, default=None, help="KV budget context (default: the model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--trim-each", action="store_true", help="malloc_trim(0) after each tensor's lanes copy")
    ap.add_argument("--drop-pages-each", action="store_true", help="MADV_DONTNEED each converted tensor's file pages")
    ap.add_argument("--slabs", action="store_true", help="convert 4,096 rows at a time into preallocated lanes")
    ap.add_argument("--tokenizer-first", action="store_true", help="build the tokenizer, drop the parsed vocabulary, then the weights")
    args = ap.parse_args()
    if args.tokenizer_first:
        tokenizer_first()
    if args.trim_each or args.drop_pages_each or args.slabs:
        wrap_loader(args.trim_each, args.drop_pages_each, args.slabs)
    torch.set_num_threads(args.threads)
    from ternlm.engine.core import Engine
    m = bench_model(args.model)

    timeline = Timeline()
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger().addHandler(timeline)
    with timeline:
        engine, mem = measure_load(lambda: Engine.load(str(m.path), weights=args.weights, ctx=args.ctx))
    kv_budget = kv_budget_bytes(engine)
    budget = m.file_bytes + kv_budget
    gc.collect()
    held = held_tensors(engine.model)
    kv_now = sum(s.k.untyped_storage().nbytes() + s.v.untyped_storage().nbytes() for s in engine.slots)
    mapped = mapped_rss_mib(m.path)
    st = proc_status()
    ggml = ggml_bytes(m.path)

    steady = mem.steady_above_mib
    weights_mib = sum(held.values()) / MIB
    rest = steady - weights_mib - kv_now / MIB - mapped
    print(f"{m.label}: file {m.file_bytes / MIB:.1f} MiB, KV budget {kv_budget / MIB:.1f} MiB "
          f"({len(engine.slots)} slot x {engine.ctx} tokens, {engine.kv_dtype}), weights {args.weights}")
    print(f"baseline {mem.baseline_mib:.0f} MiB (Python + torch + ternlm imported); load {mem.load_s:.2f} s; "
          f"peak {mem.peak_method}")
    print(f"peak   +{mem.peak_above_mib:7.1f} MiB = {mem.peak_above_mib * MIB / budget:.3f} x (file + KV)  "
          f"{mem.peak_above_mib * MIB / m.file_bytes:.3f} x file")
    print(f"steady +{steady:7.1f} MiB = {steady * MIB / budget:.3f} x (file + KV)  "
          f"{steady * MIB / m.file_bytes:.3f} x file   (RssAnon {st.get('RssAnon', 0) / 1024:.0f}, "
          f"RssFile {st.get('RssFile', 0) / 1024:.0f} MiB absolute)")
    print("steady set above baseline:")
    for kind, b in sorted(held.items(), key=lambda kv: -kv[1]):
        print(f"  held {kind:8s} {b / MIB:8.1f} MiB")
    print(f"  KV allocated {kv_now / MIB:8.1f} MiB (of the {kv_budget / MIB:.0f} MiB budget)")
    print(f"  GGUF pages still mapped {mapped:8.1f} MiB")
    print(f"  rest (heap, tokenizer, grammar tables, kernels) {rest:8.1f} MiB")
    print("file bytes by GGML type: " + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in sorted(ggml.items())))
    peak_at = max(timeline.samples, key=lambda s: s[1] + s[2]) if timeline.samples else (0, 0, 0)
    print(f"timeline (absolute RSS, anon + file MiB; peak sample at {peak_at[0]:.2f} s: "
          f"{peak_at[1]:.0f} + {peak_at[2]:.0f}):")
    marks = sorted(timeline.events)
    step = max(1, len(timeline.samples) // 40)
    for t, anon, fil in timeline.samples[::step]:
        while marks and marks[0][0] <= t:
            print(f"  {marks[0][0]:6.2f} s  -- {marks.pop(0)[1]}")
        print(f"  {t:6.2f} s  anon {anon:7.0f}  file {fil:6.0f}")
    for t, msg in marks:
        print(f"  {t:6.2f} s  -- {msg}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": m.label, "trim_each": args.trim_each, "drop_pages_each": args.drop_pages_each,
            "slabs": args.slabs, "tokenizer_first": args.tokenizer_first,
            "malloc_tune": os.environ.get("TERNLM_MALLOC_TUNE", "1"), "file_bytes": m.file_bytes, "kv_budget_bytes": kv_budget, "ctx": engine.ctx,
            "load": mem.as_dict(), "held_bytes": held, "kv_allocated_bytes": kv_now, "mapped_gguf_mib": mapped,
            "rest_mib": rest, "ggml_bytes": ggml, "status_kib": st}, indent=2))


if __name__ == "__main__":
    main()
