"""`ternlm bench soak` argument parsing (the run itself is soak.py)."""
from __future__ import annotations


def add_soak_parser(which, engine_args) -> None:
    p = which.add_parser("soak", help="hours of load: concurrent chats, a kill -9 and restart, figures and checks",
                         description="Drive one `ternlm serve` (slots, RAM and disk KV tiers) with concurrent "
                                     "multi-turn chats for --duration s, kill -9 it at --kill-at and restart it on "
                                     "the same cache dir; report failures, reuse, RSS, TTFT and inter-token "
                                     "latency per minute; verify the cache and compare answers after the restart "
                                     "with a cold server's (greedy and seeded sampled ones, per kind of request). "
                                     "Requests are clients' (--mix users): mostly sampled with a seed per turn, "
                                     "with presence, repetition or llama.cpp repeat penalties, some greedy, some "
                                     "asking for a json_schema answer that must validate. Exit 1 if a target is "
                                     "missed. --no-prefix-kv is ignored.")
    engine_args(p)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--kill-at", type=float, default=None, metavar="S",
                   help="kill -9 the server S seconds in and restart it (default duration/2; 0: no kill)")
    p.add_argument("--clients", type=int, default=32, help="concurrent conversations (default 32)")
    p.add_argument("--slots", type=int, default=4, help="the server's --slots (default 4)")
    p.add_argument("--conversations", metavar="FILE", help="MT-Bench question .jsonl or JSONL of OpenAI messages, "
                                                           "cycled (default: endless seeded synthetic chats)")
    p.add_argument("--turns", type=int, default=8, help="user turns per conversation, then a new one (default 8)")
    p.add_argument("--system-words", type=int, default=150, help="synthetic system prompt length")
    p.add_argument("--user-words", type=int, default=40, help="synthetic user turn length (0.5x-1.5x)")
    p.add_argument("--seed", type=int, default=0, help="synthetic conversation seed")
    p.add_argument("--no-stagger", action="store_true",
                   help="start every client at turn 1 (default: client i resumes its first chat after i mod "
                        "--turns turns, with synthetic answers, so lengths are spread from the start)")
    p.add_argument("--mix", default="users", metavar="users|greedy|SETTING",
                   help="what requests carry beside the transcript: users (default: 35%% temperature 0.7 + top_p "
                        "0.95 + presence_penalty 0.5, 15%% only a seed (the server's temperature 1), 10%% "
                        "repetition_penalty 1.1, 10%% llama.cpp's repeat_penalty 1.1 + top_k 40 + min_p 0.05, "
                        "15%% greedy, 15%% a json_schema response_format; every sampled request seeded per "
                        "(conversation, turn)) | greedy (every request temperature 0) | one sampling setting such "
                        "as t1 or t0.7-p0.95-pres0.5 (seeded)")
    p.add_argument("--max-tokens", type=int, default=32, help="answer length cap (default 32; json turns at least "
                                                               "96)")
    p.add_argument("--cache-ram", default="64MiB", help="the server's RAM tier (default 64MiB: full within the "
                                                        "first minute, so blocks reach the disk tier before the "
                                                        "kill and RSS is flat after the warm-up)")
    p.add_argument("--cache-disk", default="4GiB", help="the server's disk tier budget (default 4GiB)")
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="disk tier directory, kept (default: a fresh "
                                                                    "temporary one, removed afterwards)")
    p.add_argument("--tmpfs", default=None, metavar="SIZE", help="mount a tmpfs of SIZE (e.g. 32m; root) as the "
                                                                 "cache dir so the disk fills mid-run")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds after each server start left out of "
                                                               "the RSS growth (default 120)")
    p.add_argument("--rss-every", type=float, default=10.0, help="RSS sampling period, seconds (default 10)")
    p.add_argument("--bin", type=float, default=60.0, help="seconds per row of the time series (default 60)")
    p.add_argument("--cold-check", type=int, default=12,
                   help="answers after the restart to replay on a cold server, taken in turn from each kind of "
                        "the mix (default 12: two of each users' kind)")
    p.add_argument("--out", default=None, help="default benchmarks/results/soak-<model>")
    p.set_defaults(func=_soak)


def _soak(args) -> int:
    from .soak import run
    return run(args)
