"""`ternlm bench tiers`: where the next turn's KV prefix comes from, and what that costs.

A ~4,000-token conversation (the previous turn) has been answered; the next turn = it + the answer +
a short new user message. Time to first token of that next turn, greedy, when its prefix is

    slot       still in the live slot (the previous turn just ran there)
    ram        in the RAM tier (the slot was taken by an unrelated prompt, which saved it down a tier)
    disk-cold  in the disk tier only (RAM budget 0), its block files dropped from the page cache
    disk-warm  in the disk tier only, its block files still in the page cache
    none       nowhere: prefix reuse off, the whole prompt is prefilled

interleaved (slot ram disk-cold disk-warm none, slot ram ...), medians over --repeats after a warm-up
round. Every case must produce the same first token and logits bit-identical to the same round's cold
prefill ("none", itself compared with the first round's), and must have restored from the tier it is
named after; exit 1 otherwise. The tiers hold the previous turn's whole blocks and its last partial
block (a tail entry), so the ram and disk cases should prefill exactly what the slot case does.
Besides: the disk tier's load bandwidth (bytes of
block files read / seconds reading and verifying them) against the same disk's sequential read
bandwidth (one large file, large reads, page cache dropped: the physical limit), the same block files
read raw (no verification), and sha256 throughput (what verification costs).

One Engine per run (weights load once). The slot and RAM cases get a fresh TieredStore each, swapped
in as `engine.store`, so no tier holds blocks left over from another case; the disk cases share one
disk-only store per round, in a fresh folder (disk-cold writes the blocks, disk-warm finds them), and
wait for its spill thread to finish writing before the timed turn; the previous turn is put back
into the slot from a private "seed" RAM store (its KV is bit-identical to a fresh prefill and costs a
fraction of one). Page cache: posix_fadvise(DONTNEED) per file, checked with mincore; falls back to
/proc/sys/vm/drop_caches only if pages stay resident.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .common import command_line, long_chat, median, synthetic_text, write_json

CASES = ("slot", "ram", "disk-cold", "disk-warm", "none")
EXPECT_TIER = {"slot": "slot", "ram": "ram", "disk-cold": "disk", "disk-warm": "disk", "none": "none"}
BIG = 1 << 40                      # "large enough" budget for a tier (bytes)
READ_CHUNK = 16 << 20              # sequential reads: 16 MiB at a time
PREV_ANSWER_TOKENS = 24            # the previous turn's answer, as `bench reuse` generates it


# ---- the page cache ------------------------------------------------------------------------------

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore); None where that cannot be asked."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def drop_page_cache(paths: list[Path]) -> dict:
    """Evict the files from the page cache: fsync + posix_fadvise(DONTNEED) each; only if pages stay
    resident, write 1 to /proc/sys/vm/drop_caches (needs root; skipped silently otherwise)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    method = "fadvise"
    left = resident_fraction(paths)
    if left:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            method = "fadvise+drop_caches"
            left = resident_fraction(paths)
        except OSError:
            pass
    return {"method": method, "resident_after": left}


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*/*.tkv"))


# ---- raw disk bandwidth --------------------------------------------------------------------------

def write_seq_file(path: Path, size: int) -> None:
    """`size` bytes of random data (incompressible), fsynced."""
    chunk = os.urandom(min(READ_CHUNK, size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = size
        while left:
            left -= os.write(fd, chunk[:min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_files(paths: list[Path], buf: bytearray) -> tuple[int, float]:
    """Read the files front to back with large reads into `buf` (no verification): (bytes, seconds)."""
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                total += got
    return total, time.perf_counter() - t0


def sha256_rate(nbytes: int) -> float:
    """Bytes per second of hashlib.sha256 over an in-memory buffer of `nbytes` (what verifying costs)."""
    data = os.urandom(min(nbytes, 64 << 20)) * max(1, nbytes // (64 << 20))
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return len(data) / (time.perf_counter() - t0)


# ---- the conversation ----------------------------------------------------------------------------

@dataclass
class Conversation:
    prev: list[int]            # the previous turn's prompt
    answer: str                # what the model answered to it (greedy, PREV_ANSWER_TOKENS at most)
    next: list[int]            # prev + answer + a new user message: the turn being timed
    unrelated: list[int]       # a short prompt with nothing in common, that takes the slot over


def build_conversation(engine, history_tokens: int, next_words: int, seed: int) -> tuple[Conversation, object]:
    """The conversation, and the seed store holding the previous turn's blocks. Runs the previous turn
    once (a full prefill: also the kernels' warm-up)."""
    from ..kv.store import TieredStore
    rng = random.Random(seed)
    msgs = long_chat(engine, history_tokens, rng)
    prev = list(engine.apply_chat_template(msgs))
    seed_store = TieredStore(engine.store.ident, BIG)
    engine.store, engine.prefix_reuse = seed_store, True
    engine.slots[0].reset()
    answer = engine.generate(prev, max_tokens=PREV_ANSWER_TOKENS, temperature=0.0).text
    seed_store.save(engine.slots[0])
    msgs += [{"role": "assistant", "content": answer},
             {"role": "user", "content": synthetic_text(rng, next_words)}]
    nxt = list(engine.apply_chat_template(msgs))
    unrelated = engine.tokenizer.encode("Unrelated request: " + synthetic_text(random.Random(seed + 1), 12))
    return Conversation(prev, answer, nxt, unrelated), seed_store


# ---- one case ------------------------------------------------------------------------------------

def _previous_turn(engine, conv: Conversation, seed_store) -> None:
    """The slot as the previous turn left it: prev's KV (from the seed store: a cheap tail prefill,
    bit-identical KV) + the answer's decoded tokens."""
    engine.store, engine.prefix_reuse = seed_store, True
    engine.slots[0].reset()
    c = engine.generate(conv.prev, max_tokens=PREV_ANSWER_TOKENS, temperature=0.0)
    if c.text != conv.answer:
        raise RuntimeError("the previous turn did not reproduce its answer")


def run_case(engine, case: str, conv: Conversation, seed_store, disk_store) -> tuple[dict, torch.Tensor]:
    """Set the case up (untimed), then time the next turn. `disk_store`: this round's disk-only store
    (RAM budget 0), shared by disk-cold and disk-warm. Returns one sample and the first token's logits."""
    from ..kv.store import TieredStore
    ident = seed_store.ident
    cache, evict = {}, None
    if case == "none":
        engine.store, engine.prefix_reuse = None, False
        engine.slots[0].reset()
    else:
        _previous_turn(engine, conv, seed_store)
        # slot, ram: a fresh RAM-only store; disk: RAM budget 0 sends evicted blocks on to the disk
        engine.store = TieredStore(ident, BIG) if case in ("slot", "ram") else disk_store
        if case != "slot":
            # takes the slot over: the slot's blocks are copied down a tier on this request's path;
            # disk writes go on the store's spill thread, waited for here (untimed) so that the next
            # turn finds them on disk and not still pending in memory
            disk = engine.store.disk
            w0 = (disk.stats.bytes_written, disk.stats.write_s) if disk is not None else None
            u = engine.generate(conv.unrelated, max_tokens=1)
            if engine.slots[0].record.fed[:len(conv.unrelated)] != conv.unrelated:
                raise RuntimeError("the unrelated prompt did not take the slot")
            t = time.perf_counter()
            if not engine.store.flush(timeout=600):
                raise RuntimeError("the disk tier's writes did not finish in 10 minutes")
            evict = {"ttft_s": u.timings.ttft_s, "prefill_s": u.timings.prefill_s,
                     "flush_wait_s": time.perf_counter() - t}
            if w0 is not None:
                evict["disk_bytes_written"] = disk.stats.bytes_written - w0[0]
                evict["disk_write_s"] = disk.stats.write_s - w0[1]
        if case.startswith("disk"):
            files = block_files(disk_store.disk.root)
            cache = drop_page_cache(files) if case == "disk-cold" else {"method": None}
            cache["resident_before"] = resident_fraction(files)
    store = engine.store
    disk = store.disk if store is not None else None
    d0 = (disk.stats.bytes_read, disk.stats.load_s) if disk is not None else (0, 0.0)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    c = engine.generate(conv.next, max_tokens=1, temperature=0.0, keep_logits=True)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    engine.prefix_reuse = True
    r = c.restored
    sample = {"ttft_s": c.timings.ttft_s, "prefill_tokens": c.timings.prefill_tokens,
              "prefill_s": c.timings.prefill_s, "restore_s": c.timings.ttft_s - c.timings.prefill_s,
              "cached_tokens": c.cached_tokens, "prompt_tokens": c.prompt_tokens,
              "restored": {"slot": r.slot, "ram": r.ram, "disk": r.disk, "load_s": r.load_s, "tier": r.tier},
              "first_token": c.logits[0].argmax().item(), "page_cache": cache or None, "evicting_request": evict,
              # page faults and CPU seconds of this process during the timed request (allocator effects)
              "minor_faults": ru1.ru_minflt - ru0.ru_minflt, "major_faults": ru1.ru_majflt - ru0.ru_majflt,
              "user_s": ru1.ru_utime - ru0.ru_utime, "sys_s": ru1.ru_stime - ru0.ru_stime}
    if disk is not None:
        sample["disk_bytes_read"] = disk.stats.bytes_read - d0[0]
        sample["disk_load_s"] = disk.stats.load_s - d0[1]
    return sample, c.logits


def bandwidth_round(seq_path: Path, disk_root: Path, buf: bytearray) -> dict:
    """Sequential read of the big file cold and warm, and the block files read raw, cold."""
    out = {}
    drop_page_cache([seq_path])
    n, s = read_files([seq_path], buf)
    out["seq_cold_Bps"] = n / s
    n, s = read_files([seq_path], buf)
    out["seq_warm_Bps"] = n / s
    files = block_files(disk_root)
    drop_page_cache(files)
    n, s = read_files(files, buf)
    out["blockfiles_raw_cold_Bps"], out["blockfiles_bytes"], out["blockfiles"] = n / s, n, len(files)
    drop_page_cache([seq_path])            # leave nothing of ours in the page cache
    return out


# ---- the run -------------------------------------------------------------------------------------

def run(args) -> int:
    from ..engine.core import Engine
    from ..kv.store import CacheConfig, TieredStore
    from ..server.cli import default_kv_dir
    torch.set_num_threads(args.threads)
    if args.repeats < 1 or args.history_tokens < 512:
        raise ValueError("--repeats must be >= 1 and --history-tokens >= 512")
    ctx = args.ctx or 8192
    t0 = time.perf_counter()
    engine = Engine.load(args.model, dtype=args.dtype, prefix_reuse=True, min_reuse=args.min_reuse, ctx=ctx,
                         chunk_size=args.chunk, slots=1, cache=CacheConfig(ram_bytes=BIG, disk_dir=None, disk_bytes=0))
    load_s = time.perf_counter() - t0
    args.dtype = engine.dtype_choice.dtype   # "auto" resolved: the result names what ran
    base = Path(args.cache_dir or Path(default_kv_dir()).parent).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=base))
    disk_root, seq_path = work / "kv", work / "seq.bin"
    print(f"model {args.model} {args.dtype}, {args.threads} threads, ctx {ctx}; disk tier and read test in {work}",
          flush=True)
    try:
        conv, seed_store = build_conversation(engine, args.history_tokens, args.next_words, args.seed)
        print(f"previous turn {len(conv.prev)} tokens, next turn {len(conv.next)} tokens; "
              f"writing a {args.seq_mib} MiB file for the sequential read test", flush=True)
        write_seq_file(seq_path, args.seq_mib << 20)
        buf = bytearray(READ_CHUNK)
        samples: dict[str, list[dict]] = {c: [] for c in CASES}
        bw_rounds: list[dict] = []
        first_none = None
        mismatches, wrong_tier = [], []
        for rnd in range(args.warmup + args.repeats):
            warm = rnd < args.warmup
            line, got = [], {}
            rdir = disk_root / f"round{rnd}"      # a fresh disk tier each round: disk-cold writes its blocks
            disk_store = TieredStore(seed_store.ident, 0, rdir, BIG)
            for case in CASES:
                s, logits = run_case(engine, case, conv, seed_store, disk_store)
                got[case] = (s, logits)
                r = s["restored"]
                others = [t for t in ("slot", "ram", "disk") if t != EXPECT_TIER[case] and r[t]]
                if r["tier"] != EXPECT_TIER[case] or others:
                    wrong_tier.append(f"round {rnd} {case}: restored slot {r['slot']}, ram {r['ram']}, "
                                      f"disk {r['disk']} tokens")
                line.append(f"{case} {s['ttft_s'] * 1e3:.0f} ms ({s['cached_tokens']} cached, {s['restored']['tier']})")
            ref = got["none"][1]                       # the cold full prefill is the reference
            first_none = ref if first_none is None else first_none
            for case, (s, logits) in got.items():
                other = first_none if case == "none" else ref
                s["same_first_token"] = int(logits[0].argmax()) == int(other[0].argmax())
                s["identical"] = bool(torch.equal(logits, other))
                s["max_abs_logit_diff"] = (logits - other).abs().max().item()
                if not s["identical"]:
                    mismatches.append(f"round {rnd} {case}: first token {s['first_token']} vs {int(other[0].argmax())}"
                                      f" (none{', round 0' if case == 'none' else ''}), "
                                      f"max |dlogit| {s['max_abs_logit_diff']:.3g}")
                if not warm:
                    samples[case].append(s)
            bw = bandwidth_round(seq_path, rdir, buf)
            shutil.rmtree(rdir, ignore_errors=True)
            if not warm:
                bw_rounds.append(bw)
            print(f"  round {rnd}{' (warm-up)' if warm else ''}: " + "  ".join(line)
                  + f"  | seq read cold {bw['seq_cold_Bps'] / 1e9:.2f} GB/s", flush=True)
        sha = sha256_rate(max(1, samples["disk-cold"][0].get("disk_bytes_read", 1 << 20)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = summarize(args, engine, conv, samples, bw_rounds, sha, load_s, ctx)
    result["identical"] = not mismatches
    result["same_first_token"] = all(r["same_first_token"] for rows in samples.values() for r in rows)
    result["mismatches"] = mismatches
    result["tiers_ok"] = not wrong_tier
    result["wrong_tier"] = wrong_tier
    path = write_json(Path(args.out), f"tiers-{Path(str(args.model)).name}.json", result)
    report(result, path)
    return 0 if not mismatches and not wrong_tier else 1


def summarize(args, engine, conv: Conversation, samples: dict, bw_rounds: list[dict], sha: float,
              load_s: float, ctx: int) -> dict:
    n = len(conv.next)
    cases = {}
    for case, rows in samples.items():
        med = median([r["ttft_s"] for r in rows])
        ev = [r["evicting_request"] for r in rows if r["evicting_request"]]
        cases[case] = {
            "ttft_s_median": med, "ttft_s": [r["ttft_s"] for r in rows],
            "restore_s_median": median([r["restore_s"] for r in rows]),
            "prefill_s_median": median([r["prefill_s"] for r in rows]),
            "load_s_median": median([r["restored"]["load_s"] for r in rows]),
            "cached_tokens": rows[0]["cached_tokens"], "prefill_tokens": rows[0]["prefill_tokens"],
            "reuse_fraction": rows[0]["cached_tokens"] / n,
            "tokens_by_tier": {t: rows[0]["restored"][t] for t in ("slot", "ram", "disk")},
            "tier": rows[0]["restored"]["tier"],
            "minor_faults_median": median([r["minor_faults"] for r in rows]),
            "evicting_request_ttft_s_median": median([e["ttft_s"] for e in ev]) if ev else None,
            "evicting_request_disk_write_s_median": (median([e["disk_write_s"] for e in ev])
                                                     if ev and "disk_write_s" in ev[0] else None),
            "sys_s_median": median([r["sys_s"] for r in rows]),
            "identical_logits": all(r["identical"] for r in rows),
            "same_first_token": all(r["same_first_token"] for r in rows),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        }
        if "disk_bytes_read" in rows[0] and rows[0]["disk_bytes_read"]:
            cases[case]["disk_bytes_read"] = rows[0]["disk_bytes_read"]
            cases[case]["disk_load_s_median"] = median([r["disk_load_s"] for r in rows])
            cases[case]["disk_load_Bps_median"] = median([r["disk_bytes_read"] / r["disk_load_s"] for r in rows])
            cases[case]["page_cache"] = [r["page_cache"] for r in rows]
    none = cases["none"]["ttft_s_median"]
    for c in cases.values():
        c["speedup_vs_none"] = none / c["ttft_s_median"]
    bw = {k: median([r[k] for r in bw_rounds]) for k in bw_rounds[0]}
    bw["sha256_Bps"] = sha
    if "disk_load_Bps_median" in cases["disk-cold"]:
        bw["disk_tier_cold_Bps"] = cases["disk-cold"]["disk_load_Bps_median"]
        bw["disk_tier_warm_Bps"] = cases["disk-warm"]["disk_load_Bps_median"]
        bw["disk_tier_cold_over_seq_cold"] = bw["disk_tier_cold_Bps"] / bw["seq_cold_Bps"]
        bw["disk_tier_warm_over_seq_warm"] = bw["disk_tier_warm_Bps"] / bw["seq_warm_Bps"]
        bw["blockfiles_raw_cold_over_seq_cold"] = bw["blockfiles_raw_cold_Bps"] / bw["seq_cold_Bps"]
    cfg = engine.config
    return {"command": command_line(), "model": args.model, "dtype": args.dtype, "threads": args.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}, "ctx": ctx, "repeats": args.repeats,
            "warmup_rounds": args.warmup, "engine_load_s": load_s,
            "previous_turn_tokens": len(conv.prev), "next_turn_tokens": n,
            "kv_dtype": engine.kv_dtype, "kv_bytes_per_token": engine.kv_stats()["bytes_per_token"],
            "seq_file_bytes": args.seq_mib << 20, "cases": cases, "bandwidth": bw,
            "samples": samples, "bandwidth_rounds": bw_rounds}


def report(res: dict, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title=f"next turn of a {res['previous_turn_tokens']}-token conversation · {res['model']} "
                    f"{res['dtype']} · {res['threads']} threads · median of {res['repeats']}")
    for col in ("prefix from", "TTFT", "× vs none", "reused", "slot / ram / disk tokens", "prefilled",
                "restore (TTFT - prefill)", "tier load_s", "page faults", "sys s", "logits = none"):
        t.add_column(col, justify="left" if col == "prefix from" else "right")
    for case, c in res["cases"].items():
        tk = c["tokens_by_tier"]
        same = ("yes" if c["identical_logits"] else
                f"NO (max |d| {c['max_abs_logit_diff']:.3g}, first token {'same' if c['same_first_token'] else 'DIFFERS'})")
        t.add_row(case, f"{c['ttft_s_median'] * 1e3:.1f} ms", f"×{c['speedup_vs_none']:.1f}",
                  f"{c['cached_tokens']} ({100 * c['reuse_fraction']:.1f}%)",
                  f"{tk['slot']} / {tk['ram']} / {tk['disk']}", str(c["prefill_tokens"]),
                  f"{c['restore_s_median'] * 1e3:.1f} ms", f"{c['load_s_median'] * 1e3:.1f} ms",
                  f"{c['minor_faults_median']:,}", f"{c['sys_s_median']:.2f}", same)
    con.print(t)
    ev = [(case, c) for case, c in res["cases"].items() if case in ("ram", "disk-cold")]
    con.print("the unrelated request that evicted the slot (its blocks go down a tier on its path), TTFT: "
              + "; ".join(f"{case} {c['evicting_request_ttft_s_median'] * 1e3:.0f} ms"
                          + ("" if c["evicting_request_disk_write_s_median"] is None else
                             f" (+ its disk writes, on the spill thread: "
                             f"{c['evicting_request_disk_write_s_median'] * 1e3:.0f} ms)")
                          for case, c in ev))
    bw = res["bandwidth"]
    b = Table(title="disk tier load bandwidth vs the disk (GB/s, medians)")
    for col in ("what", "GB/s", "÷ sequential (same cache state)"):
        b.add_column(col, justify="left" if col == "what" else "right")
    g = lambda x: f"{x / 1e9:.2f}"   # noqa: E731
    b.add_row(f"sequential read, {res['seq_file_bytes'] >> 20} MiB file, page cache dropped", g(bw["seq_cold_Bps"]), "1")
    b.add_row("sequential read, page cache warm", g(bw["seq_warm_Bps"]), "1")
    if "disk_tier_cold_Bps" in bw:
        b.add_row(f"disk tier load (read + verify), cold: {res['cases']['disk-cold']['disk_bytes_read'] / 1e6:.0f} MB",
                  g(bw["disk_tier_cold_Bps"]), f"{bw['disk_tier_cold_over_seq_cold']:.2f}")
        b.add_row("disk tier load (read + verify), warm", g(bw["disk_tier_warm_Bps"]),
                  f"{bw['disk_tier_warm_over_seq_warm']:.2f}")
        b.add_row(f"the {bw['blockfiles']} block files read raw, cold", g(bw["blockfiles_raw_cold_Bps"]),
                  f"{bw['blockfiles_raw_cold_over_seq_cold']:.2f}")
    b.add_row("sha256 in memory (verification)", g(bw["sha256_Bps"]), "")
    con.print(b)
    if res["identical"]:
        con.print(f"first token and logits bit-identical to the cold prefill in all {len(res['cases'])} cases, "
                  "all rounds")
    else:
        con.print(f"[bold red]MISMATCH[/] (logits not bit-identical to the cold prefill; first token "
                  f"{'the same everywhere' if res['same_first_token'] else 'DIFFERS'}): " + "; ".join(res["mismatches"]))
    if not res["tiers_ok"]:
        con.print("[bold red]WRONG TIER[/]: " + "; ".join(res["wrong_tier"]))
    con.print(f"wrote {path}")
