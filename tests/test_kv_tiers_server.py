"""The KV tiers through real `ternlm serve` processes and the official openai client: restart,
eviction to RAM and back, a shared system prompt, kill -9 mid-write, damaged and foreign files, a
full budget. The oracle for every answer is a server with prefix reuse off (no slots reused, no
tiers): greedy outputs must be identical, whatever the cache did.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from openai import OpenAI

from conftest import TEST_DATA
from server_proc import ServerProc
from ternlm.kv.blockfile import encode, decode, read_header

MODEL = "smollm2-135m"
COMMON = ("-m", MODEL, "--dtype", "float32", "--threads", "1")
MAX = 12
B = 256


def system_prompt(i: int) -> str:
    """A ~650-token system prompt (two full blocks and a bit), different for each i from its start."""
    qs = [json.loads(line) for line in (TEST_DATA / "mt_bench_question.jsonl").read_text().splitlines()]
    rules = "\n".join(f"- Example task {j}: {q['turns'][0]}" for j, q in enumerate(qs[i * 7:]))
    return f"You are assistant number {i}. Follow these house rules and examples carefully.\n{rules[:2600]}"


QUESTIONS = ["What is a prime number?", "Name three rivers.", "Explain rainbows briefly.",
             "What does a compiler do?", "Give a synonym for happy.", "Why is the sky blue?"]


def ask(server: ServerProc, messages: list[dict]):
    c = OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX, temperature=0)
    return r.choices[0].message.content, r.usage, r.model_extra["timings"]


@pytest.fixture(scope="module")
def cold():
    """The oracle: prefix reuse off, so no slot and no tier is ever reused."""
    s = ServerProc(*COMMON, "--slots", "1", "--no-prefix-kv").start().wait_ready()
    yield s
    s.close()


def turn(server: ServerProc, cold: ServerProc, messages: list[dict], question: str):
    """Ask `question` in the conversation on both servers; the answers must be identical.
    Appends the exchange to `messages`. Returns (usage, timings) of `server`."""
    messages.append({"role": "user", "content": question})
    text, usage, timings = ask(server, messages)
    ref, ref_usage, _ = ask(cold, messages)
    assert text == ref, f"answer differs from the cache-less run (timings {timings})"
    assert ref_usage.prompt_tokens_details.cached_tokens == 0
    messages.append({"role": "assistant", "content": text})
    return usage, timings


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tkv"))


def test_restart_reuses_the_stored_prefix_and_answers_the_same(tmp_path, cold):
    kv = tmp_path / "kv"
    first = ServerProc(*COMMON, "--slots", "1", "--cache-dir", str(kv)).start().wait_ready()
    msgs = [{"role": "system", "content": system_prompt(0)}]
    try:
        for q in QUESTIONS[:3]:
            usage, _ = turn(first, cold, msgs, q)
    finally:
        # SIGTERM: live slots are written down; uvicorn then re-raises the signal (exit -15)
        assert first.stop() in (0, -signal.SIGTERM)
    log = first.log()
    first.close()
    assert "blocks on disk after shutdown" in log and "Traceback" not in log
    assert block_files(kv)
    second = ServerProc(*COMMON, "--slots", "1", "--cache-dir", str(kv)).start().wait_ready()
    try:
        usage4, timings = turn(second, cold, msgs, QUESTIONS[3])
    finally:
        second.close()
    stored = (usage.prompt_tokens // B) * B               # the full blocks of turn 3's prompt at least
    assert timings["cache_tier"] == "disk"
    assert usage4.prompt_tokens_details.cached_tokens >= stored >= 2 * B
    assert timings["cache_disk_n"] == usage4.prompt_tokens_details.cached_tokens


def test_one_slot_two_conversations_and_a_shared_system_prompt(cold):
    server = ServerProc(*COMMON, "--slots", "1").start().wait_ready()
    try:
        a = [{"role": "system", "content": system_prompt(1)}]
        b = [{"role": "system", "content": system_prompt(2)}]
        for i in range(3):                              # alternate: each turn evicts the other's slot
            for conv in (a, b):
                usage, t = turn(server, cold, conv, QUESTIONS[i])
                if i:
                    assert t["cache_tier"] == "ram", t
                    assert usage.prompt_tokens_details.cached_tokens >= 2 * B
        # a third conversation with a's system prompt: its blocks come from the RAM tier
        c = [{"role": "system", "content": system_prompt(1)}]
        usage, t = turn(server, cold, c, QUESTIONS[5])
        assert t["cache_tier"] == "ram" and usage.prompt_tokens_details.cached_tokens >= 2 * B
        metrics = httpx.get(server.base + "/metrics").text
        assert 'ternlm_kv_tier_hits_total{tier="ram"}' in metrics
        assert 'ternlm_reused_tokens_by_tier_total{tier="ram"} 0.0' not in metrics
    finally:
        server.close()


def _wait_for_write(root: Path, after_files: int, timeout: float) -> bool:
    """Poll until a block write is in progress (a tmp file exists) once `after_files` blocks are whole."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [n for _, _, ns in os.walk(root) for n in ns]
        if any(".tmp-" in n for n in names) and sum(n.endswith(".tkv") for n in names) >= after_files:
            return True
        time.sleep(0.0005)
    return False


def test_kill_9_mid_write_then_damaged_and_foreign_files(tmp_path, cold):
    kv = tmp_path / "kv"
    args = (*COMMON, "--slots", "1", "--cache-ram", "0", "--cache-dir", str(kv))   # every eviction writes
    convs = [[{"role": "system", "content": system_prompt(i)}] for i in (3, 4, 5)]

    # 1. kill -9 while a block file is being written
    server = ServerProc(*args).start().wait_ready()
    errors: list[BaseException] = []

    def drive():
        try:
            for i in range(2):
                for conv in convs:
                    turn(server, cold, conv, QUESTIONS[i])
        except Exception as e:   # the kill ends this thread's requests: expected
            errors.append(e)
    t = threading.Thread(target=drive, daemon=True)
    t.start()
    seen = _wait_for_write(kv, 2, 300)
    server.send_signal(signal.SIGKILL)
    server.proc.wait()
    t.join(300)
    server.close()
    assert seen, "never saw a block write in progress to interrupt"
    # what the kill left: whole block files (all verify) and maybe an orphaned tmp file
    verify = subprocess.run([sys.executable, "-m", "ternlm.cli.main", "cache", "verify", "--dry-run",
                             "--cache-dir", str(kv)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert " 0 damaged" in verify.stdout
    for conv in convs:           # drop a trailing user message the kill left unanswered
        if conv[-1]["role"] == "user":
            conv.pop()

    # 2. restart on what the kill left: same answers; a clean stop writes every conversation down
    server = ServerProc(*args).start().wait_ready()
    try:
        assert not any(".tmp-" in p.name for p in kv.rglob("*")), "orphaned tmp files were not cleaned"
        for conv in convs:
            turn(server, cold, conv, QUESTIONS[2])
    finally:
        server.close()

    # 3. damage the first block of each conversation: truncated, flipped byte, foreign model
    firsts = {}
    for f in block_files(kv):
        header, _ = read_header(f.read_bytes())
        if set(header["parent"]) == {"0"}:
            firsts[tuple(header["ids"][:64])] = f
    assert len(firsts) == 3, "expected one block-0 file per conversation (distinct system prompts)"
    damaged = sorted(firsts.values())
    data = damaged[0].read_bytes()
    damaged[0].write_bytes(data[:len(data) - 1000])
    data = bytearray(damaged[1].read_bytes())
    data[len(data) // 2] ^= 0x10
    damaged[1].write_bytes(bytes(data))
    block = decode(bytearray(damaged[2].read_bytes()))
    foreign = dataclasses.replace(block.meta, model_sha256="f" * 64)   # header hashes to its key still
    header, payload = encode(foreign, block.k, block.v)
    damaged[2].write_bytes(header + b"".join(bytes(p) for p in payload))
    server = ServerProc(*args).start().wait_ready()
    try:
        for conv in convs:
            usage, t = turn(server, cold, conv, QUESTIONS[4])     # identical: damaged files never used
            assert usage.prompt_tokens_details.cached_tokens == 0
        metrics = httpx.get(server.base + "/metrics").text
        assert 'ternlm_kv_tier_damaged_total{tier="disk"} 3.0' in metrics, metrics
        server.stop()
        log = server.log()
    finally:
        server.close()
    assert "truncated" in log and "checksum" in log and "foreign model" in log
    for p in damaged:            # dropped, recomputed, and written again whole at the clean stop
        assert decode(bytearray(p.read_bytes())).meta.model_sha256 != "f" * 64


def test_disk_budget_holds_under_churn(tmp_path, cold):
    kv = tmp_path / "kv"
    budget = 40 * 2**20                                  # about three smollm2 blocks
    server = ServerProc(*COMMON, "--slots", "1", "--cache-ram", "0", "--cache-disk", str(budget),
                        "--cache-dir", str(kv)).start().wait_ready()
    convs = [[{"role": "system", "content": system_prompt(i)}] for i in (6, 7, 8, 9)]
    try:
        for i in range(2):
            for conv in convs:
                turn(server, cold, conv, QUESTIONS[i])
                used = sum(f.stat().st_size for f in kv.rglob("*") if f.is_file())
                assert used <= budget + 4096, f"{used} bytes on disk over a budget of {budget}"
        metrics = httpx.get(server.base + "/metrics").text
        assert 'ternlm_kv_tier_evictions_total{tier="disk"} 0.0' not in metrics
    finally:
        server.close()


def test_two_servers_share_one_directory(tmp_path, cold):
    """Both write blocks into one directory at the same time; every file stays whole, and each
    server then continues the other's conversation from the other's blocks."""
    kv = tmp_path / "kv"
    args = (*COMMON, "--slots", "1", "--cache-ram", "0", "--cache-dir", str(kv))
    a, b = ServerProc(*args).start(), ServerProc(*args).start()
    try:
        a.wait_ready()
        b.wait_ready()
        convs = {name: [[{"role": "system", "content": system_prompt(i)}] for i in ids]
                 for name, ids in (("a", (0, 1)), ("b", (2, 3)))}
        errors: list[BaseException] = []

        def drive(server, mine):
            try:
                for q in QUESTIONS[:2]:
                    for conv in mine:          # alternating: every turn evicts the other conversation
                        turn(server, cold, conv, q)
            except BaseException as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=drive, args=(a, convs["a"])),
                   threading.Thread(target=drive, args=(b, convs["b"]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        # swap: b continues a's conversations and a continues b's, from the shared directory
        for server, mine in ((b, convs["a"]), (a, convs["b"])):
            for conv in mine:
                usage, t = turn(server, cold, conv, QUESTIONS[2])
                assert t["cache_tier"] == "disk" and usage.prompt_tokens_details.cached_tokens >= 2 * B
    finally:
        a.close()
        b.close()
    verify = subprocess.run([sys.executable, "-m", "ternlm.cli.main", "cache", "verify", "--dry-run",
                             "--cache-dir", str(kv)], capture_output=True, text=True)
    assert verify.returncode == 0 and " 0 damaged" in verify.stdout, verify.stdout


def _small_files():
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))   # writes past 1 MiB fail (EFBIG)


def test_a_full_disk_turns_the_disk_tier_off_and_nothing_else(tmp_path, cold):
    """The server process may not write files over 1 MiB (RLIMIT_FSIZE: Python ignores SIGXFSZ, so
    the write fails with EFBIG, as a full disk fails with ENOSPC). Block writes fail; the server warns
    once, keeps answering (identically), and keeps reusing from its slot and RAM."""
    kv = tmp_path / "kv"
    server = ServerProc(*COMMON, "--slots", "1", "--cache-ram", "0", "--cache-dir", str(kv),
                        preexec_fn=_small_files).start().wait_ready()
    try:
        convs = [[{"role": "system", "content": system_prompt(i)}] for i in (6, 7)]
        for q in QUESTIONS[:2]:
            for conv in convs:
                turn(server, cold, conv, q)
        usage, t = turn(server, cold, convs[1], QUESTIONS[3])          # same conversation: its slot
        assert t["cache_tier"] == "slot" and usage.prompt_tokens_details.cached_tokens > 2 * B
        metrics = httpx.get(server.base + "/metrics").text
        assert 'ternlm_kv_tier_writes_disabled{tier="disk"} 1.0' in metrics
        server.stop()
        log = server.log()
    finally:
        server.close()
    assert log.count("continuing without writing to the disk tier") == 1 and "Traceback" not in log
    assert not list(kv.rglob("*.tkv")) and not list(kv.rglob("*.tmp-*"))
