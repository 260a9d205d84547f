"""Compile the native kernels (qlanes.c, qamx.c, attention.c, layer.c, ...: SOURCES) for this CPU on first use; load them with ctypes.

Why at run time, not at install: the kernel is compiled with -march=native, so the binary must be
built on the CPU it runs on (users' CPUs differ: AMX, AVX-512, AVX2-only), and pip's wheel for this
package stays pure Python. A C compiler (`cc`, or $CC) is the only requirement; without one, or if the
build fails (or TERNLM_NATIVE=0), `load()` says why and the callers fall back to torch: dense
weights, and models/llama.py's torch attention.

The shared object goes to $XDG_CACHE_HOME/ternlm/kernels/kernels-<digest>.so, the digest covering the
sources, the compiler's version, the flags and the CPU flags, so an upgrade or another host rebuilds
instead of loading a stale binary. The directory is ours only (0700): code loaded from a directory
another user can write into would run as us.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ternlm")

SOURCES = [Path(__file__).with_name(n) for n in ("qlanes.c", "qamx.c", "qint8.c", "attention.c", "layer.c", "convert.c",
                                                     "recurrent.c", "sample.c")]
HEADERS = [Path(__file__).with_name(n) for n in ("vec.h", "layouts.h")]   # in the digest, not on the command line
# TERNLM_KERNEL_MARCH: build for a lesser ISA than the host's (tests run the AVX2 and scalar paths on
# an AVX-512 machine with x86-64-v3 / x86-64); it is part of the digest, so builds never mix.
MARCH = os.environ.get("TERNLM_KERNEL_MARCH", "native")
# TERNLM_KERNEL_MTUNE: another CPU's tuning (tests build as a Zen 3 host's -march=native does, on any
# host: the tuning changes code shapes, never the ISA); in the digest too.
MTUNE = os.environ.get("TERNLM_KERNEL_MTUNE")


def _layout_table() -> tuple[list[tuple], list[tuple], list[tuple]]:
    """layouts.h's LAYOUT, MODE and RAW_TYPE lines, as written: the one list of the native weight layouts
    (the C files build their entries and layer.c's table from the same lines, so the codes cannot drift)."""
    text = Path(__file__).with_name("layouts.h").read_text()
    layouts = [(n, int(c), fam, int(bits), tuple(map(int, flags.split(","))))
               for n, c, fam, bits, flags in re.findall(
                   r"^\s*LAYOUT\((\w+),\s*(\d+),\s*(\w+),\s*(\d+),\s*([01](?:,\s*[01])*)\)", text, re.M)]
    modes = [(n, int(c)) for n, c in re.findall(r"^\s*MODE\((\w+),\s*(\d+)\)", text, re.M)]
    raw = [(n, int(c), lay, m) for n, c, lay, m in re.findall(
        r"^\s*RAW_TYPE\((\w+),\s*(\d+),\s*(\w+),\s*(\w+),\s*\d+\)", text, re.M)]
    if not layouts or not modes or any(len(f) != len(modes) for *_, f in layouts):
        raise RuntimeError("kernels/layouts.h: no LAYOUT / MODE lines, or a row's flags do not match the modes")
    return layouts, modes, raw


_LAYOUTS, _MODES, _RAW_TYPES = _layout_table()


def _variants(family: str) -> tuple[tuple[str, str], ...]:
    """(layout, scale mode) of every tq_<layout>_<mode>_mm entry of one family, in the header's order."""
    return tuple((name, mode) for name, _, fam, _, flags in _LAYOUTS if fam == family
                 for (mode, _), on in zip(_MODES, flags) if on)


# qlanes.c's (layout, scale mode) variants: 16 weight rows interleaved (models/qweight.py to_lanes), every
# product but the opt-in AMX build's
LANES_VARIANTS = _variants("LANES")
# qamx.c's: the row layouts, on AMX tiles (TERNLM_AMX=1 on a CPU with them; elsewhere stubs nothing calls)
AMX_VARIANTS = _variants("ROW")
# qint8.c's: the integer products (int8 activations) on the int layouts (models/qweight.py to_int8), the
# default for quantized weights (--activations auto)
INT8_VARIANTS = _variants("INT")
MM_VARIANTS = LANES_VARIANTS + AMX_VARIANTS + INT8_VARIANTS
# -ffp-contract=off [BATCH-INVARIANT]: GCC may fuse a written `a * b + c` into one FMA or not, by code
# shape and by -mtune: with -march=native on an AVX2-only Zen 3 (znver3 tuning avoids FMA chains) the
# decode and prefill shapes of the attention's loops fused different products, and a request's logits
# changed with its neighbours in the batch (tests/test_batching.py failed there; x86-64-v3 builds of the
# same source passed; test_zen3_tuned_build_is_batch_invariant reproduces it on any AVX2 host). Off,
# every fused product is one the source writes (vec.h fman, intrinsics) and the rest round twice,
# whatever the shape or the tuning. (Either half alone passed that test: belt and braces.)
FLAGS = ["-O3", f"-march={MARCH}", *([f"-mtune={MTUNE}"] if MTUNE else []), "-ffp-contract=off", "-fopenmp",
         "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi"]


@dataclass(frozen=True)
class Kernels:
    """The loaded kernels. `isa`: the vector path the compiler took (amx | avx512 | avx2 | scalar);
    `digest`: identifies the binary (part of the KV cache's kernel fingerprint). isa "amx": the AVX-512
    build whose quantized products run on AMX tiles (qamx.c, TERNLM_AMX=1)."""
    lib: ctypes.CDLL
    isa: str
    digest: str
    activations: str = "fp32"     # "int8": quantized projections take qint8.c's integer products (weights.py)

    @property
    def int8(self) -> bool:
        """Whether quantized projections multiply int8 activations (qint8.c; layouts models/qweight.to_int8)."""
        return self.activations == "int8"

    @property
    def int8_path(self) -> str:
        """qint8.c's integer path in this build: avx512-vnni | avx512bw | avx2 | scalar (the same bits on each)."""
        return self.lib.tq_int8_path().decode()

    @property
    def lanes(self) -> bool:
        """Whether GGML's types take qlanes.c's layouts (models/qweight.py to_lanes): everywhere but the
        opt-in AMX build, whose products are all qamx.c's (row layouts)."""
        return self.isa != "amx"

    def attention(self, q: int, T: int, H: int, KV: int, D: int, k: int, v: int, cap: int, start: int,
                  out: int, ldo: int, threads: int) -> None:
        """Raw pointers: see attention.c. Releases the GIL while it runs."""
        if self.lib.tq_attention(q, T, H, KV, D, k, v, cap, start, out, ldo, threads) != 0:
            raise ValueError(f"native attention: unsupported shape (heads {H}/{KV}, head_dim {D})")

    def attention_segments(self, segs: int, nseg: int, layer: int, q: int, M: int, H: int, KV: int, D: int,
                           out: int, threads: int, kv_mode: int = 0, window: int = 0) -> None:
        """Raw pointers: see attention.c (tq_attention_segments_window; kv_mode: the caches' row format,
        kv/kvtype.py KVType.mode; window > 0: each row reads only its last `window` keys). Releases the GIL
        while it runs."""
        if self.lib.tq_attention_segments_window(segs, nseg, layer, q, M, H, KV, D, out, threads, kv_mode,
                                                 window) != 0:
            raise ValueError(f"native attention: unsupported shape (heads {H}/{KV}, head_dim {D}, rows {M}, "
                             f"kv mode {kv_mode})")

    def kv_q8_rows(self, x: "torch.Tensor", keys: bool) -> "torch.Tensor":
        """(n, D) fp32 -> (n, D + D/16) uint8 q8_0 rows (attention.c tq_kv_q8_rows: the same bytes layer.c
        writes), keys rotated [KV-ROTATE]. A new tensor; x is only read."""
        import torch
        x = x.to(torch.float32).contiguous()
        n, D = x.shape
        out = torch.empty(n, D + D // 16, dtype=torch.uint8)
        if self.lib.tq_kv_q8_rows(x.data_ptr(), n, D, out.data_ptr(), int(keys)) != 0:
            raise ValueError(f"q8_0 KV: head_dim {D} is not a multiple of 32")
        return out

    def kv_rotate_q(self, q: "torch.Tensor") -> "torch.Tensor":
        """(n, D) fp32 query rows -> H q / 32 per block of 32, as attention.c reads a q8_0 cache [KV-ROTATE]."""
        import torch
        q = q.to(torch.float32).contiguous()
        out = torch.empty_like(q)
        self.lib.tq_kv_rotate_q(q.data_ptr(), q.shape[0], q.shape[1], out.data_ptr())
        return out

    def mm(self, fmt: str, mode: str, x: int, M: int, K: int, codes: int, high: int, scale: int, bias: int,
           sup: int, N: int, y: int, ldy: int, threads: int) -> None:
        """Raw pointers: see qlanes.c (qamx.c for the row layouts). (fmt, mode): one of LANES_VARIANTS, or of
        AMX_VARIANTS where isa is "amx"; high: the q5 high bits, sup: the K-quant super-block scales (0 where
        unused). Releases the GIL while it runs."""
        getattr(self.lib, f"tq_{fmt}_{mode}_mm")(x, M, K, codes, high, scale, bias, sup, N, y, ldy, threads)

    def convert_lanes(self, qtype: int, src: int, src_rows: int, order: int, rows: int, cols: int, codes: int,
                      high: int, scale: int, bias: int, sup: int, threads: int) -> int:
        """Raw pointers: see convert.c (GGML blocks -> a lanes layout; order 0: rows as they are).
        0, or convert.c's negative reason. Releases the GIL while it runs."""
        return self.lib.tq_convert_lanes(qtype, src, src_rows, order, rows, cols, codes, high, scale, bias, sup,
                                         threads)

    def pointwise(self, op: str, x: "torch.Tensor", u: "torch.Tensor | None" = None) -> "torch.Tensor":
        """recurrent.c's tq_pointwise: op "sigmoid" | "silu" | "softplus" | "silu_mul" (silu(x) * u) of fp32 x
        -> a new fp32 tensor of x's shape, every element's bits its own (no vector/tail split). Pure."""
        import torch
        x = x.float().contiguous()
        u = None if u is None else u.float().contiguous()
        y = torch.empty_like(x)
        self.lib.tq_pointwise(("sigmoid", "silu", "softplus", "silu_mul").index(op), x.data_ptr(),
                              0 if u is None else u.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
        return y

    def convert_int(self, qtype: int, src: int, src_rows: int, order: int, rows: int, cols: int, codes: int,
                    high: int, scale: int, bias: int, sup: int, threads: int) -> int:
        """convert_lanes into the int layout (convert.c's tq_convert_int: to_int8(to_lanes(...))'s bits)."""
        return self.lib.tq_convert_int(qtype, src, src_rows, order, rows, cols, codes, high, scale, bias, sup,
                                       threads)

    def sample(self, x: int, V: int, temperature: float, top_k: int, top_p: float, min_p: float, u: float,
               e: int, w: int, cand: int, bsum: int, probs: int = 0) -> int:
        """Raw pointers: see sample.c (one row -> a token id, -1 when no token has probability). Releases the GIL while it runs."""
        return self.lib.tq_sample(x, V, temperature, top_k, top_p, min_p, u, e, w, cand, bsum, probs or None)

    def convert_finite(self, qtype: int, src: int, nblocks: int) -> int:
        """convert.c's tq_convert_finite: 1 when every fp16 d (and m) of the blocks is finite, 0 if not, -1
        for a type it does not cover."""
        return self.lib.tq_convert_finite(qtype, src, nblocks)


# TqPart.layout / .mode codes (layer.c's MM table: [layout][mode]), from layouts.h
LAYOUT_CODE = {name: code for name, code, fam, *_ in _LAYOUTS if fam != "RAW"}
MODE_CODE = dict(_MODES)
# the row layouts' codes (qamx.c): an expert in one has no range kernel (layer.c's experts take the others)
ROW_LAYOUTS = frozenset(code for _, code, fam, *_ in _LAYOUTS if fam == "ROW")
# [RAW] layouts.h's RAW layout: an expert matrix's GGML blocks as read, its mode field the GGML type (RAW_TYPES:
# Q4_K 12, Q5_K 13, Q6_K 14), multiplied with its int layout's bits by qint8.c's tq_int8_raw_range (experts only)
(RAW_LAYOUT,) = (code for _, code, fam, *_ in _LAYOUTS if fam == "RAW")
RAW_TYPES = tuple(code for _, code, *_ in _RAW_TYPES)


class Part(ctypes.Structure):
    """One matrix of a projection as the C side takes it: layer.c's TqPart, qint8.c's IPart (every field 8 bytes)."""
    _fields_ = [("layout", ctypes.c_int64), ("mode", ctypes.c_int64), ("n", ctypes.c_int64),
                ("codes", ctypes.c_void_p), ("high", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("sup", ctypes.c_void_p)]


@dataclass(frozen=True)
class Unavailable:
    """Why there are no native kernels here (no compiler, failed build, ...): one line for logs."""
    reason: str


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _cpu_flags() -> str:
    from ..cpu import probe
    return " ".join(sorted(probe().flags))


def _digest(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    for part in (version, " ".join(FLAGS), _cpu_flags()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _build(cc: str, out: Path) -> None:
    """Compile into a temporary file beside `out`, then rename: concurrent first uses (several
    servers starting at once) never load a half-written library. The sources compile side by side
    (one compiler each, then one link): the first use waits for the slowest file (~18 s here), not
    for their sum (~31 s)."""
    fd, tmp = tempfile.mkstemp(prefix=out.name, suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            compile_flags = [f for f in FLAGS if f != "-shared"]
            objs = [Path(objdir) / f"{src.stem}.o" for src in SOURCES]
            logs = [obj.with_suffix(".log") for obj in objs]
            procs = []
            try:
                for src, obj, log_path in zip(SOURCES, objs, logs):
                    with open(log_path, "w") as err:    # a file, not a pipe: a chatty compiler never blocks
                        procs.append(subprocess.Popen([cc, *compile_flags, "-c", str(src), "-o", str(obj)],
                                                      stdout=subprocess.DEVNULL, stderr=err))
                for p, log_path in zip(procs, logs):
                    _check(cc, p.wait(timeout=300), log_path.read_text())
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            r = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, objs), "-lm"], capture_output=True, text=True,
                               timeout=300)
            _check(cc, r.returncode, r.stderr)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check(cc: str, returncode: int, stderr: str) -> None:
    if returncode != 0:
        raise RuntimeError(f"{cc} failed: {stderr.strip().splitlines()[-1] if stderr.strip() else returncode}")


@functools.lru_cache(maxsize=1)
def load() -> Kernels | Unavailable:
    """The native kernels, built on first use. Side effects: may create $XDG_CACHE_HOME/ternlm/kernels
    (0700) and write one .so there; loads it into the process."""
    from ..kv.disk import secure_dir
    from ..paths import cache_root
    if os.environ.get("TERNLM_NATIVE", "1") == "0":
        return Unavailable("native kernels turned off (TERNLM_NATIVE=0)")
    cc = _compiler()
    if cc is None:
        return Unavailable(f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH")
    try:
        digest = _digest(cc)
        root = cache_root() / "kernels"
        secure_dir(root)
        path = root / f"kernels-{digest}.so"
        if not path.exists():
            log.info("building quantized kernels for this CPU: %s %s", cc, " ".join(FLAGS))
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return Unavailable(f"building the native kernels failed: {e}")
    p, i = ctypes.c_void_p, ctypes.c_int64
    for name in (f"tq_{fmt}_{mode}_mm" for fmt, mode in MM_VARIANTS):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [p, i, i, p, p, p, p, p, i, p, i, ctypes.c_int], None
    lib.tq_attention.argtypes = [p, i, i, i, i, p, p, i, i, p, i, ctypes.c_int]
    lib.tq_attention_segments.argtypes = [p, i, i, p, i, i, i, i, p, ctypes.c_int, ctypes.c_int]
    lib.tq_attention_segments.restype = ctypes.c_int
    lib.tq_attention_segments_window.argtypes = [p, i, i, p, i, i, i, i, p, ctypes.c_int, ctypes.c_int, i]
    lib.tq_attention_segments_window.restype = ctypes.c_int
    lib.tq_attention.restype = ctypes.c_int
    lib.tq_kv_q8_rows.argtypes = [p, i, i, p, ctypes.c_int]
    lib.tq_kv_rotate_q.argtypes = [p, i, i, p]
    lib.tq_kv_rotate_q.restype = None
    lib.tq_kv_q8_rows.restype = ctypes.c_int
    lib.tq_layer.argtypes = [p, p, i, p, i, p, ctypes.c_int]
    lib.tq_layer.restype = ctypes.c_int
    lib.tq_layer_attn.argtypes = [p, p, i, p, i, p, ctypes.c_int]
    lib.tq_layer_attn.restype = ctypes.c_int
    lib.tq_moe_route.argtypes = [p, i, i, p, i, i, i, p, p, ctypes.c_int]
    lib.tq_moe_route.restype = ctypes.c_int
    lib.tq_moe_experts.argtypes = [p, i, i, i, i, p, p, i, p, p, i, p, p, i, ctypes.c_int]
    lib.tq_moe_experts.restype = ctypes.c_int
    lib.tq_moe_sum.argtypes = [p, p, p, i, i, i, ctypes.c_int]
    lib.tq_moe_shared.argtypes = [p, i, i, p, p, p, p, ctypes.c_int]
    lib.tq_moe_shared.restype = ctypes.c_int
    lib.tq_moe_sum.restype = None
    lib.tq_lanes_range.argtypes = [i, i, p, i, i, p, p, p, p, p, i, i, i, p, i]
    lib.tq_lanes_range.restype = ctypes.c_int
    lib.tq_convert_lanes.argtypes = [ctypes.c_int, p, i, p, i, i, p, p, p, p, p, ctypes.c_int]
    lib.tq_convert_lanes.restype = ctypes.c_int
    lib.tq_convert_int.argtypes = lib.tq_convert_lanes.argtypes
    lib.tq_convert_int.restype = ctypes.c_int
    lib.tq_convert_finite.argtypes = [ctypes.c_int, p, i]
    lib.tq_convert_finite.restype = ctypes.c_int
    lib.tq_isa.restype = ctypes.c_char_p
    lib.tq_int8_path.restype = ctypes.c_char_p
    lib.tq_int8_quant.argtypes = [p, i, i, p, p, p]
    lib.tq_int8_quant.restype = None
    lib.tq_delta_rule.argtypes = [p, p, p, p, p, i, i, i, i, i, i, p, p, ctypes.c_int]
    lib.tq_delta_rule.restype = ctypes.c_int
    lib.tq_pointwise.argtypes = [ctypes.c_int, p, p, p, i, ctypes.c_int]
    lib.tq_pointwise.restype = None
    lib.tq_ssd_scan.argtypes = [p, p, p, p, p, p, i, i, i, i, i, p, p, ctypes.c_int]
    lib.tq_ssd_scan.restype = ctypes.c_int
    lib.tq_int8_parts.argtypes = [p, i, i, p, i, p, i, ctypes.c_int]
    lib.tq_int8_parts.restype = ctypes.c_int
    lib.tq_int8_prepare.argtypes = [p, i, i, i, p, p, p, p]
    lib.tq_int8_prepare.restype = None
    lib.tq_int8_range.argtypes = [i, i, p, p, p, p, i, i, p, p, p, p, p, i, i, i, p, i]
    lib.tq_int8_range.restype = ctypes.c_int
    lib.tq_int8_raw_range.argtypes = [i, p, p, p, p, i, i, p, i, i, i, p, i]
    lib.tq_int8_raw_range.restype = ctypes.c_int
    lib.tq_convert_int_block.argtypes = [ctypes.c_int, p, i, p, p, p, p, p, p]
    lib.tq_convert_int_block.restype = ctypes.c_int
    lib.tq_amx_init.restype = ctypes.c_int
    lib.tq_sample.argtypes = [p, i, ctypes.c_float, i, ctypes.c_float, ctypes.c_float, ctypes.c_double, p, p, p, p, p]
    lib.tq_sample.restype = i
    # [AMX] TERNLM_AMX=1 on a build with AMX tiles: ask the OS for them once, before any product; granted,
    # every quantized product takes qamx.c (isa "amx", other bits than "avx512": the isa is in the cache
    # namespace). Opt-in: faster prefill, slower decode (qamx.c, benchmarks/RESULTS.md).
    amx = os.environ.get("TERNLM_AMX", "0") == "1" and lib.tq_amx_init() == 1
    return Kernels(lib, "amx" if amx else lib.tq_isa().decode(), digest)
