"""`ternlm bench cluster`: replicas sharing a Redis KV tier behind HAProxy (ternlm/server/cluster.py), measured.

1. moved: a long conversation answered on replica A, its next turn sent to replica B (which never saw
   it): B's time to first token, loading the prefix from Redis, against the same prompt cold on B (a
   fresh cache_salt: same process, no reuse), interleaved, medians. Redis load bandwidth (B's bytes
   loaded / its GET + verify seconds) against `redis-benchmark` GET of the same value size.
2. replay: N concurrent multi-turn conversations through HAProxy (X-Session-ID per conversation) on one
   replica, then on two with Redis killed (SIGKILL) for `--redis-down` seconds mid-run: reused fraction of
   prompt tokens, failed requests, and whether every answer is identical between the runs (greedy); then
   on two without session keys (HAProxy round robin: turns hop between replicas, Redis carries them).
Client-side TTFT: from sending the request to the first streamed content chunk, through HAProxy.
"""
from __future__ import annotations

import json
import random
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx2 as httpx

from ..server.cluster import free_ports, started
from .common import command_line, median, synthetic_conversation, synthetic_text, write_json


def _chat(base: str, model: str, messages: list[dict], max_tokens: int, session: str | None = None,
          salt: str | None = None) -> dict:
    """One streamed greedy chat request: text, ttft_s, usage, timings, replica."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if salt:
        body["cache_salt"] = salt
    headers = {"X-Session-ID": session} if session else {}
    sent = time.monotonic()
    t0 = time.perf_counter()
    ttft, text, usage, timings = None, [], None, {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        replica = r.headers.get("x-ternlm-replica", "")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"])
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece is not None:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    return {"text": "".join(text), "ttft_s": ttft, "usage": usage, "timings": timings, "replica": replica,
            "sent": sent, "done": time.monotonic()}


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{tier="redis"}}'):
            return float(line.split()[-1])
    return 0.0


def _wait_written(base: str, before: float, blocks: int, timeout: float = 60) -> None:
    """Wait until replica `base` has written `blocks` more blocks to Redis (its spill thread, after it answered)."""
    deadline = time.monotonic() + timeout
    while _metric(base, "ternlm_kv_tier_writes_total") < before + blocks and time.monotonic() < deadline:
        time.sleep(0.05)


def _redis_benchmark(url: str, size: int, n: int) -> float:
    """GET requests/s of `redis-benchmark` (one client, no pipelining) with values of `size` bytes."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    out = subprocess.run([shutil.which("redis-benchmark") or "redis-benchmark", "-h", "127.0.0.1", "-p", port,
                          "-t", "set,get", "-d", str(size), "-n", str(n), "-c", "1", "-P", "1", "-r", "16",
                          "--csv"], capture_output=True, text=True, timeout=600, check=True).stdout
    for line in out.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if cells[0] == "GET":
            return float(cells[1])
    raise RuntimeError(f"no GET line in redis-benchmark output: {out[-500:]}")


def moved(args, serve: list[str], logdir: Path) -> dict:
    rng = random.Random(args.seed)
    rows = []
    with started(model=args.model, replicas=2, port=free_ports(4), serve_args=serve, logdir=logdir) as run:
        a, b = run.replicas
        for rnd in range(args.warmup + args.repeats):
            # a conversation of ~history tokens, its own from the first word (no block shared across rounds)
            msgs = synthetic_conversation(rng, 1, 60, 60, 80)
            while sum(len(m["content"].split()) for m in msgs) * 1.25 < args.history_tokens:
                msgs += synthetic_conversation(rng, 1, 0, 60, 80)[1:]
            msgs.append({"role": "user", "content": "Summarise our conversation in one sentence."})
            before = _metric(a, "ternlm_kv_tier_writes_total")
            first = _chat(a, args.model, msgs, args.max_tokens)
            u = first["usage"]
            _wait_written(a, before, (u["prompt_tokens"] + u["completion_tokens"] - 1) // 64)
            nxt = msgs + [{"role": "assistant", "content": first["text"]},
                          {"role": "user", "content": synthetic_text(rng, 36)}]
            cases = ["moved", "cold"] if rnd % 2 == 0 else ["cold", "moved"]     # A B, then B A
            got = {}
            for case in cases:
                load0 = _metric(b, "ternlm_kv_tier_load_seconds_total")
                got[case] = _chat(b, args.model, nxt, args.max_tokens, salt=secrets.token_hex(8) if case == "cold" else None)
                got[case]["redis_load_s"] = _metric(b, "ternlm_kv_tier_load_seconds_total") - load0
            m, c = got["moved"], got["cold"]
            row = {"round": rnd, "warmup": rnd < args.warmup, "prompt_tokens": m["usage"]["prompt_tokens"],
                   "moved_ttft_s": m["ttft_s"], "cold_ttft_s": c["ttft_s"],
                   "cached_tokens": m["usage"]["prompt_tokens_details"]["cached_tokens"],
                   "redis_tokens": m["timings"].get("cache_redis_n", 0), "redis_load_s": m["redis_load_s"],
                   "identical": m["text"] == c["text"]}
            rows.append(row)
            print(f"moved round {rnd}{' (warmup)' if row['warmup'] else ''}: prompt {row['prompt_tokens']}, "
                  f"moved {row['moved_ttft_s'] * 1e3:.0f} ms ({row['redis_tokens']} from redis, "
                  f"GET+verify {row['redis_load_s'] * 1e3:.0f} ms), cold {row['cold_ttft_s'] * 1e3:.0f} ms, "
                  f"identical {row['identical']}", flush=True)
        r = run.redis_url
        import redis as redis_py
        client = redis_py.Redis.from_url(r)
        key = next(iter(client.scan_iter("ternlm:kv:*", count=100)))
        size = client.strlen(key)
        client.close()
        get_rps = _redis_benchmark(r, size, args.bench_gets)
    timed = [x for x in rows if not x["warmup"]]
    moved_s, cold_s = median([x["moved_ttft_s"] for x in timed]), median([x["cold_ttft_s"] for x in timed])
    ours = median([x["redis_tokens"] // 64 * size / x["redis_load_s"] for x in timed if x["redis_load_s"] > 0])
    return {"rows": rows, "moved_ttft_s": moved_s, "cold_ttft_s": cold_s, "ratio": moved_s / cold_s,
            "block_bytes": size, "load_bytes_per_s": ours, "redis_benchmark_get_bytes_per_s": get_rps * size,
            "redis_benchmark_get_rps": get_rps, "identical": all(x["identical"] for x in rows)}


def replay(args, serve: list[str], logdir: Path, replicas: int, kill: bool, sessions: bool = True) -> dict:
    """Run args.conversations conversations concurrently, turn by turn, through HAProxy; with `sessions`
    each sends its X-Session-ID, without it HAProxy spreads the turns round robin."""
    rng = random.Random(args.seed + 1)
    convs = [synthetic_conversation(rng, args.turns, args.system_words, args.user_words, 0)
             for _ in range(args.conversations)]
    results: dict[int, list[dict]] = {i: [] for i in range(len(convs))}
    failures: list[str] = []
    with started(model=args.model, replicas=replicas, port=free_ports(replicas + 2), serve_args=serve,
                 logdir=logdir) as run:
        def drive(i: int) -> None:
            msgs = [convs[i][0]]
            for turn in range(args.turns):
                msgs.append(convs[i][1 + 2 * turn])
                try:
                    out = _chat(run.router, args.model, msgs, args.max_tokens, session=f"conversation-{i}" if sessions else None)
                except Exception as e:       # noqa: BLE001 - counted, the replay goes on
                    failures.append(f"conversation {i} turn {turn}: {e!r}")
                    return
                results[i].append(out)
                msgs.append({"role": "assistant", "content": out["text"]})
        threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(convs))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        down = up = None
        if kill:
            time.sleep(args.kill_after)
            run.kill_redis()
            down = time.monotonic()
            time.sleep(args.redis_down)
            run.restart_redis()
            up = time.monotonic()
            print(f"replay: redis killed at {down - t0:.1f} s, restarted {args.redis_down:.0f} s later", flush=True)
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        outages = sum(_metric(u, "ternlm_kv_tier_outages_total") for u in run.replicas)
    reqs = [r for rs in results.values() for r in rs]
    prompt = sum(r["usage"]["prompt_tokens"] for r in reqs)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in reqs)
    by_conv = {i: sorted({r["replica"] for r in rs}) for i, rs in results.items()}
    # requests that ran while Redis was dead (sent before it came back, finished after it died)
    during = sum(1 for r in reqs if down is not None and r["sent"] < up and r["done"] > down)
    return {"replicas": replicas, "requests": len(reqs), "failed": len(failures), "failures": failures[:5],
            "prompt_tokens": prompt, "cached_tokens": cached, "reused_fraction": cached / prompt if prompt else 0.0,
            "wall_s": wall, "redis_killed_at_s": None if down is None else down - t0, "requests_during_outage": during, "outages": outages, "replica_of": by_conv,
            "answers": {i: [r["text"] for r in rs] for i, rs in results.items()},
            "redis_tokens": sum(r["timings"].get("cache_redis_n", 0) for r in reqs)}


def run(args) -> int:
    import logging
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    serve = ["--dtype", args.dtype, "--threads", str(args.threads), "--slots", str(args.slots),
             "--cache-disk", "0"]
    logdir = Path(tempfile.mkdtemp(prefix="ternlm-bench-cluster-"))
    try:
        out = {"command": command_line(), "serve_args": serve}
        if "moved" in args.parts:
            out["moved"] = m = moved(args, serve, logdir)
            print(f"moved: next-turn TTFT {m['moved_ttft_s'] * 1e3:.0f} ms on the other replica vs "
                  f"{m['cold_ttft_s'] * 1e3:.0f} ms cold = {m['ratio']:.1%} (target <= 20%); identical "
                  f"{m['identical']}; Redis load {m['load_bytes_per_s'] / 2**20:.0f} MiB/s vs redis-benchmark "
                  f"GET {m['redis_benchmark_get_bytes_per_s'] / 2**20:.0f} MiB/s ({m['block_bytes']} B values)")
        if "replay" in args.parts:
            one = replay(args, serve, logdir, 1, kill=False)
            two = replay(args, serve, logdir, 2, kill=True)
            rr = replay(args, serve, logdir, 2, kill=False, sessions=False)
            same = sum(one["answers"][i] == two["answers"][i] == rr["answers"][i] for i in one["answers"])
            out["replay"] = {"one": one, "two": two, "round_robin": rr, "identical_conversations": same,
                             "reuse_ratio": two["reused_fraction"] / one["reused_fraction"]}
            print(f"replay: {args.conversations} conversations x {args.turns} turns; one replica reused "
                  f"{one['reused_fraction']:.1%}, two behind HAProxy {two['reused_fraction']:.1%} "
                  f"(= {out['replay']['reuse_ratio']:.1%} of one; target >= 90%), failed {one['failed']} + "
                  f"{two['failed']} with Redis killed {args.redis_down:.0f} s at {two['redis_killed_at_s']:.1f} s "
                  f"({two['requests_during_outage']} requests ran during the outage); "
                  f"conversations answered identically {same}/{args.conversations}; replicas per conversation "
                  f"{two['replica_of']}")
            print(f"replay without session keys (HAProxy round robin): reused {rr['reused_fraction']:.1%}, "
                  f"{rr['redis_tokens']} tokens from Redis, failed {rr['failed']}; replicas per conversation "
                  f"{rr['replica_of']}")
        path = write_json(Path(args.out), "cluster.json", out)
        print(f"wrote {path}")
        ok = True
        if "moved" in out:
            ok &= out["moved"]["identical"]
        if "replay" in out:
            ok &= all(out["replay"][k]["failed"] == 0 for k in ("one", "two", "round_robin"))
        return 0 if ok else 1
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
