"""`ternlm bench engine|dtype|reuse|tiers|multiturn|streams|spec|soak|cluster|report` argument parsing."""
from __future__ import annotations

import os

from .peers import PEERS_PYTHON
from .sampling_settings import add_request_flags


def add_bench_parser(sub, engine_args, load_engine) -> None:
    bench = sub.add_parser("bench", help="benchmarks (side by side, medians and ratios)")
    which = bench.add_subparsers(dest="bench", required=True)

    p = which.add_parser("engine", help="prefill/decode tok/s vs transformers and llama.cpp")
    engine_args(p)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-context", type=int, default=32,
                   help="prompt tokens before the timed decode (the issue's targets: 1024 and 4000)")
    p.add_argument("--peers", default="transformers,llamacpp", help="comma list: transformers,llamacpp")
    p.add_argument("--llama-bench", default=None, metavar="BIN|auto",
                   help="after ternlm's runs, llama.cpp's own llama-bench on the same GGUF with the same threads and "
                        "--repeats: prefill of --prompt-tokens (-p N -n 0) and decode of --decode-tokens after "
                        "--decode-context (-p 0 -n N -d C); `auto`: the one scripts/build-llamacpp built. It "
                        "keeps its KV in the format of ternlm's --kv-dtype (q8_0: -fa 1 -ctk q8_0 -ctv q8_0)")
    p.add_argument("--llama-bench-args", default="", metavar="'ARGS'",
                   help="more llama-bench flags, after those (e.g. '-fa 1'), shell-split")
    p.add_argument("--sampling", default=None, metavar="NAMES",
                   help="ternlm's decode at each of these settings, interleaved in every round, medians and "
                        "ratios to greedy (default: greedy). A name is `greedy` or fields joined by -: t temperature, "
                        "p top_p, k top_k, minp min_p, pres/freq/rep penalties; e.g. "
                        "greedy,t1,t0.7-p0.95-pres0.5 (OpenAI's default; a chat client's). The first one is the "
                        "decode beside the peers, which always decode greedy (llama-bench samples nothing either)")
    p.add_argument("--temperature", type=float, default=None,
                   help="one setting instead of --sampling: this temperature (default with --top-p or "
                        "--presence-penalty: 1, OpenAI's)")
    p.add_argument("--top-p", type=float, default=None, help="one setting instead of --sampling: this top_p")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help="one setting instead of --sampling: this presence penalty (OpenAI's)")
    p.add_argument("--seed", type=int, default=0, help="the sampled decodes' seed (each round draws the same tokens)")
    _common(p)
    p.set_defaults(func=lambda a: _run("engine", a, load_engine))

    p = which.add_parser("quality", help="--weights gguf vs the dequantized fp32 model: agreement, perplexity, RSS")
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=2000, help="length of the teacher-forced text")
    p.add_argument("--ctx", type=int, default=4096, help="KV context of the RSS measurement (one slot)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--llama-perplexity", metavar="BIN|auto", default=None,
                   help="llama.cpp's own llama-perplexity (make bench-peers builds it; `auto`: that build): run on "
                        "the same file and text, beside ternlm's perplexity under its protocol (chunks of --ppl-ctx, "
                        "second halves)")
    p.add_argument("--ppl-ctx", type=int, default=512, help="llama-perplexity's -c: the chunk length")
    p.set_defaults(func=_quality)

    p = which.add_parser("dtype", help="float32 vs bfloat16 on this CPU, and what --dtype auto picks here")
    engine_args(p)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=_dtype)

    p = which.add_parser("grammar", help="decode tok/s with and without a json_schema grammar; mask cost per token")
    engine_args(p)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=_grammar_bench(load_engine))

    p = which.add_parser("reuse", help="time to first token of a long conversation's next turn")
    engine_args(p)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default=None, metavar="BIN|auto",
                   help="also llama.cpp's own llama-server on the same GGUF and turn-2 ids (one slot, its defaults); "
                        "`auto`: the one scripts/build-llamacpp built (.peers/ of this checkout or its main worktree)")
    _common(p)
    p.set_defaults(func=lambda a: _run("reuse", a, load_engine))

    p = which.add_parser("tiers", help="next-turn time to first token: prefix in the slot, RAM tier, disk tier, nowhere",
                         description="Time to first token of the next turn of a long conversation when its KV "
                                     "prefix is in the live slot, the RAM tier, the disk tier (page cache dropped "
                                     "and warm), the Redis tier (when one is at hand: --redis) or nowhere (full "
                                     "prefill), interleaved, medians; the disk tier's load bandwidth against the "
                                     "disk's sequential read bandwidth; per tier, the bytes a token it holds (the "
                                     "--kv-dtype's saving, tier by tier) and the tokens restored. Checks all cases "
                                     "give bit-identical logits and restore from the tier named (exit 1 if not). "
                                     "--no-prefix-kv is ignored: every case always runs.")
    engine_args(p)
    p.add_argument("--history-tokens", type=int, default=4000, help="length of the previous turn's prompt")
    p.add_argument("--next-words", type=int, default=36, help="the new user message (~1.2 tokens a word)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--seq-mib", type=int, default=1024, help="size of the sequential read test file (MiB)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where a temporary disk tier and the read test file go, removed afterwards "
                        "(default: $XDG_CACHE_HOME/ternlm, the disk tier's own filesystem)")
    p.add_argument("--redis", default="auto", metavar="URL|auto|off",
                   help="the redis case's Redis: auto (default: start /usr/bin/redis-server on a free 127.0.0.1 "
                        "port, no persistence, stopped when the bench ends; the case is skipped, and the report "
                        "says so, where there is none) | a redis:// URL (this engine's namespace's keys there are "
                        "deleted before each round and at the end) | off")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=_tiers)

    p = which.add_parser("multiturn", help="replay multi-turn chats over HTTP: ternlm reuse on/off and --url servers",
                         description="Replay conversations turn by turn (whole transcript each turn) "
                                     "against ternlm with and without prefix reuse (-m: two `ternlm serve` "
                                     "processes) and any OpenAI-compatible --url; per-turn TTFT, prefill/decode "
                                     "tok/s, reuse; checks reuse on/off answer identically (exit 1 if not). "
                                     "Sampling: as vLLM's multi-turn client, no temperature is sent unless "
                                     "--temperature is given (each server's default: OpenAI's 1 for ternlm; "
                                     "--temperature 0: greedy); every request carries a seed of its own "
                                     "(--seed, conversation, turn), the same for every contender, so the identity "
                                     "check holds sampled too. "
                                     "--no-prefix-kv is ignored: both configurations always run.")
    engine_args(p)
    default_model = p.get_default("model")
    p.set_defaults(model=None)     # -m only when asked for (or when there is no --url)
    p.add_argument("--url", action="extend", nargs="+", metavar="URL", help="OpenAI-compatible /v1 base URL(s)")
    p.add_argument("--label", action="extend", nargs="+", metavar="NAME", help="names for the --url contenders, in order")
    p.add_argument("--api-key", help="bearer key for the --url contenders (default: $OPENAI_API_KEY)")
    p.add_argument("--conversations", metavar="FILE", help="MT-Bench question .jsonl or JSONL of OpenAI messages "
                                                           "(default: seeded synthetic conversations)")
    p.add_argument("--num-conversations", type=int, default=0, help="how many (default: 4 synthetic, all of FILE)")
    p.add_argument("--turns", type=int, default=6, help="user turns per conversation (at most)")
    p.add_argument("--system-words", type=int, default=150, help="synthetic system prompt length")
    p.add_argument("--user-words", type=int, default=40, help="synthetic user turn length (0.5x-1.5x)")
    p.add_argument("--seed", type=int, default=0, help="synthetic conversation seed; the requests' seeds derive from it")
    add_request_flags(p, None, "temperature sent in every request (default: none sent, the server's default, "
                               "as vLLM's multi-turn client; 0: greedy)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", "--clients", dest="clients", type=int, default=1,
                   help="conversations replayed concurrently through the HTTP API (default 1)")
    p.add_argument("--slots", type=int, default=0,
                   help="slots of the servers -m starts (default: concurrency, +1 with --cold-prompt-tokens)")
    p.add_argument("--step-tokens", type=int, default=0, help="--step-tokens of the servers -m starts (default: theirs)")
    p.add_argument("--only-reuse", action="store_true",
                   help="-m starts only the reuse-on server (no reuse-off twin, no identity check)")
    p.add_argument("--cold-prompt-tokens", type=int, default=0,
                   help="while the conversations run, send one unrelated prompt of about this many tokens "
                        "and report the other streams' inter-token latency during its prefill")
    p.add_argument("--cold-prompt-delay", type=float, default=3.0,
                   help="seconds after a contender's batch starts before the cold prompt is sent")
    p.add_argument("--require-identical", action="append", metavar="A,B",
                   help="also require these two contenders to answer identically (repeatable)")
    p.add_argument("--llama-server", default=None, metavar="BIN|auto",
                   help="also llama.cpp's own llama-server on -m's GGUF (one slot per client, --threads for prompt and "
                        "generation, its defaults otherwise), labelled llama-server; `auto`: the one "
                        "scripts/build-llamacpp built")
    p.add_argument("--llama-server-ctx", type=int, default=8192, help="llama-server's -c (default 8192)")
    p.add_argument("--llama-server-args", default="", metavar="'FLAGS'",
                   help="more llama-server flags, one shell-quoted string after = (e.g. --llama-server-args='--swa-full')")
    p.add_argument("--out", default="benchmarks/results/multiturn")
    p.set_defaults(func=lambda a: _multiturn(a, default_model))

    p = which.add_parser("streams", help="steady decode tok/s of N concurrent streams over HTTP: ternlm and --url servers",
                         description="N concurrent greedy streams released together, for each --concurrency; "
                                     "aggregate decode tok/s while all N stream, inter-token latency; ternlm "
                                     "(-m: one `ternlm serve`) beside any OpenAI-compatible --url, interleaved, "
                                     "medians of --repeats.")
    engine_args(p)
    p.add_argument("--url", action="extend", nargs="+", metavar="URL", help="OpenAI-compatible /v1 base URL(s)")
    p.add_argument("--label", action="extend", nargs="+", metavar="NAME", help="names for the --url contenders, in order")
    p.add_argument("--api-key", help="bearer key for the --url contenders (default: $OPENAI_API_KEY)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="streams at once (default: 1 8)")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens each stream asks for")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--step-tokens", type=int, default=0, help="--step-tokens of the server -m starts (default: its own)")
    p.add_argument("--no-ternlm", dest="model", action="store_const", const=None,
                   help="only the --url contenders (no `ternlm serve`)")
    p.add_argument("--out", default="benchmarks/results/streams")
    p.set_defaults(func=lambda a: _streams(a))

    p = which.add_parser("spec", help="speculative decoding: a code-editing replay and MT-Bench chats, ternlm "
                                      "on/off beside llama-server's n-gram --spec-types",
                         description="ternlm with speculative decoding off and on (two `ternlm serve` processes) "
                                     "and llama.cpp's llama-server without speculation and with each n-gram "
                                     "--spec-type it lists, on the same GGUF and prompt ids, over HTTP, streamed: "
                                     "a code-editing replay (the whole file each answer; fixed history) and "
                                     "MT-Bench chats (ternlm only). Decode tok/s (server timings and client "
                                     "clock), total time, drafted/accepted; medians over --repeats; JSON and "
                                     "markdown in --out. Exit 1 if ternlm's text with speculation differs from "
                                     "without. --speculative is ignored: both always run; --draft-model adds a third "
                                     "ternlm drafting with that model (its text must equal off's too).")
    engine_args(p)
    p.set_defaults(slots=1)
    p.add_argument("--parts", default="edit,mtbench", help="comma list: edit,mtbench")
    p.add_argument("--turns", type=int, default=4, help="code-editing turns (1-6)")
    p.add_argument("--max-tokens", type=int, default=2000, help="per code-editing answer (the whole file: ~1.4k tokens)")
    p.add_argument("--mt-questions", type=int, default=6, help="MT-Bench questions (one per category in turn), 2 turns each")
    p.add_argument("--mt-max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    add_request_flags(p, 0.0, "temperature of every timed request (default 0: greedy); sampled requests are "
                              "seeded (--seed), so speculation on and off must still answer alike")
    p.add_argument("--seed", type=int, default=0, help="the sampled requests' seed")
    p.add_argument("--llama-server", default=None, metavar="BIN|none",
                   help="llama.cpp's llama-server (default: the one scripts/build-llamacpp built for this checkout or "
                        "its main worktree, skipped with a line if none; `none`: ternlm only)")
    p.add_argument("--llama-spec-types", default=None, metavar="T,T",
                   help="llama-server's --spec-type values to run (default: every ngram-* its --help lists); "
                        "no speculation always runs")
    p.add_argument("--out", default="benchmarks/results/spec")
    p.set_defaults(func=_spec)

    p = which.add_parser("cluster", help="replicas sharing Redis behind HAProxy: a moved conversation's TTFT, "
                                         "reuse of 8 concurrent conversations, Redis killed mid-run",
                         description="Starts Redis, replicas and HAProxy (ternlm cluster) on free loopback ports. "
                                     "moved: a long conversation's next turn on the other replica vs cold, and "
                                     "Redis load bandwidth vs redis-benchmark GET; replay: concurrent conversations "
                                     "on one replica vs two behind HAProxy with Redis killed mid-run (exit 1 on a "
                                     "failed request or a moved answer that differs from cold).")
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--slots", type=int, default=8, help="slots per replica")
    p.add_argument("--parts", default="moved,replay", help="comma list: moved,replay")
    p.add_argument("--history-tokens", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bench-gets", type=int, default=2000, help="redis-benchmark requests")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--user-words", type=int, default=40)
    p.add_argument("--kill-after", type=float, default=5.0, help="seconds into the two-replica replay")
    p.add_argument("--redis-down", type=float, default=10.0, help="seconds Redis stays dead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=_cluster)

    from .soak_cli import add_soak_parser
    add_soak_parser(which, engine_args)

    p = which.add_parser("report", help="run the headline benchmarks here; write summary.md/.json (the results page's tables)",
                         description="Runs engine, reuse, multiturn, tiers, streams and grammar as `ternlm bench` processes "
                                     "(sized for about 30 min on a quiet 2-core host; --quick: a smoke test of minutes, smollm2-135m, no "
                                     "peers) and writes DIR/summary.md and DIR/summary.json from the JSON they wrote, "
                                     "with each table's command, ending with RESULTS' Summary rows it reproduced and why the others "
                                     "did not run. Peers (transformers, llama-cpp-python from .venv-peers, llama.cpp's own "
                                     "llama-bench and llama-server from make bench-peers) are used when installed, named as "
                                     "missing otherwise; qwen2.5-coder-1.5b joins engine, reuse and multiturn (against "
                                     "llama.cpp's binaries only) when cached. Exit 1 if a benchmark failed.")
    p.add_argument("--quick", action="store_true", help="tiny settings, smollm2-135m only, 1 repeat, no peers")
    p.add_argument("--only", default=None, metavar="PARTS", help="comma list of engine,reuse,multiturn,tiers,streams,grammar,spec "
                                                                      "(default: all but spec, which is opt-in)")
    p.add_argument("--models", default=None, metavar="NAMES",
                   help="comma list (default: smollm2-135m,qwen2.5-coder-0.5b; --quick: smollm2-135m); "
                        "tiers, streams and grammar run on smollm2-135m (or the first) only")
    p.add_argument("--threads", type=int, default=None, help="threads of every contender (default: all cores)")
    p.add_argument("--llamacpp-python", default=PEERS_PYTHON, help="python of the venv with llama-cpp-python")
    p.add_argument("--llama-server", default="auto", metavar="auto|BIN|none",
                   help="llama.cpp's llama-server: the multi-turn replay's peer (bench multiturn --llama-server), "
                        "the streams part's batching peer (8 parallel slots; llama-cpp-python's server serves one "
                        "request at a time, so it is not used there), the reuse part's turn-2 peer beside "
                        "llama-cpp-python and spec's n-gram peer. Default auto: the one scripts/build-llamacpp built "
                        "(make bench-peers), if any; none: without it")
    p.add_argument("--llama-bench", default="auto", metavar="auto|BIN|none",
                   help="llama.cpp's llama-bench: the engine part's peer on the same GGUF, threads and sizes (bench "
                        "engine --llama-bench). Default auto: the one scripts/build-llamacpp built, if any; none: without it")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="default: benchmarks/results/report/<date>-<ISA class>/")
    p.set_defaults(func=_report)


def _spec(args) -> int:
    from .spec import run
    for name, v, low in (("--turns", args.turns, 1), ("--max-tokens", args.max_tokens, 1),
                         ("--repeats", args.repeats, 1), ("--mt-questions", args.mt_questions, 1)):
        if v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    return run(args)


def _report(args) -> int:
    from .report import run
    return run(args)


def _cluster(args) -> int:
    from .cluster import run
    return run(args)


def _quality(args) -> int:
    from .quality import run
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    run(args)
    return 0


def _common(p) -> None:
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--llamacpp-python", default=PEERS_PYTHON, help="python of the venv with llama-cpp-python")
    p.add_argument("--out", default="benchmarks/results")


def _multiturn(args, default_model: str) -> int:
    from .multiturn import run
    if args.model is None and not args.url:
        args.model = default_model
    return run(args)


def _streams(args) -> int:
    from .streams import run
    return run(args)


def _dtype(args) -> int:
    from .dtype import run
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    run(args)
    return 0


def _grammar_bench(load_engine):
    def go(args) -> int:
        from .grammar import run
        if args.threads is None:
            args.threads = os.cpu_count() or 1
        run(args, load_engine)
        return 0
    return go


def _tiers(args) -> int:
    from .tiers import run
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    return run(args)


def _run(which: str, args, load_engine) -> int:
    if args.threads is None:
        args.threads = os.cpu_count() or 1
    if which == "engine":
        from .engine import run
        from .sampling_settings import GREEDY, from_flags, parse_list
        one = from_flags(args.temperature, args.top_p, args.presence_penalty)
        if one is not None and args.sampling is not None:
            raise ValueError("--sampling or --temperature/--top-p/--presence-penalty, not both")
        args.sampling = [one] if one is not None else parse_list(args.sampling or GREEDY)
        if "llamacpp" in args.peers and not os.path.exists(args.llamacpp_python):
            raise FileNotFoundError(f"{args.llamacpp_python} not found: run `make bench-peers` or pass --peers transformers")
    else:
        from .reuse import run
    run(args, load_engine)
    return 0
