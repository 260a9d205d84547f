"""`ternlm bench report`: run the headline benchmarks on this machine and write the summary page's
tables (summary.md, summary.json) from what they wrote, so the page is regenerated, never hand-edited.

Each benchmark runs as its own `ternlm bench ...` process (the command a reader reruns, shown above
its table; its load and memory figures are its own process's), with its own --out under DIR/raw/;
summary.json copies its figures from the JSON the benchmark wrote, nothing is measured twice. The
plots the benchmarks make (multi-turn TTFT by turn, streams) stay beside their JSON and are linked.

Peers are optional: transformers (this venv), llama-cpp-python (.venv-peers) and llama.cpp's own
`llama-bench` and `llama-server` (`make bench-peers`: .peers/llama.cpp-*/bin/, found by `--llama-bench auto`
and `--llama-server auto`, the defaults) are found by bench/peers.py and bench/llamacpp.py; a missing one
is a line in its table, not a failure. The engine part gets `--llama-bench` (ternlm ÷ llama-bench, prefill and
decode); the multi-turn replay gets llama-cpp-python's server on the same GGUF as a --url contender and
`--llama-server` (ternlm ÷ llama-server, whole replay time); streams gets llama-server as its batching peer
(llama-cpp-python's server serves one request at a time), reuse runs it beside the worker, spec starts one
per n-gram --spec-type. In full mode without --models, qwen2.5-coder-1.5b, when cached, joins engine,
reuse and multiturn against llama.cpp's binaries only (the Summary's 1.5B rows). The page ends with
RESULTS' Summary rows (report_tables.SUMMARY_ROWS): each one's figure from this run, or why it could not
run here (--quick, a binary not built, a model not cached, a part not run, an ISA this host lacks).
A benchmark that fails is recorded with its exit status
and log, the others still run, and the report exits 1. summary.md/.json are rewritten after every
benchmark, so an interrupted report (Ctrl-C, SIGTERM) leaves what it measured, the rest listed as not run.

Settings: `full` is sized for about 30 minutes on a quiet 2-core host (smollm2-135m and
qwen2.5-coder-0.5b, the commands RESULTS.md quotes, and the 1.5B's three parts; "This run" gives each run's seconds);
`--quick` is a smoke test of the whole path (smollm2-135m, a few tokens, one repeat, no peers).
OpenMP threads sleep while waiting (OMP_WAIT_POLICY=PASSIVE) unless the caller set a policy: on a
shared host spinning threads collapse (Makefile: test)."""
from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .common import command_line, write_json
from .llamacpp import LLAMA_BENCH, LlamaCppServer, find_bin, llama_server, llamacpp_server_argv
from .peers import LLAMACPP, TRANSFORMERS, Peer, find_llamacpp, find_transformers
from .procs import free_port
from .report_tables import FIGURES, LLAMA_SERVER, SUMMARY_ROWS, markdown, summary_rows, summary_rows_text  # noqa: F401
from .sampling_settings import STANDARD as SAMPLING

PARTS = ("engine", "reuse", "multiturn", "tiers", "streams", "grammar", "spec")
DEFAULT_PARTS = PARTS[:-1]    # spec is opt-in (--only ...,spec): whole-file answers would double the report's 30 min
FULL_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
QUICK_MODELS = ("smollm2-135m",)
BIG_MODEL = "qwen2.5-coder-1.5b"   # full mode, when cached: engine/reuse/multiturn against llama.cpp's binaries only
BIG_PARTS = ("engine", "reuse", "multiturn")
SMALL = "smollm2-135m"        # the parts measured on one model only (tiers, streams, grammar)
SERVER_CTX = 8192             # llama.cpp server's context: a 6-turn replay fits
STREAMS_TOP = 8               # the streams part's highest concurrency: llama-server's -np


@dataclass(frozen=True)
class Options:
    out: Path
    quick: bool
    parts: tuple[str, ...]               # a subset of PARTS, in PARTS order
    models: tuple[str, ...]
    threads: int
    transformers: Peer
    llamacpp: Peer
    llama_server: str | None = None      # a llama-server binary: the streams part's batching peer, reuse's turn-2 peer,
                                         # multiturn's replay peer
    llama_bench: str | None = None       # a llama-bench binary: the engine part's peer (--llama-bench)
    auto: frozenset[str] = frozenset()   # binaries found as scripts/build-llamacpp's: the commands say `auto`
    big: tuple[str, ...] = ()            # models run in BIG_PARTS only, with llama.cpp's binaries as the only peers
    asked: dict = field(default_factory=dict)   # the --llama-bench / --llama-server values as given (auto, none, BIN)

    def bin_arg(self, binary: str) -> str:
        return "auto" if binary in self.auto else binary

    @property
    def use_llama_bench(self) -> bool:
        return bool(self.llama_bench) and not self.quick

    @property
    def use_llama_server(self) -> bool:
        return bool(self.llama_server) and not self.quick

    @property
    def use_transformers(self) -> bool:
        return self.transformers.installed and not self.quick

    @property
    def use_llamacpp(self) -> bool:
        return self.llamacpp.installed and not self.quick


@dataclass(frozen=True)
class Step:
    """One benchmark process: `ternlm bench <argv>`, writing into `out`. With `server` (LLAMACPP:
    llama-cpp-python's server, LLAMA_SERVER: the llama-server binary), that server is started on the
    model's GGUF first and `--url URL --label NAME` appended."""
    part: str
    model: str
    argv: tuple[str, ...]
    out: Path
    server: str | None = None

    @property
    def key(self) -> str:
        return f"{self.part}-{self.model}"


def _engine(o: Options, m: str, out: Path) -> Step:
    big = m in o.big          # the 1.5B: llama-bench only (transformers and llama-cpp-python would double its minutes)
    peers = [p for p, use in (("transformers", o.use_transformers), ("llamacpp", o.use_llamacpp)) if use and not big]
    size = (["--prompt-tokens", "64", "--decode-tokens", "8", "--decode-context", "64", "--repeats", "1",
             "--ctx", "1024"] if o.quick else ["--repeats", "3", "--decode-context", "1024"])
    py = ["--llamacpp-python", o.llamacpp.python] if "llamacpp" in peers else []
    lb = ["--llama-bench", o.bin_arg(o.llama_bench)] if o.use_llama_bench else []
    # ternlm's decode greedy and as clients sample, in the same rounds: the table's sampled / greedy ratios
    return Step("engine", m, ("engine", "-m", m, "--threads", str(o.threads), *size,
                              "--peers", ",".join(peers) or "none", *py, *lb, "--sampling", ",".join(SAMPLING),
                              "--out", str(out)), out)


def _reuse(o: Options, m: str, out: Path) -> Step:
    size = ["--history-tokens", "150", "--repeats", "1", "--ctx", "1024"] if o.quick else ["--repeats", "3"]
    py = o.llamacpp.python if o.use_llamacpp and m not in o.big else ""   # "": no peer (bench reuse skips it)
    ls = ["--llama-server", o.bin_arg(o.llama_server)] if o.use_llama_server else []
    return Step("reuse", m, ("reuse", "-m", m, "--threads", str(o.threads), *size, "--llamacpp-python", py, *ls,
                             "--out", str(out)), out)


def _multiturn(o: Options, m: str, out: Path) -> Step:
    size = (["--num-conversations", "1", "--turns", "2", "--max-tokens", "8", "--system-words", "30",
             "--user-words", "12", "--ctx", "1024"] if o.quick else
            ["--num-conversations", "2", "--turns", "6", "--max-tokens", "64"])
    ls = ["--llama-server", o.bin_arg(o.llama_server)] if o.use_llama_server else []    # started by bench multiturn
    return Step("multiturn", m, ("multiturn", "-m", m, "--threads", str(o.threads), *size, *ls, "--out", str(out)),
                out, server=LLAMACPP if o.use_llamacpp and m not in o.big else None)


def _tiers(o: Options, m: str, out: Path) -> Step:
    size = (["--history-tokens", "512", "--next-words", "10", "--repeats", "1", "--warmup", "0", "--seq-mib", "8",
             "--ctx", "2048"] if o.quick else ["--repeats", "3", "--seq-mib", "256"])
    return Step("tiers", m, ("tiers", "-m", m, "--threads", str(o.threads), *size, "--out", str(out)), out)


def _streams(o: Options, m: str, out: Path) -> Step:
    size = (["--concurrency", "1", "2", "--max-tokens", "8", "--repeats", "1", "--ctx", "1024"] if o.quick else
            ["--concurrency", "1", str(STREAMS_TOP), "--max-tokens", "64", "--repeats", "2"])
    return Step("streams", m, ("streams", "-m", m, "--threads", str(o.threads), *size, "--out", str(out)), out,
                server=LLAMA_SERVER if o.use_llama_server else None)


def _grammar(o: Options, m: str, out: Path) -> Step:
    size = ["--decode-tokens", "8", "--repeats", "1", "--ctx", "1024"] if o.quick else ["--repeats", "5"]
    return Step("grammar", m, ("grammar", "-m", m, "--threads", str(o.threads), *size, "--out", str(out)), out)


def _spec(o: Options, m: str, out: Path) -> Step:
    size = (["--turns", "1", "--max-tokens", "16", "--mt-questions", "1", "--mt-max-tokens", "8", "--repeats", "1"]
            if o.quick else ["--turns", "3", "--mt-questions", "4", "--mt-max-tokens", "128", "--repeats", "1"])
    ls = o.bin_arg(o.llama_server) if o.use_llama_server else "none"    # bench spec starts its own, one per --spec-type
    return Step("spec", m, ("spec", "-m", m, "--threads", str(o.threads), *size, "--llama-server", ls,
                            "--out", str(out)), out)


_BUILD = {"engine": _engine, "reuse": _reuse, "multiturn": _multiturn, "tiers": _tiers, "streams": _streams,
          "grammar": _grammar, "spec": _spec}
_ONE_MODEL = {"tiers", "streams", "grammar"}   # on SMALL only: the claim is about tiers/batching/masks, not size


def plan(o: Options) -> list[Step]:
    """The benchmark processes to run, in order. Pure: starts nothing, touches no file."""
    steps = []
    for part in o.parts:
        models = (([m for m in o.models if m == SMALL] or list(o.models[:1])) if part in _ONE_MODEL else
                  [*o.models, *(m for m in o.big if m not in o.models)] if part in BIG_PARTS else o.models)
        for m in models:
            steps.append(_BUILD[part](o, m, o.out / "raw" / f"{part}-{m}"))
    return steps


# ---- running -------------------------------------------------------------------------------------

@dataclass
class StepResult:
    step: Step
    exit: int | None = None              # None: not started (the llama.cpp server failed first)
    seconds: float = 0.0
    command: str = ""                    # as a reader reruns it
    server_command: str | None = None
    error: str | None = None
    json_path: Path | None = None
    extra: dict = field(default_factory=dict)


def _ternlm() -> list[str]:
    """The `ternlm` console script beside this interpreter (bench JSON then records `ternlm bench ...`)."""
    script = Path(sys.executable).parent / "ternlm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ternlm.cli.main"]


def _shown(argv: list[str], env_prefix: str) -> str:
    return env_prefix + "ternlm bench " + " ".join(shlex.quote(a) for a in argv)


def _bench_json(step: Step) -> Path | None:
    """The JSON the benchmark wrote into its (fresh) --out."""
    pattern = {"engine": "engine-*.json", "reuse": "reuse-*.json", "tiers": "tiers-*.json",
               "grammar": "grammar-*.json", "spec": "spec-*.json"}.get(step.part, "results.json")
    found = sorted(step.out.glob(pattern))
    return found[0] if found else None


def run_step(step: Step, env: dict[str, str], env_prefix: str, logs: Path, o: Options) -> StepResult:
    """Run one benchmark process. Side effects: removes and recreates step.out (so no earlier run's JSON
    is read back), writes logs/<key>.log, and for a llama.cpp contender a server process that is stopped
    before this returns."""
    shutil.rmtree(step.out, ignore_errors=True)
    step.out.mkdir(parents=True)
    logs.mkdir(parents=True, exist_ok=True)
    res = StepResult(step)
    argv = list(step.argv)
    t0 = time.perf_counter()
    try:
        if step.server:
            from .common import bench_model
            gguf, log = bench_model(step.model).gguf, logs / f"{step.key}-{step.server}.log"
            if step.server == LLAMACPP:
                port = free_port()
                server = LlamaCppServer(llamacpp_server_argv(o.llamacpp.python, gguf, o.threads, SERVER_CTX, port),
                                        port, log, env)
            else:
                server = llama_server(o.llama_server, gguf, o.threads, STREAMS_TOP, SERVER_CTX * STREAMS_TOP, log,
                                      env=env)
            res.server_command = env_prefix + " ".join(shlex.quote(a) for a in server.argv)
            with server as s:
                argv += ["--url", s.url, "--label", step.server]
                res.command = _shown(argv, env_prefix)
                res.exit = _run(argv, env, logs / f"{step.key}.log")
        else:
            res.command = _shown(argv, env_prefix)
            res.exit = _run(argv, env, logs / f"{step.key}.log")
    except (OSError, RuntimeError, TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"[:500]
    res.seconds = time.perf_counter() - t0
    res.json_path = _bench_json(step)
    return res


def _run(argv: list[str], env: dict[str, str], log: Path) -> int:
    """The benchmark's exit status. Interrupted (Ctrl-C, SIGTERM), it gets SIGINT and 60 s to stop the
    servers it started itself (a SIGKILL would orphan them), then SIGKILL."""
    print(f"    $ ternlm bench {' '.join(shlex.quote(a) for a in argv)}", flush=True)
    with open(log, "wb") as f:
        # SIGINT back to its default in the child: a report started in the background (`&`) inherits it
        # ignored, and the benchmark would then not hear the SIGINT below
        proc = subprocess.Popen(_ternlm() + ["bench", *argv], stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            return proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


# ---- the summary ---------------------------------------------------------------------------------

def _git_commit() -> tuple[str, bool | None]:
    """(short commit, uncommitted changes to tracked files?) or ("unknown", None) outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown", None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=30)
        return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", None


def host() -> dict:
    """CPU model, its hardware ISA class (the flags) and the class ternlm computes in (after the oneDNN
    cap, cpu.py), cores, memory."""
    from ..cpu import probe
    cpu = probe()
    mem_kib = 0
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        pass
    return {"cpu": cpu.model, "isa_class": replace(cpu, onednn_max_isa="").isa_class, "compute_class": cpu.isa_class,
            "compute_class_text": cpu.describe, "cores": os.cpu_count(), "mem_gib": round(mem_kib / (1 << 20), 1),
            "torch": cpu.torch_version}


def _bin_row(name: str, binary: str | None, used: bool, quick: bool, asked: str | None = "auto") -> dict:
    """llama-bench / llama-server: the binary the report found or was given, and whether it ran."""
    text = (f"{name} {binary}" if used else f"{name}: not run (--quick)" if binary and quick
            else f"{name}: not used (--{name} none)" if asked == "none"
            else f"{name}: not built (make bench-peers)")
    return {"installed": bool(binary), "version": None, "binary": binary, "used": used, "text": text}


def find_binary(name: str, arg: str | None) -> str | None:
    """The report's --llama-bench / --llama-server: `auto` (the default): scripts/build-llamacpp's build if there
    is one, else None (the report says so and runs without it); `none`: None; a path: it, which must exist."""
    if arg is None or arg == "none":
        return None
    if arg == "auto":
        return find_bin(name)
    if not Path(arg).exists():
        raise FileNotFoundError(f"--{name} {arg}: no such file")
    return arg


def cached_models() -> set[str]:
    """The registry's models already in the cache (no download). Reads the filesystem only."""
    from ..models.registry import REGISTRY, cached_file
    return {m for m, e in REGISTRY.items() if cached_file(e) is not None}


def _peer_row(p: Peer, used: bool, quick: bool) -> dict:
    text = (f"{p.name} {p.version}" if used else f"{p.name}: not run (--quick)" if quick and p.installed
            else p.missing_text if not p.installed else f"{p.name}: not used")
    return {"installed": p.installed, "version": p.version, "used": used, "text": text}


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass(frozen=True)
class Start:
    """What held when the report began: the page names this commit, not a later HEAD."""
    time: dt.datetime
    commit: str                      # `git rev-parse --short HEAD`, or "unknown" outside a git checkout
    dirty: bool | None               # uncommitted changes to tracked files
    loadavg: float | None            # 1-minute load average

    @staticmethod
    def now() -> "Start":
        return Start(dt.datetime.now(dt.timezone.utc), *_git_commit(), _loadavg())


def summarize(o: Options, results: list[StepResult], start: Start, seconds: float, env_prefix: str,
              pending: list[Step] = ()) -> dict:
    """summary.json: the report's context, then per part and model the benchmark's own figures; `pending`:
    the steps not run (yet, or ever: an interrupted report), listed by key."""
    head, _ = _git_commit()
    parts: dict[str, list[dict]] = {}
    for r in results:
        row = {"model": r.step.model, "exit": r.exit, "seconds": r.seconds, "command": r.command,
               "server_command": r.server_command, "error": r.error,
               "status": "ok" if r.exit == 0 and r.json_path else "failed",
               "log": str((o.out / "logs" / f"{r.step.key}.log").relative_to(o.out)),
               "json": str(r.json_path.relative_to(o.out)) if r.json_path else None, "figures": None}
        if r.json_path:
            bench = json.loads(r.json_path.read_text())
            bench.setdefault("model", r.step.model)      # bench grammar's JSON does not name it
            row["figures"] = FIGURES[r.step.part](bench, r.json_path.parent, o.out)
        parts.setdefault(r.step.part, []).append(row)
    summary = {"report": {"command": command_line(), "mode": "quick" if o.quick else "full",
                       "date": start.time.strftime("%Y-%m-%d %H:%M UTC"), "commit": start.commit,
                       "uncommitted_changes": start.dirty,
                       "commit_now": head if head != start.commit else None,   # HEAD moved while it ran
                       "host": host(), "threads": o.threads, "env": env_prefix.strip() or None,
                       "seconds": seconds, "pending": [st.key for st in pending],
                       # 1-minute load average when the report started and now: more than the cores means other
                       # work shared the CPU and the absolute figures are low (ratios of interleaved runs hold better)
                       "loadavg": {"start": start.loadavg, "now": _loadavg()}},
            "peers": {TRANSFORMERS: _peer_row(o.transformers, o.use_transformers, o.quick),
                      LLAMACPP: _peer_row(o.llamacpp, o.use_llamacpp, o.quick),
                      LLAMA_BENCH: _bin_row(LLAMA_BENCH, o.llama_bench, o.use_llama_bench, o.quick, o.asked.get(LLAMA_BENCH)),
                      LLAMA_SERVER: _bin_row(LLAMA_SERVER, o.llama_server, o.use_llama_server, o.quick,
                                             o.asked.get(LLAMA_SERVER))},
            "parts": parts}
    rep = summary["report"]
    rep["parts_asked"], rep["models_asked"], rep["big_models"] = list(o.parts), list(o.models), list(o.big)
    rep["models_cached"] = sorted(cached_models())
    summary["summary_rows"] = summary_rows(summary, [st.key for st in pending])
    return summary


def default_out(started: dt.datetime) -> Path:
    from ..cpu import probe
    return Path("benchmarks/results/report") / f"{started:%Y-%m-%d}-{replace(probe(), onednn_max_isa='').isa_class}"


def run(args) -> int:
    """Plan, run every step, write DIR/summary.json and DIR/summary.md. Exit 1 if a step failed."""
    start = Start.now()
    parts = tuple(p for p in PARTS if p in (args.only.split(",") if args.only else DEFAULT_PARTS))
    unknown = set(args.only.split(",")) - set(PARTS) if args.only else set()
    if unknown or not parts:
        raise ValueError(f"--only: choose from {','.join(PARTS)} (got {args.only!r})")
    models = tuple(args.models.split(",")) if args.models else QUICK_MODELS if args.quick else FULL_MODELS
    out = Path(args.out) if args.out else default_out(start.time)
    asked = {LLAMA_BENCH: getattr(args, "llama_bench", "auto"), LLAMA_SERVER: getattr(args, "llama_server", "auto")}
    found = {name: find_binary(name, arg) for name, arg in asked.items()}
    # the Summary's 1.5B rows: when -m was not narrowed and the file is already cached (never downloaded here)
    big = ((BIG_MODEL,) if not args.models and not args.quick and BIG_MODEL in cached_models()
           and BIG_MODEL not in models else ())
    o = Options(out, args.quick, parts, models, args.threads or os.cpu_count() or 1,
                find_transformers(), find_llamacpp(args.llamacpp_python), found[LLAMA_SERVER], found[LLAMA_BENCH],
                frozenset(b for n, b in found.items() if b and asked[n] == "auto"), big, asked)
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env_prefix = f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} "
    steps = plan(o)
    print(f"bench report: {len(steps)} benchmark runs into {out} ({'quick' if o.quick else 'full'}; peers: "
          f"{'transformers' if o.use_transformers else '-'}, {'llama.cpp' if o.use_llamacpp else '-'}, "
          f"{'llama-bench' if o.use_llama_bench else '-'}, {'llama-server' if o.use_llama_server else '-'})", flush=True)
    results, t0 = [], time.perf_counter()
    prev_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, s in enumerate(steps, 1):
            print(f"[{i}/{len(steps)}] {s.part} {s.model}", flush=True)
            r = run_step(s, env, env_prefix, out / "logs", o)
            results.append(r)
            verdict = "ok" if r.exit == 0 else f"FAILED (exit {r.exit}{', ' + r.error if r.error else ''}; log {out / 'logs' / (s.key + '.log')})"
            print(f"    {r.seconds:.0f} s, {verdict}", flush=True)
            # the page so far after every step: an interrupted report still leaves what it measured
            summary = _write(o, results, start, time.perf_counter() - t0, env_prefix, steps[i:])
    finally:
        signal.signal(signal.SIGTERM, prev_term)
    print(summary_rows_text(summary["summary_rows"]))
    print(f"wrote {out / 'summary.md'} and summary.json in {summary['report']['seconds']:.0f} s")
    return 0 if all(r["status"] == "ok" for rows in summary["parts"].values() for r in rows) else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt     # SIGTERM like Ctrl-C: the running benchmark stops its servers (_run)


def _write(o: Options, results: list[StepResult], start: Start, seconds: float, env_prefix: str,
           pending: list[Step]) -> dict:
    """Side effect: (re)writes DIR/summary.json and DIR/summary.md."""
    summary = summarize(o, results, start, seconds, env_prefix, pending)
    write_json(o.out, "summary.json", summary)
    (o.out / "summary.md").write_text(markdown(summary))
    return summary
