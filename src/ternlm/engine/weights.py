"""`--weights auto|gguf|bf16|fp32`: how the model's matrices are held and multiplied. Pure decisions.

  gguf  the GGUF file's own quantized blocks, kept quantized (models/qweight.py) and multiplied by the
        native kernels (kernels/qlanes.c; kernels/qamx.c with the opt-in TERNLM_AMX=1) with fp32 activations: 4-5-bit weights read ~2.7x fewer
        bytes per decode step than bf16. Needs a .gguf model and a C compiler (the kernel is built
        for this CPU on first use). Computes in float32.
  bf16, fp32  every matrix dequantized to that dtype, multiplied by oneDNN (linear/dense.py); the
        same as `--dtype bfloat16/float32`.
  auto  gguf where the model is a GGUF, `--dtype` is left at auto and the native kernel builds here
        (the file's own precision, held exactly); otherwise dense in the compute dtype `--dtype`
        resolves to (cpu.py), with the reason logged. Why gguf by default since the seventh kernel
        pass (benchmarks/RESULTS.md): on the AVX-512 BF16 host it decodes 3-4x faster than dense
        bf16 (smollm2 116.7 vs 38 tok/s, qwen 43.5 vs 17) and prefills within 0.6-1.2x of it (a
        4,000-token prompt faster); on hosts without native bf16 the alternative is dense fp32,
        slower at both. A user feels the whole answer: at ~100 answer tokens gguf wins every turn.
        An explicit `--dtype` keeps dense weights in that dtype (gguf computes in float32 only).

`--activations auto|int8|fp32` (issue 46): what the gguf weights multiply. int8: each row's activations
quantized to 8 bits per group of 32 and exact integer products (kernels/qint8.c: the same bits at any
batch, thread count and CPU kind, as llama.cpp's own quantized products do); fp32: the lanes kernels, every
weight exactly GGML's value times fp32 activations (the transformers-parity tests). auto: int8 for gguf
weights, but fp32 for a model under SMALL_MODEL_PARAMS parameters [SMALL-FP32]; dense weights always take their
compute dtype (int8 with dense weights is refused).

[SMALL-FP32] (issue 59, benchmarks/RESULTS.md "What int8 costs in answers"): greedy first MT-Bench turns against the
dense reference, int8 vs fp32 activations: smollm2-135m 58 vs 4 of 81 answers differ (the README's "What is the
capital of France?" answered "L'Étoile, la Marseur, ..." with int8, "Paris" with fp32), gemma3-270m 27 vs 0,
qwen2.5-coder-0.5b 29 vs 1 (rewordings, none wrong in what was read). The smallest model is the outlier (its
top-2 logit gaps are the narrowest: 96.3% next-token agreement against 97.7-98.9% for the others), and it is the
one where fp32 costs least in absolute terms (decode ~93 -> ~70 tok/s, still above llama.cpp's on that file).

The choice is part of the KV cache's kernel fingerprint: the bits of every KV position depend on it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..cpu import UnsupportedDtypeError
from ..kernels.build import Unavailable

WEIGHTS = ("auto", "gguf", "bf16", "fp32")
ACTIVATIONS = ("auto", "int8", "fp32")
SMALL_MODEL_PARAMS = 200_000_000    # [SMALL-FP32] below this, --activations auto multiplies fp32 activations
_DENSE_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}


class WeightsUnavailable(UnsupportedDtypeError):
    """`--weights gguf` cannot run here (not a GGUF model, no compiler, failed build): one line."""


@dataclass(frozen=True)
class WeightsChoice:
    mode: str                  # "gguf" | "dense"
    dtype: str                 # the `--dtype` value to resolve for activations ("auto" allowed for dense)
    reason: str
    requested: str = "auto"
    kernels: object = None     # kernels.build.Kernels when mode == "gguf" (its .activations: "int8" | "fp32")

    @property
    def activations(self) -> str:
        """What the quantized projections multiply: "int8" | "fp32" (dense weights: "fp32", their dtype)."""
        return self.kernels.activations if self.mode == "gguf" else "fp32"

    @property
    def fingerprint(self) -> str:
        if self.mode == "gguf":
            return f"weights=gguf:{self.kernels.isa}:{self.kernels.digest}"
        return "weights=dense"

    @property
    def log_line(self) -> str:
        return f"weights {self.requested} -> {self.mode} ({self.reason})"


def choose_weights(requested: str, dtype: str, is_gguf: bool, build=None, activations: str = "auto",
                   params: int | None = None) -> WeightsChoice:
    """Resolve `--weights` against `--dtype` and the model file, then `--activations` against the result.
    `params`: the model's parameter count where known (auto's [SMALL-FP32] rule; None: int8 under auto).
    `build`: returns the loaded kernels or an Unavailable (default: kernels.build.load, which may compile
    on first use; the only side effect). Raises ValueError for an unknown name, a contradicting --dtype
    or int8 activations with dense weights, WeightsUnavailable when gguf cannot run here."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown --activations {activations!r}; choose one of {', '.join(ACTIVATIONS)}")
    choice = _weights(requested, dtype, is_gguf, build, activations, params)
    if choice.mode != "gguf" and activations == "int8":
        raise ValueError(f"--activations int8 needs quantized weights (--weights gguf); these are dense "
                         f"({choice.reason})")
    return choice


def _weights(requested: str, dtype: str, is_gguf: bool, build, activations: str, params: int | None) -> WeightsChoice:
    """--weights (see choose_weights); `activations` and `params` only shape a gguf choice."""
    if requested not in WEIGHTS:
        raise ValueError(f"unknown --weights {requested!r}; choose one of {', '.join(WEIGHTS)}")
    if requested == "auto":
        return _auto(dtype, is_gguf, build, activations, params)
    if requested in _DENSE_DTYPE:
        want = _DENSE_DTYPE[requested]
        if dtype not in ("auto", want):
            raise ValueError(f"--weights {requested} computes in {want}, but --dtype is {dtype}")
        return WeightsChoice("dense", want, f"dense {want}", requested)
    if dtype not in ("auto", "float32"):
        raise ValueError(f"--weights gguf computes in float32 (fp32 activations), but --dtype is {dtype}")
    if not is_gguf:
        raise WeightsUnavailable("--weights gguf needs a .gguf model; this one is a Hugging Face folder")
    kernels = _build(build)
    if isinstance(kernels, Unavailable):
        raise WeightsUnavailable(f"--weights gguf needs the native kernel: {kernels.reason}; use --weights auto")
    return _gguf(kernels, requested, activations, params)


def _auto(dtype: str, is_gguf: bool, build, activations: str, params: int | None) -> WeightsChoice:
    """--weights auto: gguf where it can run and no compute dtype was asked for, else dense."""
    def dense(why: str) -> WeightsChoice:
        return WeightsChoice("dense", dtype, f"dense weights in the compute dtype: {why}", "auto")
    if dtype != "auto":
        return dense(f"--dtype {dtype} asked for")
    if not is_gguf:
        return dense("not a GGUF model")
    kernels = _build(build)
    if isinstance(kernels, Unavailable):
        return dense(f"no native kernel ({kernels.reason})")
    return _gguf(kernels, "auto", activations, params)


def _build(build):
    """kernels.build.Kernels, or kernels.build.Unavailable with its reason. May compile on first use."""
    from ..kernels.build import load
    return (build or load)()


def _gguf(kernels, requested: str, activations: str, params: int | None = None) -> WeightsChoice:
    """The quantized blocks on these kernels, set to multiply `activations` (auto: int8, fp32 for a small model
    [SMALL-FP32]); the reason says which (the log line README quotes)."""
    small = activations == "auto" and params is not None and params < SMALL_MODEL_PARAMS
    act = "fp32" if activations == "fp32" or small else "int8"
    kernels = dataclasses.replace(kernels, activations=act)
    products = f"int8 activations ({kernels.int8_path} integer products)" if act == "int8" else \
        f"fp32 activations (auto: {params / 1e6:.0f}M parameters, under {SMALL_MODEL_PARAMS // 10**6}M)" if small \
        else "fp32 activations"
    return WeightsChoice("gguf", "float32", f"quantized blocks, {products}, native {kernels.isa} kernel", requested,
                         kernels)


def gguf_parameters(path) -> int | None:
    """The parameter count of a GGUF file from its header (no tensor data read), or None when the header cannot
    be read (the load then reports the file's fault itself). Pure but for reading the header."""
    from ..models.gguf import FastGGUFReader
    try:
        reader = FastGGUFReader(path)
        return sum(int(t.n_elements) for t in reader.tensors)
    except (OSError, ValueError, KeyError):
        return None
