"""A mixture of experts under a memory cap (issue 36's headline): ternlm streaming experts from the
GGUF vs llama.cpp mapping it, each server in its own memory cgroup with the SAME limit, on a 2-turn
conversation. A cgroup v1 limit bounds the group's anonymous memory AND its page cache, so a capped
llama.cpp cannot keep the mapped file resident either: both engines read from disk what does not fit.

Contenders (each started fresh, the file's pages dropped from the page cache first: a cold start):
  reuse       ternlm serve, prefix KV reuse on (slot only: RAM and disk tiers off), --expert-cache EC
  no-reuse    the same with --no-prefix-kv
  llama.cpp   llama-cpp-python's server (.venv-peers), same file, mmap without mlock (llama-server's
              default; the Python server's own default mmap+mlock pins the whole mapping, so any cap
              below the file OOM-kills it at load), weight repacking off (llama-server's --no-repack:
              see NO_REPACK), its own prefix reuse (Llama.generate keeps the longest common prefix
              of its previous input)
  llama.cpp-repack  the same with llama.cpp's repacking on (its default: experts copied into anonymous memory)
  llama-server  llama.cpp's own C++ server (scripts/build-llamacpp; what a llama.cpp user runs): mmap, its
              own defaults (prompt cache on: turn 2 reuses turn 1's prefix), plus --llama-server-args
              (e.g. --no-repack, -b/-ub); the peer issue 49 asks for

The conversation (identical rendered text for every contender; /v1/completions, greedy, stream):
  turn 1: ChatML user message of ~T1 tokens of words -> max_tokens N answer
  turn 2: turn 1's prompt + a FIXED answer text + a user message of ~T2 new tokens -> N tokens
A fixed answer, not each engine's own: random weights generate `<extra_N>` filler tokens whose text
re-tokenizes to ~13 byte tokens each, so neither engine could reuse its generated tokens anyway;
a fixed answer keeps the turn-2 prompt the same bits for all three (reuse = the turn-1 prompt).

Per turn: TTFT (request sent -> first streamed text), decode tok/s ((last - first text chunk) /
(chunks - 1)), disk bytes read by the server process (/proc/PID/io read_bytes before/after; page
faults on a mapping count too), ternlm's `timings.experts` counters, and the read/compute overlap for
every engine: the disk's busy share of the turn (/sys/dev/block/.../stat io_ticks: time with a request in
flight, any process) and the server's CPU busy share (its threads' utime + stime over wall x --threads);
ternlm's experts also say how long the step waited for reads and converted (read_wait_us, convert_us). Per run: load time, the
cgroup's peak charge (memory.max_usage_in_bytes: anon + page cache), failcnt, OOM kills
(memory.oom_control), the process's VmHWM and whether it died.

    .venv/bin/python benchmarks/moe_capped.py -m FILE.gguf --cap 2GiB [--expert-cache auto|SIZE]
        [--contenders reuse no-reuse llama.cpp] [--chunk 256] [--t1 2000 --t2 200 --max-tokens 32]
        [--port 8130] [--tag NAME] [--out benchmarks/results/moe-capped]

Writes OUT/TAG-CONTENDER.json (+ .log) per run and regenerates OUT/runs.md from every JSON there. Must run
as root (cgroup, /proc/PID/io); creates the cgroups under its own memory cgroup and removes them.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ternlm.bench.llamacpp import (LLAMA_SERVER, SERVER_MODULE, find_bin, llama_server_argv,  # noqa: E402
                                   llamacpp_server_argv, peers_python)
from ternlm.bench.procs import HttpChild  # noqa: E402
from ternlm.sizes import parse_size  # noqa: E402

MEMCG = Path("/sys/fs/cgroup/memory")
GiB = 1 << 30

WORDS = ("the a of and to in is that it was for on are as with his they at be this from have or by one had "
         "not but what all were when we there can an your which their said if do will each about how up out "
         "them then she many some so these would other into has more her two like him see time could no make "
         "than first been its who now people my made over did down only way find use may water long little "
         "very after words called just where most know get through back much before go good new write our "
         "used me man too any day same right look think also around another came come work three word must "
         "because does part even place well such here take why things help put years different away again "
         "off went old number great tell men say small every found still between name should home big give "
         "air line set own under read last never us left end along while might next sound below saw").split()
TOKENS_PER_CHAR = 0.93      # the synthetic files' byte-level BPE (5 merges) on these words: measured
FIXED_ANSWER = "Here is a short answer to that one."   # ~32 tokens, as a max_tokens 32 answer


# ---- the cgroup ------------------------------------------------------------------------------------

@dataclass
class Cgroup:
    """A memory cgroup (v1) below this process's own, limited to `limit` bytes (memory + page cache).
    `join` is a preexec_fn: the child moves itself in before exec, so every byte it touches counts."""
    path: Path
    limit: int

    @classmethod
    def create(cls, name: str, limit: int) -> "Cgroup":
        mine = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                    if "memory" in line.split(":", 2)[1].split(","))
        path = MEMCG / mine.strip().lstrip("/") / name
        if path.exists():
            path.rmdir()
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
        return cls(path, limit)

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def read(self, name: str) -> str:
        return (self.path / name).read_text()

    def snapshot(self) -> dict:
        stat = dict(line.split() for line in self.read("memory.stat").splitlines())
        oom = dict(line.split() for line in self.read("memory.oom_control").splitlines())
        return {"usage": int(self.read("memory.usage_in_bytes")), "peak": int(self.read("memory.max_usage_in_bytes")),
                "failcnt": int(self.read("memory.failcnt")), "oom_kill": int(oom.get("oom_kill", 0)),
                "rss": int(stat["rss"]), "cache": int(stat["cache"]), "mapped_file": int(stat["mapped_file"])}

    def remove(self) -> None:
        for _ in range(50):                 # the killed process leaves the group a moment after wait()
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"cgroup {self.path} not removable")


def _preexec(cg: Cgroup):
    def run() -> None:
        os.setsid()
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG: dies with this script
        cg.join()
    return run


def drop_file_pages(path: Path) -> None:
    """Cold start for the next contender: the file's clean, unmapped pages leave the page cache
    (posix_fadvise DONTNEED on this file only: other users' caches are left alone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def proc_io(pid: int) -> dict:
    return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}


def proc_status(pid: int) -> dict:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024
    return out


# ---- the conversation ------------------------------------------------------------------------------

def words(n_tokens: int, rng: random.Random) -> str:
    out, chars = [], 0
    while chars * TOKENS_PER_CHAR < n_tokens:
        w = rng.choice(WORDS)
        out.append(w)
        chars += len(w) + 1
    return " ".join(out)


def conversation(t1: int, t2: int, seed: int = 0) -> tuple[str, str]:
    """(turn-1 prompt, turn-2 prompt), ChatML rendered (the synthetic files' template)."""
    rng = random.Random(seed)
    p1 = f"<|im_start|>user\n{words(t1 - 10, rng)}<|im_end|>\n<|im_start|>assistant\n"
    p2 = p1 + f"{FIXED_ANSWER}<|im_end|>\n<|im_start|>user\n{words(t2 - 10, rng)}<|im_end|>\n<|im_start|>assistant\n"
    return p1, p2


@dataclass
class Turn:
    ttft_s: float
    total_s: float
    chunks: int                     # streamed chunks with text (one token each for both servers here)
    decode_tok_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    read_bytes: int                 # /proc/PID/io read_bytes delta: bytes the server pulled off the disk
    disk_busy: float | None         # share of the turn with a disk request in flight (io_ticks), any process
    cpu_busy: float                 # the server's CPU seconds over (turn wall time x threads)
    rchar: int                      # bytes its read()/pread() calls returned (page cache or disk)
    cgroup_after: dict
    loadavg: tuple                  # the host's load average when the turn ended (a shared machine)
    timings: dict | None            # ternlm's timings (prompt_n, cache_n, experts ...); None for llama.cpp
    text: str


def disk_ticks(path: Path) -> int | None:
    """Milliseconds the block device holding `path` has had a request in flight (io_ticks, the 10th field
    of /sys/dev/block/MAJ:MIN/stat), or None where there is no such file (an overlay, tmpfs)."""
    st = os.stat(path).st_dev
    f = Path(f"/sys/dev/block/{os.major(st)}:{os.minor(st)}/stat")
    try:
        return int(f.read_text().split()[9])
    except (OSError, IndexError, ValueError):
        return None


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU seconds, every thread (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_turn(url: str, model: str, prompt: str, max_tokens: int, pid: int, cg: Cgroup, timeout: float,
             disk: Path, threads: int) -> Turn:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    io0, cpu0, ticks0 = proc_io(pid), cpu_seconds(pid), disk_ticks(disk)
    t0 = time.perf_counter()
    times, text, usage, timings, done = [], [], None, None, False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices") or []:
                if c.get("text"):
                    times.append(time.perf_counter() - t0)
                    text.append(c["text"])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    total = time.perf_counter() - t0
    if not done:                    # a server killed mid-stream closes the stream without [DONE]
        raise ConnectionError(f"stream ended without [DONE] after {len(times)} chunks")
    io1, cpu1, ticks1 = proc_io(pid), cpu_seconds(pid), disk_ticks(disk)
    n = len(times)
    return Turn(ttft_s=times[0] if times else total, total_s=total, chunks=n,
                decode_tok_s=(n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
                prompt_tokens=(usage or {}).get("prompt_tokens"), completion_tokens=(usage or {}).get("completion_tokens"),
                read_bytes=io1["read_bytes"] - io0["read_bytes"], rchar=io1["rchar"] - io0["rchar"],
                disk_busy=None if ticks0 is None or ticks1 is None else (ticks1 - ticks0) / 1e3 / total,
                cpu_busy=(cpu1 - cpu0) / (total * threads),
                cgroup_after=cg.snapshot(), loadavg=os.getloadavg(), timings=timings, text="".join(text)[:200])


# ---- the contenders --------------------------------------------------------------------------------

# llama-cpp-python's server with llama.cpp's weight repacking off (llama-server's --no-repack;
# model param use_extra_bufts, which the Python server does not expose): on AVX-512 llama.cpp copies
# the Q4_K expert tensors into an anonymous CPU_REPACK buffer at load (740 MiB of olmoe-small's
# 930), i.e. it does NOT stream them from the mapping; repacking off keeps every weight mapped.
NO_REPACK = ("import runpy, sys, llama_cpp.llama_cpp as C\n"
             "_default = C.llama_model_default_params\n"
             "def _params():\n    p = _default(); p.use_extra_bufts = False; return p\n"
             "C.llama_model_default_params = _params\n"
             "sys.argv[0] = 'llama_cpp.server'\n"
             "runpy.run_module('llama_cpp.server', run_name='__main__')\n")
LLAMA = ("llama.cpp", "llama.cpp-repack", "llama-server")
PORTS = {"reuse": 0, "no-reuse": 1, "llama.cpp": 2, "llama.cpp-repack": 3, "llama-server": 4}


def command(kind: str, model: Path, port: int, args) -> list[str]:
    if kind == "llama-server":
        binary = args.llama_server or find_bin(LLAMA_SERVER, ROOT)
        if binary is None:
            raise SystemExit("no llama-server: build it with scripts/build-llamacpp (~15 min) or give --llama-server")
        return llama_server_argv(binary, model, args.threads, 1, args.ctx, port) + args.llama_server_args
    if kind in LLAMA:
        # --use_mlock False: llama-server's default; the Python server's default mlock pins the mapping
        return llamacpp_server_argv(str(peers_python(ROOT)), model, args.threads, args.ctx, port,
                                    ["--use_mlock", "False", *args.llama_args],
                                    run=("-c", NO_REPACK) if kind == "llama.cpp" else SERVER_MODULE)
    cmd = [str(ROOT / ".venv/bin/ternlm"), "serve", "-m", str(model), "--port", str(port), "--threads",
           str(args.threads), "--ctx", str(args.ctx), "--slots", "1", "--expert-cache", args.expert_cache,
           "--chunk", args.chunk, "--cache-ram", "0", "--cache-disk", "0"]
    return cmd + (["--no-prefix-kv"] if kind == "no-reuse" else [])


def served_model(url: str) -> str:
    """The served model's id (asked once the server is ready)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_contender(kind: str, args, out: Path) -> dict:
    port = args.port + PORTS[kind]
    url = f"http://127.0.0.1:{port}"
    name = f"{args.tag}-{kind}"
    cmd = command(kind, args.model, port, args)
    rec = {"tag": args.tag, "contender": kind, "model": str(args.model), "file_bytes": args.model.stat().st_size,
           "cap": args.cap, "expert_cache": args.expert_cache if kind not in LLAMA else None,
           "chunk": args.chunk if kind not in LLAMA else None, "threads": args.threads, "ctx": args.ctx,
           "t1": args.t1, "t2": args.t2, "max_tokens": args.max_tokens,
           "env": dict(args.env) if kind not in LLAMA else {}, "command": " ".join(cmd),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_before": os.getloadavg(),
           "turns": [], "died": False, "error": None}
    drop_file_pages(args.model)
    cg = Cgroup.create(f"ternlm-moe-capped-{kind}-{os.getpid()}", args.cap)   # this run's own: never another's
    env = dict(os.environ, **(dict(args.env) if kind not in LLAMA else {}))
    if args.omp_wait == "passive":          # both engines alike; "default" leaves OpenMP spinning, as users run
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    rec["omp_wait"] = args.omp_wait
    # ready: ternlm and llama-server at /health 200 (ternlm answers /v1/models while still loading);
    # llama-cpp-python's server has no /health, its /v1/models answers after the load
    ready = "/v1/models" if kind in LLAMA and kind != "llama-server" else "/health"
    # _preexec: setsid (stopped as a group) and the cgroup; ternlm's shutdown grace waits for a running request
    child = HttpChild(cmd, port, out / f"{name}.log", ready, env=env, preexec_fn=_preexec(cg), cwd=ROOT, group=True,
                      stop_timeout_s=10)
    t0 = time.perf_counter()
    proc = child.start().proc
    try:
        child.wait_ready(args.load_timeout)
        model = served_model(url)
        rec["load_s"] = time.perf_counter() - t0
        rec["after_load"] = {"cgroup": cg.snapshot(), "proc": proc_status(proc.pid), "io": proc_io(proc.pid)}
        # ternlm's load hashes the whole file (sha256: the KV namespace) through the page cache; drop
        # those pages so turn 1 starts cold for every contender (mapped pages, llama.cpp's, stay: its
        # mmap load populates them, part of its load)
        drop_file_pages(args.model)
        rec["after_drop"] = {"cgroup": cg.snapshot()}
        p1, p2 = conversation(args.t1, args.t2)
        for i, prompt in enumerate(() if args.load_only else (p1, p2), 1):
            turn = run_turn(url, model, prompt, args.max_tokens, proc.pid, cg, args.turn_timeout, args.model,
                            args.threads)
            rec["turns"].append(asdict(turn))
            print(f"  {name} turn {i}: ttft {turn.ttft_s:.2f} s, decode {turn.decode_tok_s or 0:.2f} tok/s, "
                  f"read {turn.read_bytes / 1e9:.2f} GB, disk busy {turn.disk_busy or 0:.0%}, cpu busy "
                  f"{turn.cpu_busy:.0%}, prompt {turn.prompt_tokens}, "
                  f"experts {(turn.timings or {}).get('experts')}", file=sys.stderr, flush=True)
        rec["proc_end"] = proc_status(proc.pid)
    except Exception as e:                                   # a failed run is a result: record it
        rec["error"] = f"{type(e).__name__}: {e}"
        print(f"  {name}: {rec['error']}", file=sys.stderr, flush=True)
    finally:
        rec["died"] = proc.poll() is not None
        rec["returncode"] = proc.returncode
        rec["cgroup_end"] = cg.snapshot()
        child.stop()
        cg.remove()
    rec["log_tail"] = (out / f"{name}.log").read_text().splitlines()[-30:]
    rec["chunk_plan"] = next((line.split("prefill chunk: ", 1)[1] for line in (out / f"{name}.log").read_text().splitlines()
                              if "prefill chunk: " in line), None)
    rec["expert_plan"] = next((line.split("expert cache: ", 1)[1] for line in rec["log_tail"] + (out / f"{name}.log").read_text().splitlines()
                               if "expert cache: " in line), None)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1))
    return rec


# ---- the table -------------------------------------------------------------------------------------

def _gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:.2f}"


def table(out: Path) -> str:
    rows = []
    for f in sorted(out.glob("*.json")):
        r = json.loads(f.read_text())
        if "contender" not in r:                 # another JSON in OUT (e.g. a micro-benchmark's)
            continue
        t = r["turns"] + [None] * (2 - len(r["turns"]))
        cg = r.get("cgroup_end", {})
        hwm = (r.get("proc_end") or {}).get("VmHWM")

        def cell(turn, key, fmt="{:.2f}"):
            v = turn.get(key) if turn else None
            return "-" if v is None else fmt.format(v)

        def reuse(turn):
            tm = (turn or {}).get("timings") or {}
            return f"{tm['cache_n']}/{tm['cache_n'] + tm['prompt_n']}" if "cache_n" in tm else "-"

        def experts(turn):
            e = ((turn or {}).get("timings") or {}).get("experts")
            if not e:
                return "-"
            waits = (f", wait {e['read_wait_us'] / 1e6:.1f} s, convert {e['convert_us'] / 1e6:.1f} s"
                     if "read_wait_us" in e else "")
            return f"{e['misses']}/{e['hits'] + e['misses']} miss, {e['bytes_read'] / 1e9:.2f} GB{waits}"

        def busy(turn):
            if not turn or turn.get("cpu_busy") is None:
                return "-"
            disk = "-" if turn.get("disk_busy") is None else f"{turn['disk_busy']:.0%}"
            return f"{disk} / {turn['cpu_busy']:.0%}"
        status = "OOM-killed" if cg.get("oom_kill") else ("died" if r["died"] else ("error" if r["error"] else "ok"))
        rows.append(f"| {r['tag']} | {r['contender']} | {r['cap'] / GiB:.2f} | {r['file_bytes'] / 1e9:.2f} | "
                    f"{r['expert_cache'] or '-'} | {(r.get('chunk_plan') or '').split(' ')[0] or r['chunk'] or '-'} | {'yes' if r.get('env') else '-'} | "
                    f"{r.get('load_s', 0):.1f} | "
                    f"{cell(t[0], 'ttft_s')} | {cell(t[1], 'ttft_s')} | {reuse(t[1])} | "
                    f"{cell(t[0], 'decode_tok_s')} | {cell(t[1], 'decode_tok_s')} | "
                    f"{_gb((t[0] or {}).get('read_bytes'))} | {_gb((t[1] or {}).get('read_bytes'))} | "
                    f"{experts(t[0])} | {experts(t[1])} | {busy(t[0])} | {busy(t[1])} | "
                    f"{_gb(cg.get('peak'))} | {_gb(hwm)} | "
                    f"{cg.get('failcnt', '-')} | {status} |")
    head = ("| run | contender | cap GiB | file GB | expert cache | chunk | alloc env | load s | turn-1 TTFT s | "
            "turn-2 TTFT s | turn-2 reuse | turn-1 decode tok/s | turn-2 decode tok/s | read GB t1 | "
            "read GB t2 | experts t1 | experts t2 | disk / cpu busy t1 | disk / cpu busy t2 | cgroup peak GB | "
            "VmHWM GB | failcnt | status |\n"
            "|" + "---|" * 23)
    return head + "\n" + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--cap", required=True, help="cgroup memory limit, e.g. 8GiB")
    ap.add_argument("--expert-cache", default="auto")
    ap.add_argument("--contenders", nargs="+", default=["reuse", "no-reuse", "llama.cpp"],
                    choices=list(PORTS))
    ap.add_argument("--chunk", default="auto", help="ternlm's prefill chunk (--chunk N|auto)")
    ap.add_argument("--t1", type=int, default=2000)
    ap.add_argument("--t2", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--port", type=int, default=8130)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("--turn-timeout", type=float, default=1800)
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="environment for the ternlm contenders (e.g. allocator settings)")
    ap.add_argument("--llama-args", nargs="*", action="extend", default=[], metavar="ARG",
                    help="extra llama_cpp.server flags, e.g. --n_batch 128 (use --llama-args=--n_batch ...)")
    ap.add_argument("--llama-server", default=None, metavar="BIN",
                    help="llama.cpp's llama-server (default: the one scripts/build-llamacpp built)")
    ap.add_argument("--llama-server-args", nargs="*", action="extend", default=[], metavar="ARG",
                    help="extra llama-server flags (use --llama-server-args=--no-repack, -b ...)")
    ap.add_argument("--omp-wait", choices=["passive", "default"], default="passive",
                    help="OMP_WAIT_POLICY for every contender: PASSIVE (this script's figures so far) or the "
                         "OpenMP default (spinning: what users get)")
    ap.add_argument("--load-only", action="store_true", help="start, record the load (and the expert plan), stop")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/moe-capped")
    args = ap.parse_args(argv)
    args.cap = parse_size(args.cap)
    args.env = [tuple(kv.split("=", 1)) for kv in args.env]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # `finally` stops the server, removes the cgroup
    args.tag = args.tag or args.model.stem
    args.out.mkdir(parents=True, exist_ok=True)
    for kind in args.contenders:
        print(f"{args.tag}: {kind} (cap {args.cap / GiB:.2f} GiB)", file=sys.stderr, flush=True)
        run_contender(kind, args, args.out)
    md = args.out / "runs.md"          # every run in OUT; TABLE.md (the notes) quotes it
    md.write_text(table(args.out))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
