"""What this CPU runs well: its ISA class, the compute dtype `--dtype auto` picks, the kernel path, and
the kernel fingerprint that keeps one machine's KV out of another's cache.

Why a class and not "x86-64": oneDNN dispatches by ISA at run time, so the same torch wheel computes
bf16 with AMX tiles, AVX-512 BF16 dot products, emulated bf16 on plain AVX-512, or not at all (on
AVX2-only CPUs `mkldnn._reorder_linear_weight` refuses bf16). Measured with `ternlm bench dtype`
(smollm2-135m, 2 threads, 1,024-token prefill / 64 decoded tokens) on one 2-core AMD EPYC (Zen 4,
AVX-512 BF16), oneDNN capped with ONEDNN_MAX_CPU_ISA to stand in for the other classes
(benchmarks/RESULTS.md):

    class         bf16 prefill / decode   fp32 prefill / decode   auto
    avx512_bf16   729 / 27.1 tok/s        502 / 19.7 tok/s        bfloat16 (1.45x / 1.37x)
    avx512        258 / 17.4 tok/s        492 / 18.7 tok/s        float32  (bf16 emulated: 0.53x prefill)
    avx2          refused by oneDNN       480 / 15.3 tok/s        float32
    amx           oneDNN's AMX bf16 is not batch-invariant        float32; ternlm caps oneDNN at
                                                                  AVX512_CORE_BF16 on AMX CPUs (below),
                                                                  which makes them avx512_bf16

A bf16 path without oneDNN (plain F.linear) would run, but its rows are not batch-invariant, and reuse
must never change an answer: so `--dtype bfloat16` where oneDNN has no bf16 is refused with one line.

AMX: oneDNN's AMX bf16 kernels are not batch-invariant (measured on a 2-core Sapphire Rapids: a packed
bf16 projection's rows changed with the rows beside them, 1,536 -> 576 from M = 150 on, 4,864 -> 896
at M = 2..32, and with the thread count), while its AVX-512 BF16 kernels are, there too. So on a CPU
with AMX, `import ternlm` caps oneDNN at AVX512_CORE_BF16 (cap_onednn_below_amx) unless
ONEDNN_MAX_CPU_ISA is already set; a user who lifts the cap gets the `amx` class, where `auto` picks
float32 and `--dtype bfloat16` is refused. (ternlm's own quantized kernels may use AMX tiles:
kernels/qamx.c, opt-in.)

Bits: the same kernels give the same bits; different ISA classes, oneDNN caps or torch versions may
not (RESULTS.md: one-row bf16 projections differ between an AMX and an AVX-512 host). The fingerprint
names all of them and goes into every cache namespace. Thread count is left out: the packed
projections gave identical bits with 1 and 2 threads on every model shape (measured, fp32 and bf16;
oneDNN's AMX bf16 kernels did not, which is one more reason for the cap).
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

# ISA flags (as /proc/cpuinfo names them) that decide which kernels run; others are not reported.
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
         "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")

# Ordered from least to most capable; a oneDNN ISA cap lowers the class, never raises it.
CLASSES = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
_CLASS_TEXT = {"baseline": "no AVX2", "avx2": "AVX2", "avx512": "AVX-512 without BF16",
               "avx512_bf16": "AVX-512 BF16", "amx": "AMX"}
# ONEDNN_MAX_CPU_ISA values (oneDNN's documented names) -> the highest class they allow.
_ONEDNN_CAP = {"SSE41": "baseline", "AVX": "baseline", "AVX2": "avx2", "AVX2_VNNI": "avx2",
               "AVX2_VNNI_2": "avx2", "AVX512_CORE": "avx512", "AVX512_CORE_VNNI": "avx512",
               "AVX512_CORE_BF16": "avx512_bf16", "AVX512_CORE_FP16": "avx512_bf16",
               "AVX10_1_512": "avx512_bf16"}   # AMX names, AVX10_2, ALL, DEFAULT: no cap

# [ONEDNN-CAP] the cap for CPUs with AMX (see the module docstring)
AMX_CAP = "AVX512_CORE_BF16"

DTYPE_NAMES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


class UnsupportedDtypeError(ValueError):
    """The requested compute dtype has no exact (batch-invariant) kernel on this CPU."""


@dataclass(frozen=True)
class CpuInfo:
    model: str                      # "AMD EPYC 9R14", as the OS names it
    flags: frozenset[str]           # the subset of FLAGS this CPU has
    onednn_max_isa: str             # ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), "" when unset
    torch_version: str              # "2.13.0+cpu"
    torch_capability: str           # ATen's vectorised-kernel level: "AVX512" | "AVX2" | "DEFAULT" ...
    mkldnn: bool                    # torch was built with oneDNN
    mkldnn_bf16: bool               # oneDNN runs bf16 here (torch's own check; it honours the ISA cap)
    amx_granted: bool = True        # the OS lets this process use AMX tiles (Linux grants them on request,
                                    # arch_prctl ARCH_REQ_XCOMP_PERM; kernels before 5.16 or a VM that hides
                                    # XTILEDATA do not): without it oneDNN computes bf16 without AMX

    @property
    def isa_class(self) -> str:
        """One of CLASSES: what the flags offer (AMX only where the OS grants it: oneDNN falls back to
        AVX-512 BF16 otherwise, other bits under the same flags), lowered to the oneDNN ISA cap if one
        is set."""
        f = self.flags
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f
        if {"amx_tile", "amx_bf16"} <= f and avx512 and self.amx_granted:
            cls = "amx"
        elif avx512 and "avx512_bf16" in f:
            cls = "avx512_bf16"
        elif avx512:
            cls = "avx512"
        elif {"avx2", "fma"} <= f:
            cls = "avx2"
        else:
            cls = "baseline"
        cap = _ONEDNN_CAP.get(self.onednn_max_isa.upper())
        if cap is not None and CLASSES.index(cap) < CLASSES.index(cls):
            cls = cap
        return cls

    @property
    def describe(self) -> str:
        """Short human text for logs: "AVX2", "AVX-512 BF16 (oneDNN capped at AVX2)"."""
        text = _CLASS_TEXT[self.isa_class]
        return f"{text} (ONEDNN_MAX_CPU_ISA={self.onednn_max_isa})" if self.onednn_max_isa else text


@dataclass(frozen=True)
class DtypeChoice:
    """What `--dtype X` resolves to on a CPU. `kernel`: "onednn-packed" (weights reordered once for
    oneDNN, batch-invariant rows) | "torch-linear" (plain F.linear: not batch-invariant)."""
    dtype: str                      # "float32" | "bfloat16" | "float16"
    kernel: str
    reason: str                     # why, for the log line and `ternlm info`
    requested: str = "auto"

    @property
    def log_line(self) -> str:
        return f"dtype {self.requested} -> {self.dtype}, {self.kernel} ({self.reason})"


def choose_dtype(requested: str, cpu: CpuInfo) -> DtypeChoice:
    """Resolve a --dtype value for this CPU. Pure. Raises ValueError for an unknown name and
    UnsupportedDtypeError for bfloat16 where oneDNN has no bf16 (one line, says what to use)."""
    name = DTYPE_NAMES.get(requested)
    if name is None:
        raise ValueError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPE_NAMES)}")
    cls, why = cpu.isa_class, f"cpu: {cpu.describe}"
    packed = "onednn-packed" if cpu.mkldnn else "torch-linear"
    if cls == "amx":      # oneDNN uncapped on an AMX CPU: its bf16 rows change with M (module docstring)
        if name == "bfloat16":
            raise UnsupportedDtypeError(
                f"--dtype bfloat16 with oneDNN's AMX kernels is not batch-invariant (a row's bits change with "
                f"the rows beside it), so reuse could change answers; unset ONEDNN_MAX_CPU_ISA (ternlm then "
                f"caps it at {AMX_CAP}, exact) or use --dtype auto or float32")
        if name == "auto":
            return DtypeChoice("float32", packed, f"{why}, AMX bf16 is not batch-invariant", requested)
    if name == "auto":
        if cls == "avx512_bf16" and cpu.mkldnn_bf16:
            return DtypeChoice("bfloat16", packed, f"{why}, native bf16", requested)
        no_bf16 = "bf16 emulated, slower than fp32" if cpu.mkldnn_bf16 else "no native bf16"
        return DtypeChoice("float32", packed, f"{why}, {no_bf16}", requested)
    if name == "bfloat16":
        if not (cpu.mkldnn and cpu.mkldnn_bf16):
            raise UnsupportedDtypeError(
                f"--dtype bfloat16 needs a CPU on which oneDNN runs bf16 (AVX-512 BW/VL/DQ, AVX-NE-CONVERT "
                f"or AMX); this one has {cpu.describe}: use --dtype auto or float32")
        return DtypeChoice("bfloat16", packed, why, requested)
    if name == "float16":
        return DtypeChoice("float16", "torch-linear", f"{why}, no packed fp16 kernel: reuse exact to ~1e-6 only",
                           requested)
    return DtypeChoice("float32", packed, why, requested)


def kernel_fingerprint(choice: DtypeChoice, cpu: CpuInfo) -> str:
    """Everything besides weights, config and token ids that the KV's bits depend on."""
    return (f"dtype={choice.dtype};kernel={choice.kernel};torch={cpu.torch_version};"
            f"aten={cpu.torch_capability};isa={cpu.isa_class}")


def cap_onednn_below_amx(cpuinfo: tuple[str, set[str]] | None = None) -> bool:
    """[ONEDNN-CAP] On a CPU with AMX, set ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in this process's environment
    unless a cap is already set (a user's choice wins; then the class may be `amx`, see choose_dtype).
    Must run before oneDNN's first primitive, which reads the variable once: ternlm/__init__.py calls it
    at import, before torch. Returns whether it set the cap. cpuinfo: (model, flags), default this CPU's."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"):
        return False
    found = cpuinfo if cpuinfo is not None else _proc_cpuinfo()
    if found is None or not {"amx_tile", "amx_bf16"} <= found[1]:
        return False
    os.environ["ONEDNN_MAX_CPU_ISA"] = AMX_CAP
    return True


def _proc_cpuinfo() -> tuple[str, set[str]] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


@functools.lru_cache(maxsize=1)
def probe() -> CpuInfo:
    """This process's CPU, read once (/proc/cpuinfo where there is one, torch's cpuinfo elsewhere).
    Imports torch. Side effect, where the CPU has AMX: asks the OS for AMX tiles for this process (as
    oneDNN does on its first bf16 product), to learn whether it may use them."""
    import torch
    found = _proc_cpuinfo()
    if found is not None and found[1]:
        model, flags = found
    else:   # not Linux: ask torch's cpuinfo (coarser)
        model, flags = platform.processor() or platform.machine(), set()
        if torch.cpu._is_avx2_supported():
            flags |= {"avx2", "fma"}
        if torch.cpu._is_avx512_supported():
            flags |= {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
        if torch.cpu._is_avx512_bf16_supported():
            flags.add("avx512_bf16")
        if torch.cpu._is_amx_tile_supported():
            flags |= {"amx_tile", "amx_bf16"}
    mkldnn = bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    return CpuInfo(
        model=model,
        flags=frozenset(f for f in FLAGS if f in flags),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "",
        torch_version=torch.__version__,
        torch_capability=torch.backends.cpu.get_cpu_capability(),
        mkldnn=mkldnn,
        mkldnn_bf16=mkldnn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        amx_granted=("amx_tile" not in flags) or bool(torch.cpu._init_amx()),
    )
