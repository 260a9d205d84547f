"""Command line: ternlm pull | models | generate | serve | chat | bench | cache | info | cluster."""
from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_MODEL = "smollm2-135m"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=DEFAULT_MODEL, help="registry name, .gguf path or HF folder")
    p.add_argument("--dtype", default="auto",
                   help="auto (default: bfloat16 where the CPU has native bf16, AMX or AVX-512 BF16; float32 "
                        "elsewhere) | float32 | bfloat16 | float16; `ternlm info` shows what auto picks")
    p.add_argument("--weights", default="auto", choices=["auto", "gguf", "bf16", "fp32"],
                   help="gguf: keep a GGUF's quantized blocks and multiply them with a native kernel built for "
                        "this CPU (fp32 activations; fastest decode); bf16/fp32: dense weights in that dtype; "
                        "auto (default): gguf for a GGUF model when --dtype is auto and the kernel builds, "
                        "else dense in the --dtype choice")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "float16"],
                   help="the KV cache's dtype: auto (default: float16 where every layer runs fused in C, i.e. "
                        "--weights gguf with the native kernels, as llama.cpp's f16 cache; float32 elsewhere) | "
                        "float32 | float16 (needs the fused layers)")
    p.add_argument("--no-prefix-kv", action="store_true", help="turn prefix KV reuse off (for comparison)")
    p.add_argument("--min-reuse", type=int, default=16, help="reuse only prefixes at least this long")
    p.add_argument("--ctx", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size in tokens (256: best measured)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--chat-template", type=_template_file, default=None, metavar="FILE",
                   help="a jinja chat template (Hugging Face semantics) replacing the model's own")
    p.add_argument("--expert-cache", default="auto", metavar="SIZE",
                   help="mixture of experts: bytes of experts kept in memory, the rest read from the file on "
                        "demand (e.g. 8GiB); resident: all converted at load; auto (default): resident when they "
                        "fit beside the KV budget, else what fits")
    p.add_argument("--no-fit-check", action="store_true",
                   help="load even when model + KV (+ RAM tier) look larger than the available memory (fit.py)")


def _template_file(path: str) -> str:
    """--chat-template FILE -> its text (read once at startup; a bad path is a usage error)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read chat template {path!r}: {e}") from None


def _load(args, slots: int = 1):
    import torch
    from .engine import Engine
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.no_fit_check:      # refuse in one line before any weight is read (fit.py)
        from .fit import require_fit
        require_fit(args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype, ctx=args.ctx,
                    slots=slots)
    engine = Engine.load(args.model, dtype=args.dtype, weights=args.weights, kv_dtype=args.kv_dtype,
                         prefix_reuse=not args.no_prefix_kv,
                         min_reuse=args.min_reuse, ctx=args.ctx, chunk_size=args.chunk, slots=slots,
                         chat_template=args.chat_template, expert_cache=args.expert_cache)
    args.dtype = engine.dtype_choice.dtype   # "auto" resolved: labels and result files name what ran
    return engine


def cmd_pull(args) -> int:
    from .models.registry import model_path
    for name in args.names:
        print(model_path(name, progress=True))
    return 0


def cmd_generate(args) -> int:
    from .engine import Completion
    engine = _load(args)
    if args.chat:
        ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = engine.tokenizer.encode(args.prompt)
    final = None
    for ev in engine.stream(ids, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop or None):
        if isinstance(ev, Completion):
            final = ev
        else:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    t = final.timings
    print(f"[{final.finish_reason}] prompt {final.prompt_tokens} (cached {final.cached_tokens}) · "
          f"prefill {t.prefill_tokens} tok in {t.prefill_s:.2f} s · "
          f"{t.decode_tokens} decoded in {t.decode_s:.2f} s · first token {t.ttft_s:.2f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternlm", description="LLM inference that never re-reads a conversation")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="download and verify registry models")
    p.add_argument("names", nargs="+")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="complete a prompt, streaming to stdout")
    _engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=cmd_generate)

    from .server.cli import add_serve_parser
    add_serve_parser(sub, _engine_args)
    from .chat_cli import add_chat_parser
    add_chat_parser(sub, _engine_args, _load)
    from .bench.cli import add_bench_parser
    add_bench_parser(sub, _engine_args, _load)
    from .models_cli import add_models_parser
    add_models_parser(sub)
    from .cache_cli import add_cache_parser
    add_cache_parser(sub)
    from .info_cli import add_info_parser
    add_info_parser(sub)
    from .cluster import add_cluster_parser
    add_cluster_parser(sub)

    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"ternlm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
