"""Pieces every benchmark shares: statistics, a synthetic conversation, the model under test (a registry
name or any local path), the resident set around a load, output."""
from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not which "
         "river mountain engine garden theory market window history language music science city "
         "travel letter report system network memory signal ocean forest planet kitchen bridge "
         "quickly carefully often never always rarely simply clearly").split()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def synthetic_text(rng: random.Random, words: int) -> str:
    """Plain English-looking filler: deterministic for a seed, tokenizes to ~1.2 tokens per word."""
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
    return " ".join(out) + "."


def synthetic_conversation(rng: random.Random, turns: int, system_words: int, user_words: int,
                           assistant_words: int) -> list[dict]:
    """system + `turns` (user, assistant) pairs; a chat client would resend all of it next turn."""
    msgs = [{"role": "system", "content": synthetic_text(rng, system_words)}]
    for _ in range(turns):
        msgs.append({"role": "user", "content": synthetic_text(rng, user_words)})
        msgs.append({"role": "assistant", "content": synthetic_text(rng, assistant_words)})
    return msgs


def long_chat(engine, history_tokens: int, rng: random.Random) -> list[dict]:
    """A synthetic chat whose rendered prompt is at least `history_tokens` long, ending with a user
    message that asks for a summary (the turn the benchmarks then answer and continue)."""
    msgs = synthetic_conversation(rng, turns=1, system_words=60, user_words=60, assistant_words=80)
    while len(engine.apply_chat_template(msgs)) < history_tokens:
        msgs += synthetic_conversation(rng, 1, 0, 60, 80)[1:]
    msgs.append({"role": "user", "content": "Summarise our conversation in one sentence."})
    return msgs


@dataclass(frozen=True)
class BenchModel:
    """The -m argument resolved once: the file ternlm loads and the peers load too (the same bytes)."""
    label: str           # names results and result files: the registry name, or a path's file stem
                         # ("/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" -> "qwen2.5-coder-1.5b-instruct-q4_k_m")
    path: Path           # the .gguf file, or a Hugging Face folder
    kind: str            # "gguf" | "hf"
    file_bytes: int      # on disk: the GGUF, or the folder's weight files

    @property
    def gguf(self) -> Path | None:
        """The GGUF file llama.cpp can load, or None (a Hugging Face folder)."""
        return self.path if self.kind == "gguf" else None


def bench_model(model: str) -> BenchModel:
    """Resolve -m as the engine does (registry name, .gguf path, HF folder). Side effect: fetches a
    registry model not yet cached. Raises UnknownModelError for anything else."""
    from ..models.registry import REGISTRY, resolve
    r = resolve(model)
    if r.kind == "gguf":
        return BenchModel(model if model in REGISTRY else r.path.stem, r.path, "gguf", r.path.stat().st_size)
    weights = [f for f in r.path.iterdir() if f.suffix in (".safetensors", ".bin")]
    return BenchModel(r.path.name, r.path, "hf", sum(f.stat().st_size for f in weights))


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The Vm*/Rss* lines of /proc/PID/status in KiB ({} where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                    if k.startswith(("Vm", "Rss")) and v.strip().endswith("kB")}
    except OSError:
        return {}


@dataclass(frozen=True)
class LoadMemory:
    """This process's resident set around one model load, MiB (/proc/self/status)."""
    baseline_mib: float      # VmRSS just before: Python, torch and ternlm imported, no model (of this load)
    peak_mib: float          # the highest VmRSS while loading (absolute; above baseline: peak - baseline)
    steady_mib: float        # VmRSS after it, the loader's temporaries freed and garbage collected
    steady_file_mib: float   # of which file-backed pages (RssFile: mapped files, the GGUF if still mapped)
    load_s: float
    peak_method: str         # "VmHWM reset before the load" | "sampled every 5 ms" (VmHWM is the whole
                             # process's lifetime peak, so it is reset first, or sampled where that is refused)

    @property
    def peak_above_mib(self) -> float:
        return self.peak_mib - self.baseline_mib

    @property
    def steady_above_mib(self) -> float:
        return self.steady_mib - self.baseline_mib

    def as_dict(self) -> dict:
        return asdict(self) | {"peak_above_baseline_mib": self.peak_above_mib,
                               "steady_above_baseline_mib": self.steady_above_mib}


class _RssSampler:
    """The highest VmRSS seen by a thread reading it every `period` s: the fallback peak where the
    kernel refuses a VmHWM reset (misses spikes shorter than a period)."""

    def __init__(self, period: float = 0.005):
        self.peak_kib, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period,), daemon=True)
        self._thread.start()

    def _loop(self, period: float) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, proc_status().get("VmRSS", 0))
            time.sleep(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kib, proc_status().get("VmRSS", 0))


def _reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: "5" to clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_load(load: Callable[[], T]) -> tuple[T, LoadMemory]:
    """Run load() and measure this process's resident set around it (LoadMemory). Side effects:
    gc.collect() before and after; resets the process's VmHWM (so a later reader of VmHWM sees the
    peak since this load began, not the process's lifetime peak); runs a sampling thread during the
    load where the reset is refused."""
    gc.collect()
    base = proc_status().get("VmRSS", 0)
    reset = _reset_hwm()
    sampler = None if reset else _RssSampler()
    t0 = time.perf_counter()
    out = load()
    load_s = time.perf_counter() - t0
    peak = proc_status().get("VmHWM", 0) if reset else sampler.stop()
    gc.collect()
    after = proc_status()
    mib = 1 / 1024
    return out, LoadMemory(base * mib, max(peak, after.get("VmRSS", 0)) * mib, after.get("VmRSS", 0) * mib,
                           after.get("RssFile", 0) * mib, load_s,
                           "VmHWM reset before the load" if reset else "sampled every 5 ms")


def kv_budget_bytes(engine) -> int:
    """Every slot's KV at the engine's full context (slots grow on demand: this is the allowance)."""
    s = engine.slots[0].shape
    return 2 * s.layers * s.kv_heads * s.row * s.max_capacity * s.dtype.itemsize * len(engine.slots)


def write_json(out_dir: Path, name: str, data: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2))
    return path


def command_line() -> str:
    return "ternlm " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name == "ternlm" else " ".join(sys.argv)
