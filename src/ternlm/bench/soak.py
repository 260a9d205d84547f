"""`ternlm bench soak`: hours of load, with figures. One `ternlm serve` (slots, RAM tier, disk tier) is
driven by many concurrent chat clients for --duration seconds, killed with SIGKILL at --kill-at and
restarted on the same cache directory while the clients retry; then the cache is verified and a few
answers given after the restart are replayed against a cold server (no reuse) and must match.

Requests look like clients' (--mix users, the default; soak_mix.py): most sampled with a seed per
(conversation, turn) (temperature 0.7 + top_p 0.95 + presence_penalty 0.5; only a seed, the server's
temperature 1; repetition_penalty 1.1; llama.cpp's repeat_penalty 1.1 with top_k 40 / min_p 0.05), some
greedy, some asking for a json_schema answer that must parse and validate. --mix greedy: every request
at temperature 0. Speculative decoding is the server's default (on) unless --speculative off.

Conversation lengths start spread out (client i resumes its first chat after i mod --turns turns, with
synthetic answers; --no-stagger: all at turn 1): otherwise all clients grow in step for minutes and the
server's working set (slot KV pages touched, deeper each turn) grows past any warm-up.

What it reports (results.json, soak.png, a table) and the targets that make the exit status 1:
- failed requests (429 honoured = back-pressure, retries during the planned restart: counted apart): 0;
- reuse fraction (cached_tokens / prompt tokens), overall and per minute (no target: a figure);
- server RSS every --rss-every s; growth after --warmup, per server process: <= 5%;
- TTFT and inter-token latency p50/p99 per minute (no target: figures);
- `ternlm cache verify` right after the kill (dry run) and at the end: every file verifies;
- json turns: every answer parses and validates against the schema (an invalid one is a failed request);
- the cold check: answers after the restart = a `--no-prefix-kv` server's, text for text, greedy and
  seeded sampled ones alike (a seeded draw is keyed by (seed, token index)), taken in turn from each kind
  and counted per kind.
- optional --tmpfs SIZE (root): the cache directory is a tmpfs that fills mid-run; the disk tier must
  turn its writes off (`ternlm_kv_tier_writes_disabled{tier="disk"}` = 1) and nothing else change.

Every server process is owned by a try/finally from the line that starts it; a tmpfs is unmounted
in the same way. Servers get OMP_WAIT_POLICY=PASSIVE unless set (a shared machine: see README).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx2 as httpx

from .common import command_line, write_json
from .procs import free_port, stop as stop_proc, ternlm_serve_argv, wait_http
from .soak_client import (Answer, ConversationSource, Outcomes, ServerPhase, converse, model_id,
                          pick_for_cold_check, replay_cold)
from .soak_mix import Mix, mix_named
from .soak_report import (attach_rss, by_kind, latency, missed, per_bin, plot, report, reuse_fraction, rss_growth,
                          verdicts)

log = logging.getLogger("ternlm.bench.soak")


class SoakServer:
    """`ternlm serve` on a fixed port, restartable: start() launches a process (log: logs/serve-<n>.log),
    kill9() SIGKILLs it, stop() SIGTERMs it (the server drains and writes its KV down) and kills it
    after 60 s. The port stays the same across restarts so clients keep their URL."""

    def __init__(self, serve_args: list[str], port: int, log_dir: Path):
        self.serve_args, self.port, self.log_dir = serve_args, port, log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / f"serve-{self.starts}.log", "wb")
        self.starts += 1
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.proc = subprocess.Popen(ternlm_serve_argv(self.port, self.serve_args), stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until GET /health is 200. Raises if the process exits or the time runs out."""
        wait_http(f"http://127.0.0.1:{self.port}/health", self.proc, timeout_s, f"ternlm serve (logs in {self.log_dir})")

    def rss_mib(self) -> dict[str, float] | None:
        """The live process's VmRSS and its parts RssAnon (heap, tensors) and RssFile (mapped files:
        libraries, the model) from /proc, in MiB: {"rss_mib", "anon_mib", "file_mib"}; None if it is
        gone or between restarts."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        names = {"VmRSS:": "rss_mib", "RssAnon:": "anon_mib", "RssFile:": "file_mib"}
        try:
            lines = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        except OSError:
            return None
        out = {names[p[0]]: int(p[1]) / 1024 for p in (ln.split() for ln in lines) if p and p[0] in names}
        return out if "rss_mib" in out else None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._close_log()

    def stop(self) -> None:
        stop_proc(self.proc, timeout_s=60)      # the drain writes the KV down: a longer grace than a bench server's
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def resolve_dtype(args, server: SoakServer) -> None:
    """`--dtype auto` -> what the server logged it picked, so results.json names what ran and the cold
    server runs the same. Side effect: sets args.dtype (left as is if the line is not found)."""
    if args.dtype == "auto":
        m = re.search(r"dtype auto -> (\w+)", (server.log_dir / "serve-0.log").read_text(errors="replace"))
        if m:
            args.dtype = m.group(1)


def cache_verify(cache_dir: Path, dry_run: bool) -> dict:
    """Run `ternlm cache verify` (the command a user would) and parse its last line.
    Side effect without dry_run: damaged files are deleted (that is what verify does)."""
    cmd = [sys.executable, "-m", "ternlm.cli.main", "cache", "verify", "--cache-dir", str(cache_dir)]
    p = subprocess.run(cmd + (["--dry-run"] if dry_run else []), capture_output=True, text=True, timeout=600)
    m = re.search(r"verified (\d+) blocks: (\d+) good, (\d+) damaged", p.stdout)
    files, good, damaged = (int(x) for x in m.groups()) if m else (0, 0, -1)
    return {"rc": p.returncode, "files": files, "good": good, "damaged": damaged, "dry_run": dry_run,
            "output": (p.stdout + p.stderr)[-2000:]}


def scrape(url_v1: str, prefix: str = "ternlm_kv_tier_") -> dict[str, float]:
    """The /metrics samples whose names start with `prefix`, keyed by name and labels, e.g.
    'ternlm_kv_tier_writes_disabled{tier="disk"}' (counters end in _total; _created ones are left out)."""
    text = httpx.get(url_v1.removesuffix("/v1") + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(prefix) and "_created{" not in name:
            out[name] = float(value)
    return out


class Soak:
    """One run's state: the server, the clients' shared view of it, what was recorded."""

    def __init__(self, args, server: SoakServer, cache_dir: Path, mix: Mix):
        self.args, self.server, self.cache_dir, self.mix = args, server, cache_dir, mix
        self.answers: list[Answer] = []
        self.outcomes = Outcomes()
        self.rss: list[dict] = []
        self.starts = {0: 0.0}              # server process -> seconds since start when it was launched
        self.fault = {"killed_at_s": None, "ready_at_s": None, "downtime_s": None, "verify_after_kill": None}
        self.metrics_before_kill: dict[str, float] = {}
        self.t0 = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sample_rss(self, phase: ServerPhase, stop: asyncio.Event) -> None:
        """Every --rss-every seconds: the live server's VmRSS (none while it is down)."""
        while not stop.is_set():
            rss = self.server.rss_mib()
            if rss is not None and not phase.restarting:
                self.rss.append({"t_s": round(self.now(), 2), "generation": phase.generation, **rss})
            try:
                await asyncio.wait_for(stop.wait(), self.args.rss_every)
            except asyncio.TimeoutError:
                pass

    async def kill_and_restart(self, phase: ServerPhase) -> None:
        """At --kill-at: SIGKILL the server, verify the cache as the kill left it (dry run), start a new
        process on the same directory and port. Clients retry meanwhile (phase.restarting)."""
        await asyncio.sleep(max(0.0, self.args.kill_at - self.now()))
        try:
            self.metrics_before_kill = await asyncio.to_thread(scrape, phase.url)
        except httpx.HTTPError:
            pass
        phase.restarting = True
        self.server.kill9()
        self.fault["killed_at_s"] = self.now()
        self.fault["verify_after_kill"] = await asyncio.to_thread(cache_verify, self.cache_dir, True)
        self.starts[1] = self.now()
        self.server.start()
        await asyncio.to_thread(self.server.wait_ready)
        self.fault["ready_at_s"] = self.now()
        self.fault["downtime_s"] = self.fault["ready_at_s"] - self.fault["killed_at_s"]
        phase.generation += 1
        phase.restarting = False

    async def drive(self) -> ServerPhase:
        """The whole load phase: clients, RSS sampler, the fault; returns when every client has finished
        its last request (none starts after --duration)."""
        a = self.args
        phase = ServerPhase(self.server.url, await model_id(self.server.url))
        source = ConversationSource(path=Path(a.conversations) if a.conversations else None, turns=a.turns,
                                    system_words=a.system_words, user_words=a.user_words, seed=a.seed)
        stop_rss = asyncio.Event()
        self.t0 = time.perf_counter()

        def over() -> bool:
            return self.now() >= a.duration
        limits = httpx.Limits(max_connections=a.clients * 2, max_keepalive_connections=a.clients)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
            rss = asyncio.create_task(self.sample_rss(phase, stop_rss))
            tasks = [asyncio.create_task(converse(client, phase, self.outcomes, source, self.answers,
                                                  max_tokens=a.max_tokens, t0=self.t0, stop=over,
                                                  resume_at=0 if a.no_stagger else i % a.turns, mix=self.mix))
                     for i in range(a.clients)]
            if 0 < a.kill_at < a.duration:
                tasks.append(asyncio.create_task(self.kill_and_restart(phase)))
            try:
                # a restart that fails raises at once here, rather than after every client gave up
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()
            finally:
                for t in tasks:
                    t.cancel()
                stop_rss.set()
                await rss
        return phase


def serve_args(args, cache_dir: Path, *, reuse: bool = True) -> list[str]:
    """`ternlm serve` flags: the soak server's (tiers on, sized by --cache-ram/--cache-disk) or, with
    reuse=False, the cold server's (prefix reuse and both tiers off)."""
    out = ["-m", args.model, "--dtype", args.dtype, "--weights", getattr(args, "weights", "auto"),
           "--kv-dtype", getattr(args, "kv_dtype", "auto"),
           "--min-reuse", str(args.min_reuse), "--chunk", "auto" if args.chunk is None else str(args.chunk),
           "--slots", str(args.slots), "--cache-dir", str(cache_dir)]
    if args.ctx:
        out += ["--ctx", str(args.ctx)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if getattr(args, "speculative", "auto") != "auto":       # else the server's default (on)
        out += ["--speculative", args.speculative]
    if getattr(args, "draft_model", None):
        out += ["--draft-model", args.draft_model]
    if reuse:
        return out + ["--cache-ram", args.cache_ram, "--cache-disk", args.cache_disk]
    return out + ["--no-prefix-kv", "--cache-ram", "0", "--cache-disk", "0"]


def mount_tmpfs(path: Path, size: str) -> None:
    """Mount a tmpfs of `size` at `path` (root only). Raises OSError with mount's message if refused."""
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"mount -t tmpfs refused: {(p.stderr or p.stdout).strip()}")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def run(args) -> int:
    """The soak. Returns the exit status: 1 if a target was missed."""
    from rich.console import Console
    for name, v, low in (("--duration", args.duration, 1), ("--clients", args.clients, 1),
                         ("--turns", args.turns, 1), ("--max-tokens", args.max_tokens, 1), ("--slots", args.slots, 1)):
        if v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    if args.kill_at is None:
        args.kill_at = args.duration / 2
    mix = mix_named(args.mix, args.seed)      # ValueError before any server starts
    if not getattr(args, "verbose", False):
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)     # so the finally blocks below stop the servers
    err = Console(stderr=True)
    out_dir = Path(args.out or f"benchmarks/results/soak-{Path(args.model).stem}")
    tmp = None
    if args.cache_dir:
        cache_dir = Path(args.cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="ternlm-soak-"))
        cache_dir = tmp / "kv"
        cache_dir.mkdir(mode=0o700)       # owner-only, as the server wants a KV directory
    mounted = False
    server = SoakServer(serve_args(args, cache_dir), free_port(), out_dir / "logs")
    soak = Soak(args, server, cache_dir, mix)
    disk_full = None
    try:
        if args.tmpfs:
            mount_tmpfs(cache_dir, args.tmpfs)
            mounted = True
        server.start()
        try:
            with err.status("starting the server ..."):
                server.wait_ready()
            resolve_dtype(args, server)
            with err.status(f"soaking: {args.clients} conversations for {args.duration:.0f} s, "
                            f"kill -9 at {args.kill_at:.0f} s ..."):
                asyncio.run(soak.drive())
            final_metrics = scrape(server.url)
            if args.tmpfs:      # either process may be the one that filled it: the kill resets the flag
                key = 'ternlm_kv_tier_writes_disabled{tier="disk"}'
                disk_full = {"tmpfs_size": args.tmpfs, "writes_disabled": max(
                    final_metrics.get(key, 0.0), soak.metrics_before_kill.get(key, 0.0))}
        finally:
            server.stop()
        with err.status("ternlm cache verify ..."):
            verify_end = cache_verify(cache_dir, dry_run=False)
        cold = cold_check(args, soak, out_dir, err)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(cache_dir)], check=False)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    answers = soak.answers
    verify_after_kill = soak.fault.pop("verify_after_kill")
    result = {
        "command": command_line(), "model": args.model, "dtype": args.dtype,
        "settings": {"duration_s": args.duration, "kill_at_s": args.kill_at, "conversations": args.clients,
                     "slots": args.slots, "turns": args.turns, "max_tokens": args.max_tokens, "mix": args.mix,
                     "speculative": getattr(args, "speculative", "auto"),
                     "source": args.conversations or "synthetic", "system_words": args.system_words,
                     "user_words": args.user_words, "seed": args.seed, "cache_ram": args.cache_ram,
                     "cache_disk": args.cache_disk, "cache_dir": None if tmp else str(cache_dir),
                     "warmup_s": args.warmup, "rss_every_s": args.rss_every, "bin_s": args.bin,
                     "threads": args.threads, "tmpfs": args.tmpfs,
                     "staggered": not args.no_stagger},
        "requests": asdict(soak.outcomes),
        "overall": {"reuse_fraction": reuse_fraction(answers), "prompt_tokens": sum(a.prompt_tokens for a in answers),
                    "cached_tokens": sum(a.cached_tokens for a in answers),
                    "completion_tokens": sum(a.completion_tokens for a in answers),
                    "by_tier": {t: sum(a.cache_tier == t for a in answers) for t in ("slot", "ram", "disk", "none")},
                    **latency(answers)},
        "per_bin": attach_rss(per_bin(answers, args.bin, args.duration), soak.rss),
        "rss": {"samples": soak.rss, "starts_s": soak.starts,
                "growth": [asdict(g) | {"growth": g.growth, "peak_growth": g.peak_growth}
                           for g in rss_growth(soak.rss, soak.starts, args.warmup)]},
        "fault": soak.fault | {"tier_metrics_before_kill": soak.metrics_before_kill,
                               "tier_metrics_at_end": final_metrics},
        "cache_verify": {"after_kill": verify_after_kill, "at_end": verify_end},
        "cold_check": cold,
        "mix": {"name": mix.name, "kinds": mix.describe(), "by_kind": by_kind(answers, cold["rows"], mix)},
        "disk_full": disk_full,
        "answers": [{k: v for k, v in asdict(a).items() if k not in ("messages", "itl_s", "text", "fields")}
                    | {"itl_p50_s": latency([a])["itl_p50_s"]} for a in answers],
    }
    result["verdicts"] = verdicts(result)
    result["missed"] = missed(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_json(out_dir, "results.json", result)
    png = plot(result, out_dir / "soak.png")
    report(result, Console(width=None if sys.stdout.isatty() else 200), [path, png])
    return 1 if result["missed"] else 0


def cold_check(args, soak: Soak, out_dir: Path, err) -> dict:
    """Replay up to --cold-check answers given after the restart (by the only server, without a kill),
    taken in turn from each kind of the mix, against a fresh `--no-prefix-kv` server (started here,
    stopped before returning) with the same fields and seeds; texts must match."""
    picked = pick_for_cold_check(soak.answers, args.cold_check, [k.name for k in soak.mix.kinds])
    if soak.fault["killed_at_s"] is not None and not any(a.generation for a in picked):
        picked = []
    if not picked:
        return {"skipped": "no answers after the restart to compare", "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="ternlm-soak-cold-"))
    cold = SoakServer(serve_args(args, tmp, reuse=False), free_port(), out_dir / "logs" / "cold")
    try:
        cold.start()
        with err.status(f"cold check: {len(picked)} answers against a --no-prefix-kv server ..."):
            cold.wait_ready()
            model = asyncio.run(model_id(cold.url))
            rows = asyncio.run(replay_cold(cold.url, model, picked, args.max_tokens))
    finally:
        cold.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"skipped": None, "rows": rows}
