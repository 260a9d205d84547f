"""Command line: ternlm pull | models | generate | serve | chat | bench | cache | info | cluster."""
from __future__ import annotations

import argparse
import logging
import sys

from ..engine.args import DEFAULT_MODEL, engine_args as _engine_args, load_engine as _load  # noqa: F401


def cmd_pull(args) -> int:
    from ..models.registry import model_path
    for name in args.names:
        print(model_path(name, progress=True))
    return 0


def cmd_generate(args) -> int:
    from ..engine.core import Completion
    from ..engine.sampling import Penalties
    engine = _load(args)
    if args.chat:
        ids = engine.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    else:
        ids = engine.tokenizer.encode(args.prompt)
    final = None
    for ev in engine.stream(ids, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                            penalties=Penalties(args.repetition_penalty, args.frequency_penalty,
                                                args.presence_penalty, args.repeat_last_n)):
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
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits / multiply negative ones of tokens seen (prompt + answer; "
                        "transformers', vLLM's; llama.cpp's repeat_penalty with --repeat-last-n)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's: minus count x this")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's: minus this once a token appeared")
    p.add_argument("--repeat-last-n", type=int, default=None, metavar="N",
                   help="llama.cpp's scope: all penalties over the last N tokens of prompt + answer (-1: all; "
                        "default: OpenAI's scopes, frequency/presence over the answer only)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.set_defaults(func=cmd_generate)

    from ..server.cli import add_serve_parser
    add_serve_parser(sub, _engine_args)
    from .chat import add_chat_parser
    add_chat_parser(sub, _engine_args, _load)
    from ..bench.cli import add_bench_parser
    add_bench_parser(sub, _engine_args, _load)
    from .models import add_models_parser
    add_models_parser(sub)
    from .cache import add_cache_parser
    add_cache_parser(sub)
    from .info import add_info_parser
    add_info_parser(sub)
    from ..server.cluster import add_cluster_parser
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
