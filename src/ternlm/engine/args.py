"""The flags that say which model and engine to run (-m, --dtype, --weights, --ctx, ...) and the loader
they drive, shared by every command that runs a model (generate, serve, chat, bench). Apart from cli/main.py
so `python -m ternlm.cli.chat` and the benchmarks take the same flags without importing the CLI."""
from __future__ import annotations

import argparse

from .weights import ACTIVATIONS
from ..kv.kvtype import KV_CHOICES

DEFAULT_MODEL = "smollm2-135m"


def engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help="registry name, .gguf path or HF folder")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: bfloat16 where the CPU has native bf16, AMX or AVX-512 BF16; float32 "
                        "elsewhere) | float32 | bfloat16 | float16; `ternlm info` shows what auto picks")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "bf16", "fp32"],
                   help="gguf: keep a GGUF's quantized blocks and multiply them with a native kernel built for "
                        "this CPU (with --activations: int8 by default; fastest decode); bf16/fp32: dense weights in that dtype; "
                        "auto (default): gguf for a GGUF model when --dtype is auto and the kernel builds, "
                        "else dense in the --dtype choice")
    p.add_argument("--activations", default="auto", choices=ACTIVATIONS,
                   help="what quantized (gguf) weights multiply: int8 (activations quantized per group of 32, "
                        "exact integer products, llama.cpp's way; the same bits on every CPU kind) | fp32 "
                        "(every weight times fp32 activations: transformers' numbers) | auto (default: int8 for gguf "
                        "weights, mixtures of experts included; fp32 for a model under 200M parameters, whose "
                        "answers int8 changes most); part of the KV namespace")
    p.add_argument("--kv-dtype", default="auto", choices=list(KV_CHOICES),
                   help="the KV cache's format: auto (default: float16 where every layer runs fused in C, i.e. "
                        "--weights gguf with the native kernels, as llama.cpp's f16 cache; float32 elsewhere) | "
                        "float32 | float16 | q8_0 (8-bit codes, one fp16 scale per 32 values: 0.53x fp16's bytes, "
                        "every tier too; reuse stays exact). float16 and q8_0 need the native kernels")
    p.add_argument("--no-prefix-kv", action="store_true", help="turn prefix KV reuse off (for comparison)")
    p.add_argument("--min-reuse", type=int, default=16, help="reuse only prefixes at least this long")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--chunk", type=chunk_arg, default=None, metavar="N|auto",
                   help="prefill rows a step: auto (default: 256, best measured; where a mixture of experts "
                        "streams its experts, up to 2048 planned with the expert cache: each chunk reads the "
                        "experts again) | N")
    p.add_argument("--state-interval", type=int, default=64,
                   help="hybrid models (qwen35): snapshot each slot's recurrent state every N positions (and at "
                        "each prefill's end); reuse resumes at the latest one before a divergence (default 64)")
    p.add_argument("--speculative", default="auto", choices=["auto", "off"],
                   help="speculative decoding: auto (default: draft by prompt lookup and verify in one step; "
                        "the same answer token for token, faster where the answer repeats the conversation) | off")
    p.add_argument("--draft-model", default=None, metavar="NAME|PATH",
                   help="speculative decoding with a small model of the same tokenizer (e.g. qwen2.5-coder-0.5b "
                        "for qwen2.5-coder-1.5b): it drafts greedily, the model verifies; the same answer token for "
                        "token; refused unless the vocabularies match")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--chat-template", type=template_file, default=None, metavar="FILE",
                   help="a jinja chat template (Hugging Face semantics) replacing the model's own")
    p.add_argument("--expert-cache", default="auto", metavar="SIZE",
                   help="mixture of experts: bytes of experts kept in memory, the rest read from the file on "
                        "demand (e.g. 8GiB); resident: all converted at load; auto (default): resident when they "
                        "fit beside the KV budget, else what fits")
    p.add_argument("--no-fit-check", action="store_true",
                   help="load even when model + KV (+ RAM tier) look larger than the available memory (fit.py)")


def template_file(path: str) -> str:
    """--chat-template FILE -> its text (read once at startup; a bad path is a usage error)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read chat template {path!r}: {e}") from None


def load_engine(args, slots: int = 1):
    import torch
    from .core import Engine
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_fit_check:      # refuse in one line before any weight is read (fit.py)
        from .fit import require_fit
        require_fit(args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype, ctx=args.ctx,
                    expert_cache=args.expert_cache, draft_model=getattr(args, "draft_model", None),
                    slots=slots)
    engine = Engine.load(args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype,
                         activations=getattr(args, "activations", "auto"),
                         prefix_reuse=not args.no_prefix_kv,
                         min_reuse=args.min_reuse, ctx=args.ctx, chunk_size=args.chunk, slots=slots,
                         state_interval=getattr(args, "state_interval", 64),
                         speculative=getattr(args, "speculative", "auto") != "off",
                         draft_model=getattr(args, "draft_model", None),
                         chat_template=args.chat_template, expert_cache=args.expert_cache)
    args.dtype = engine.dtype_choice.dtype   # "auto" resolved: labels and result files name what ran
    return engine


def chunk_arg(text: str) -> int | None:
    """--chunk's value: a positive number of rows, or None for "auto" (Engine.load plans it). Pure."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of tokens or auto") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: at least 1")
    return n
