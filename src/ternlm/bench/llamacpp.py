"""The one llama.cpp launcher: finds llama.cpp's binaries and starts or runs them for every benchmark.

Binaries: `llama-server`, `llama-bench`, `llama-perplexity` as scripts/build-llamacpp builds them
(`.peers/llama.cpp-*/bin/` of this checkout, or of its main checkout from a git worktree), or a path given.
  - llama-server: `llama_server(...)`, a context manager (LlamaCppServer): a free port, started, ready when
    /health answers 200, stopped and reaped on the way out, pass or fail.
  - llama-bench: `llama_bench(...)` runs it with `-o json` and returns its rows (tok/s per test).
  - llama-perplexity: `llama_perplexity(...)` runs it and parses its final estimate (and KL-divergence
    statistics when asked for them).
And llama-cpp-python (the peers venv, `make bench-peers`): its OpenAI server (`llamacpp_server_argv`, ready at
/v1/models: it has no /health) and the JSON-lines timing worker (LlamaCppWorker, llamacpp_worker.py).

Side effects: child processes (they die with this one: PR_SET_PDEATHSIG) and their log files; finding a
binary reads the filesystem only and never builds."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Sequence

from ..procs import die_with_parent
from .common import proc_status
from .procs import HttpChild, free_port

ROOT = Path(__file__).resolve().parents[3]          # the checkout (src/ternlm/bench/ -> ../../..)
LLAMA_SERVER, LLAMA_BENCH, LLAMA_PERPLEXITY = "llama-server", "llama-bench", "llama-perplexity"
BUILD_HOW = "scripts/build-llamacpp (make bench-peers) builds it"
PEERS_PYTHON = ".venv-peers/bin/python"     # the peers venv's interpreter, relative to the checkout (Makefile)
WORKER = Path(__file__).with_name("llamacpp_worker.py")   # imports llama_cpp only: runs by path in that venv
SERVER_MODULE = ("-m", "llama_cpp.server")


# ---- finding the binaries ---------------------------------------------------------------------

def find_bin(name: str, root: Path = ROOT) -> str | None:
    """The `name` binary scripts/build-llamacpp built for the checkout at `root` (`.peers/llama.cpp-*/bin/`,
    the newest build if several), or for its main checkout when `root` is a git worktree (`.git` is then a
    file naming the main repository's worktrees/ entry; worktrees share the main checkout's build, which
    takes 10-20 min). None if there is none: this never builds. Reads the filesystem only."""
    roots = [root]
    dotgit = root / ".git"
    if dotgit.is_file() and (t := dotgit.read_text().strip()).startswith("gitdir:"):
        gitdir = Path(t.split(":", 1)[1].strip())          # <main>/.git/worktrees/<name>
        if gitdir.parent.name == "worktrees":
            roots.append(gitdir.parent.parent.parent)
    for r in roots:
        found = sorted(r.glob(f".peers/llama.cpp-*/bin/{name}"), key=lambda f: f.stat().st_mtime)
        if found:
            return str(found[-1])
    return None


def find_llama_server(root: Path = ROOT) -> str | None:
    return find_bin(LLAMA_SERVER, root)


def resolve_bin(name: str, arg: str | None, root: Path = ROOT) -> str | None:
    """A --llama-server/--llama-bench/--llama-perplexity value: None or `none` (not asked: None), `auto` (the
    checkout's build; FileNotFoundError naming the binary if there is none), or a path (must exist)."""
    if arg is None or arg == "none":
        return None
    binary = find_bin(name, root) if arg == "auto" else arg
    if binary is None:
        raise FileNotFoundError(f"{name}: not found in .peers/llama.cpp-*/bin/ ({BUILD_HOW}; or give its path)")
    if not Path(binary).exists():
        raise FileNotFoundError(f"{name} {binary}: no such file")
    return binary


def peers_python(root: Path = ROOT) -> Path:
    """The peers venv's interpreter in the checkout at `root`, whether it exists or not. Pure."""
    return root / PEERS_PYTHON


# ---- servers ------------------------------------------------------------------------------------

def llama_server_argv(binary: str, gguf: Path, threads: int, slots: int, n_ctx: int, port: int,
                      extra: Sequence[str] = ()) -> list[str]:
    """llama.cpp's own C++ server with `slots` parallel sequences, `threads` for prompt and generation (its
    -tb defaults to -t), `extra` flags last: the batching peer, where llama-cpp-python's server serves one
    request at a time. Pure."""
    return [binary, "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(n_ctx),
            "--host", "127.0.0.1", "--port", str(port), *extra]


def llama_spec_types(binary: str) -> list[str]:
    """The n-gram --spec-type values this llama-server build lists in its --help (ngram-simple, ngram-mod,
    ...): read, not assumed, as builds differ. Runs the binary once."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    m = re.search(r"--spec-type\s+([\w,-]+)", out.stdout + out.stderr)
    return [t for t in m.group(1).split(",") if t.startswith("ngram")] if m else []


def llamacpp_server_argv(python: str, gguf: Path, threads: int, n_ctx: int, port: int, extra: Sequence[str] = (),
                         run: Sequence[str] = SERVER_MODULE) -> list[str]:
    """llama-cpp-python's server on the same GGUF, the same threads for prompt and generation, `extra` flags
    last. `run`: how the interpreter starts it (`-m llama_cpp.server`, or `-c CODE` that patches it first). Pure."""
    return [python, *run, "--model", str(gguf), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port", str(port), *extra]


class LlamaCppServer(HttpChild):
    """`with LlamaCppServer(argv, port, log_path) as s:` starts llama.cpp's server (either argv above), waits until
    `ready` answers 200 (llama-server: /health, 503 while loading; llama-cpp-python: /v1/models, it has no
    /health), and stops it on the way out (SIGTERM, then SIGKILL after 15 s), pass or fail. `env`: the
    child's whole environment (None: this one's)."""

    what = "llama.cpp server"

    def __init__(self, argv: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 ready: str = "/v1/models"):
        super().__init__(argv, port, log_path, ready, env=env, stop_timeout_s=15.0)


def llama_server(binary: str, gguf: Path, threads: int, slots: int, n_ctx: int, log_path: Path,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None,
                 port: int | None = None) -> LlamaCppServer:
    """llama-server on `gguf` on a free port (or `port`), ready at /health: use as `with llama_server(...) as s`."""
    port = port or free_port()
    return LlamaCppServer(llama_server_argv(binary, gguf, threads, slots, n_ctx, port, extra), port, log_path,
                          env, ready="/health")


class LlamaCppWorker:
    """llama-cpp-python in its own venv and process (it must not share our interpreter), driven over
    JSON lines (llamacpp_worker.py lists the commands). Side effect: a child process until close(), which
    dies with this one."""

    def __init__(self, python: str, model_path: Path, threads: int, n_ctx: int):
        self.proc = subprocess.Popen([python, str(WORKER), str(model_path), str(threads), str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=die_with_parent)
        self.call({"op": "ping"})

    def status(self) -> dict[str, int]:
        """The worker process's /proc status (KiB): its RSS holds llama.cpp's model and Python."""
        return proc_status(self.proc.pid)

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


# ---- llama-bench ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchRow:
    """One llama-bench test: `pp512` (n_prompt 512), `tg64 @ d512` (64 generated after a 512-token context)."""
    test: str
    n_prompt: int
    n_gen: int
    n_depth: int
    threads: int
    avg_tok_s: float        # llama-bench's own figure (the mean of its repetitions, what its table prints)
    stddev_tok_s: float
    median_tok_s: float     # the median of samples, as ternlm's bench reports
    samples_tok_s: tuple[float, ...]


def llama_bench_argv(binary: str, gguf: Path, threads: int, repeats: int, n_prompt: int, n_gen: int,
                     depth: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """llama-bench on `gguf`: one test (`-p N -n 0`: prefill; `-p 0 -n N -d D`: decode after D tokens), `repeats`
    repetitions, JSON out. Pure."""
    argv = [binary, "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-p", str(n_prompt), "-n", str(n_gen)]
    return argv + (["-d", str(depth)] if depth else []) + [*extra, "-o", "json"]


def parse_llama_bench(text: str) -> list[BenchRow]:
    """llama-bench's `-o json` output (a list of tests) as rows. Pure."""
    rows = []
    for t in json.loads(text):
        n_p, n_g, d = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0)), int(t.get("n_depth", 0) or 0)
        name = (f"pp{n_p}" if n_p else "") + ("+" if n_p and n_g else "") + (f"tg{n_g}" if n_g else "")
        samples = tuple(float(x) for x in t.get("samples_ts") or [t["avg_ts"]])
        rows.append(BenchRow(name + (f" @ d{d}" if d else ""), n_p, n_g, d, int(t.get("n_threads", 0)),
                             float(t["avg_ts"]), float(t.get("stddev_ts", 0.0)), median(samples), samples))
    return rows


def llama_bench(binary: str, gguf: Path, threads: int, repeats: int, n_prompt: int, n_gen: int, depth: int = 0,
                extra: Sequence[str] = (), timeout_s: float = 3600.0) -> list[BenchRow]:
    """Run llama-bench once (llama_bench_argv) and return its rows. Raises RuntimeError with its stderr's end
    if it fails. Side effect: the process, for its duration (it loads the model itself)."""
    argv = llama_bench_argv(binary, gguf, threads, repeats, n_prompt, n_gen, depth, extra)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {r.returncode}:\n{r.stderr[-2000:]}")
    return parse_llama_bench(r.stdout)


def format_bench_row(r: BenchRow) -> str:
    """A row as llama-bench's own table reads it (`pp512  123.45 ± 0.67`), with the median beside."""
    return f"{r.test:14s} {r.avg_tok_s:9.2f} ± {r.stddev_tok_s:.2f} tok/s (median {r.median_tok_s:.2f}, t {r.threads})"


# ---- llama-perplexity -----------------------------------------------------------------------------

_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)(?: \+/- ([0-9.]+))?")
# --kl-divergence's summary: "Mean    KLD:   0.012345 ±   0.000123", "Same top p:  97.123 ±  0.123 %", ...
_STAT = re.compile(r"^(Mean PPL\(Q\)|Mean PPL\(base\)|Mean\s+KLD|Same top p|RMS Δp|Median\s+KLD|Maximum\s+KLD)"
                   r"\s*:\s*([-0-9.]+)", re.M)


def parse_perplexity(text: str) -> dict:
    """llama-perplexity's output: {"perplexity", "perplexity_err"} from its final estimate, and with
    --kl-divergence its summary statistics under "kld" (e.g. "Same top p" in percent). Pure."""
    out: dict = {}
    if m := _PPL.search(text):
        out["perplexity"] = float(m[1])
        if m[2]:
            out["perplexity_err"] = float(m[2])
    stats = {re.sub(r"\s+", " ", k): float(v) for k, v in _STAT.findall(text)}
    if stats:
        out["kld"] = stats
    return out


def llama_perplexity(binary: str, gguf: Path, text_file: Path, n_ctx: int, threads: int, batch: int | None = None,
                     extra: Sequence[str] = (), log_path: Path | None = None, timeout_s: float = 3600.0) -> dict:
    """Run llama-perplexity on `gguf` over `text_file` (it tokenizes the text itself) in chunks of `n_ctx`;
    `extra`: e.g. ["--chunks", "4", "--kl-divergence-base", F]. Returns {"command", parse_perplexity's keys}
    or {"command", "error"}. Side effects: the process; its whole output in `log_path` if given."""
    cmd = [binary, "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-t", str(threads),
           "-b", str(batch or n_ctx), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent)
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text(r.stdout + r.stderr)
    got = parse_perplexity(r.stdout + r.stderr)
    if r.returncode != 0 or not got:
        return {"command": " ".join(cmd), "error": (r.stderr.strip().splitlines() or [str(r.returncode)])[-1]}
    return {"command": " ".join(cmd), **got}
