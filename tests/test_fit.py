"""fit.py: the memory estimate against hand-computed numbers, the one-line refusal and its suggestions
(which must themselves fit), available memory from /proc and cgroup v1/v2 files (faked under
tmp_path), the budget read from real headers against what a loaded engine allocates, and the CLI:
`ternlm serve` and `ternlm generate` with impossible configurations exit 2 with one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ternlm.engine import fit
from ternlm.engine.fit import (OVERHEAD, Available, Budget, DoesNotFit, available_memory, budget_for, check,
                        kv_bytes_per_token, longest_ctx, require_fit, slot_tokens)

GiB, MiB = 1 << 30, 1 << 20
MEM = Available(2 * GiB, "MemAvailable")
# qwen2.5-coder-1.5b: 28 layers x 2 kv heads x 128 dims x (K, V) x fp16
QWEN15_KV = 28 * 2 * 128 * 2 * 2


# ---- the estimate, by hand --------------------------------------------------------------------

def test_kv_bytes_per_token_by_hand():
    assert kv_bytes_per_token(28, 2, 128, "float16") == QWEN15_KV == 28_672
    assert kv_bytes_per_token(30, 3, 64, "float32") == 46_080        # smollm2, fp32 cache
    # q8_0: 128 one-byte codes + 4 fp16 scales a row = 136 bytes (fp16: 256), 0.53x; smollm2's 64 + 2 x 2 = 68
    assert kv_bytes_per_token(28, 2, 128, "q8_0") == 28 * 2 * 2 * 136 == 15_232 <= 0.54 * QWEN15_KV
    assert kv_bytes_per_token(30, 3, 64, "q8_0") == 30 * 3 * 2 * 68 == 12_240 <= 0.54 * 23_040
    assert slot_tokens(1000) == 1024 and slot_tokens(8192) == 8192    # slots allocate whole 256-token blocks


def test_budget_parts_by_hand():
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=4, ram_tier=2 * GiB)
    assert b.kv == 28_672 * 32_768 * 4 == 3584 * MiB
    assert b.overhead == OVERHEAD + GiB // 8 == 384 * MiB
    assert b.total == GiB + 3584 * MiB + 2 * GiB + 384 * MiB


def test_a_draft_model_adds_its_weights_and_kv_by_hand():
    """qwen2.5-coder-0.5b drafting for the 1.5b: 24 layers x 2 kv heads x 64 dims x (K, V) x fp16 per token of each
    (paired) slot, counted at the target's context; one fixed overhead, model / 8 over both models."""
    draft_kv = 24 * 2 * 64 * 2 * 2
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=4, draft_model=512 * MiB,
               draft_kv_per_token=draft_kv)
    assert b.kv == (28_672 + 12_288) * 32_768 * 4 == 5 * GiB
    assert b.overhead == OVERHEAD + 1536 * MiB // 8 == 448 * MiB
    assert b.total == 1536 * MiB + 5 * GiB + 448 * MiB
    f = check(b, Available(4 * GiB, "MemAvailable"), slots_flag=True)
    # KV room: 4 GiB - 1.5 GiB - 448 MiB = 2,112 MiB; / (40,960 x 4) = 13,516 tokens -> 13,312; 1,280 MiB a slot
    assert f.line == ("needs ~6.9 GiB (model 1.0 GiB + draft model 512.0 MiB + KV 5.0 GiB for 4 slots x 32768 tokens "
                      "(both) + 448.0 MiB overhead), 4.0 GiB available (MemAvailable): try --ctx 13312 or --slots 1 "
                      "(--no-fit-check loads anyway)")
    alone = check(Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=1, draft_model=3 * GiB,
                         draft_kv_per_token=draft_kv), Available(4 * GiB, "x"), slots_flag=True)
    assert ": the models alone need ~4.8 GiB: try a smaller model"   # 4 GiB + 256 + 512 MiB in alone.line


def test_refusal_is_one_line_with_the_ctx_that_fits():
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=4)
    f = check(b, MEM, slots_flag=True)
    # KV room: 2 GiB - 1 GiB - 384 MiB = 640 MiB = 671,088,640 B; / (28,672 x 4) = 5,851 tokens -> 5,120;
    # one slot of 32,768 tokens is 896 MiB: no slot count fits
    assert (f.ok, f.needed, f.available) == (False, b.total, 2 * GiB)
    assert f.line == ("needs ~4.9 GiB (model 1.0 GiB + KV 3.5 GiB for 4 slots x 32768 tokens + 384.0 MiB overhead), "
                      "2.0 GiB available (MemAvailable): try --ctx 5120 (--no-fit-check loads anyway)")
    assert "\n" not in f.line


def test_suggests_fewer_slots_where_the_command_has_the_flag():
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=4)
    three = Available(3 * GiB, "cgroup limit")
    # KV room 1,664 MiB: / (28,672 x 4) = 15,214 tokens -> 14,336; / 896 MiB per slot = 1 slot
    assert check(b, three, slots_flag=True).line.endswith(
        "3.0 GiB available (cgroup limit): try --ctx 14336 or --slots 1 (--no-fit-check loads anyway)")
    assert check(b, three, slots_flag=False).line.endswith(": try --ctx 14336 (--no-fit-check loads anyway)")


def test_suggests_a_smaller_ram_tier_when_it_is_the_difference():
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=8192, slots=1, ram_tier=2 * GiB)
    f = check(b, Available(3 * GiB, "MemAvailable"), slots_flag=True)
    # KV 224 MiB; without the tier 1,024 + 224 + 384 = 1,632 MiB; 3,072 - 1,632 = 1,440 -> 1,280 MiB
    assert "+ RAM tier 2.0 GiB +" in f.line
    assert f.line.endswith(": try --cache-ram 1280MiB (--no-fit-check loads anyway)")


def test_a_model_too_large_alone_says_so():
    dense = Budget(model=4 * GiB, kv_per_token=46_080, ctx=8192, slots=1, dense=True)   # + 768 MiB overhead
    assert check(dense, MEM).line.endswith(
        ": the model alone needs ~4.8 GiB: try --weights gguf or a smaller model (--no-fit-check loads anyway)")
    gguf = Budget(model=4 * GiB, kv_per_token=46_080, ctx=8192, slots=1)
    assert check(gguf, MEM).line.endswith(": try a smaller model (--no-fit-check loads anyway)")


def test_fits_exactly_and_unknown_memory_is_not_refused():
    b = Budget(model=100 * MiB, kv_per_token=23_040, ctx=8192, slots=1)
    f = check(b, Available(b.total, "MemAvailable"))
    assert f.ok and f.line.startswith("needs ~") and "try" not in f.line
    assert not check(b, Available(b.total - 1, "MemAvailable")).ok
    unknown = check(b, Available(None, "no /proc/meminfo"))
    assert unknown.ok and unknown.available is None and "not checked" in unknown.line


@settings(max_examples=500, deadline=None)
@given(model=st.integers(1, 8 * GiB), kvpt=st.integers(1024, 1 << 20), ctx=st.integers(1, 512).map(lambda k: k * 256),
       slots=st.integers(1, 64), tier=st.sampled_from([0, 512 * MiB, 2 * GiB]), avail=st.integers(0, 64 * GiB),
       slots_flag=st.booleans(), draft=st.sampled_from([(0, 0), (100 * MiB, 4096), (2 * GiB, 1 << 18)]))
def test_every_suggestion_fits_and_is_smaller(model, kvpt, ctx, slots, tier, avail, slots_flag, draft):
    """Property: whatever it refuses, each option it names fits when applied (an option may set two or
    three flags: `--cache-ram 0 --ctx N`, `--slots 1 --ctx N`), and "the model alone" is said only when
    not one block of tokens fits (in one slot where --slots can change, else in each)."""
    b = Budget(model, kvpt, ctx, slots, tier, draft_model=draft[0], draft_kv_per_token=draft[1])
    f = check(b, Available(avail, "x"), slots_flag=slots_flag)
    assert f.ok == (b.total <= avail)
    if f.ok:
        return
    options = f.line.split(": try ", 1)[1].split(" (--no-fit-check")[0].split(" or ") if ": try --" in f.line else []
    for option in options:
        words = option.split(" ")
        new = dict(ctx=ctx, slots=slots, ram_tier=tier)
        for flag, value in zip(words[::2], words[1::2]):
            if flag == "--ctx":
                new["ctx"] = int(value)
                assert int(value) < ctx and int(value) % 256 == 0
            elif flag == "--slots":
                new["slots"] = int(value)
                assert slots_flag and 1 <= int(value) < slots
            else:
                assert flag == "--cache-ram" and (value == "0" or value.endswith("MiB"))
                new["ram_tier"] = int(value.removesuffix("MiB")) * MiB
                assert new["ram_tier"] < tier
        assert check(Budget(model, kvpt, **new, draft_model=draft[0], draft_kv_per_token=draft[1]),
                     Available(avail, "x")).ok, (option, f.line)
    if not options:
        assert "alone need" in f.line
        assert model + draft[0] + b.overhead + (kvpt + draft[1]) * 256 * (1 if slots_flag else slots) > avail


def test_tier_and_kv_together_when_neither_alone_fits():
    b = Budget(model=1 * GiB, kv_per_token=QWEN15_KV, ctx=32768, slots=4, ram_tier=2 * GiB)
    # without the tier: 2 GiB - 1 GiB - 384 MiB = 640 MiB for KV -> --ctx 5120 (as above); with it, nothing
    assert check(b, MEM, slots_flag=True).line.endswith(": try --cache-ram 0 --ctx 5120 (--no-fit-check loads anyway)")


# ---- available memory from /proc and the cgroup files ----------------------------------------------

def _proc(tmp_path: Path, avail_kib: int, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {avail_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


def test_memavailable_without_a_cgroup_limit(tmp_path):
    proc = _proc(tmp_path, 4 * 1024 * 1024, "0::/\n")
    cg = tmp_path / "cg"
    _write(cg, memory_max="max\n", memory_current="123\n")
    assert available_memory(proc, cg) == Available(4 * GiB, "MemAvailable")


def test_cgroup_v2_limit_up_the_tree_less_reclaimable_cache(tmp_path):
    proc = _proc(tmp_path, 8 * 1024 * 1024, "0::/box/job\n")
    cg = tmp_path / "cg"
    _write(cg / "box", memory_max=f"{3 * GiB}\n", memory_current=f"{2 * GiB}\n",
           memory_stat=f"anon 1\ninactive_file {512 * MiB}\n")
    _write(cg / "box" / "job", memory_max="max\n", memory_current=f"{GiB}\n", memory_stat="inactive_file 0\n")
    # the parent's limit binds: 3 GiB - (2 GiB - 512 MiB inactive file) = 1.5 GiB
    assert available_memory(proc, cg) == Available(1536 * MiB, "cgroup limit")


def test_cgroup_v2_namespaced_sees_its_limit_at_the_root(tmp_path):
    proc = _proc(tmp_path, 8 * 1024 * 1024, "0::/\n")
    cg = tmp_path / "cg"
    _write(cg, memory_max=f"{2 * GiB}\n", memory_current=f"{GiB}\n")
    assert available_memory(proc, cg) == Available(GiB, "cgroup limit")


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    proc = _proc(tmp_path, 8 * 1024 * 1024, "4:memory:/jobs/a\n1:cpu:/\n")
    cg = tmp_path / "cg"
    d = cg / "memory" / "jobs" / "a"
    _write(d, memory_limit_in_bytes="9223372036854771712\n", memory_usage_in_bytes=f"{GiB}\n",
           memory_stat=f"hierarchical_memory_limit {4 * GiB}\ntotal_inactive_file {GiB // 2}\n")
    assert available_memory(proc, cg) == Available(4 * GiB - GiB // 2, "cgroup limit")   # the ancestor's limit
    _write(d, memory_stat="hierarchical_memory_limit 9223372036854771712\n")
    assert available_memory(proc, cg) == Available(8 * GiB, "MemAvailable")             # no limit anywhere


def test_no_proc_means_unknown(tmp_path):
    got = available_memory(tmp_path / "nothing", tmp_path)
    assert got.bytes is None and "meminfo" in got.source


def test_this_host_reports_something():
    got = available_memory()
    assert got.bytes is None or got.bytes > 0


# ---- budgets read from real headers, against what the engine allocates -----------------------------

def _engine_kv(engine) -> tuple[int, int]:
    """(bytes per token, bytes at full context over all slots) of a loaded engine's slots."""
    s = engine.slots[0].shape
    per_token = 2 * s.layers * s.kv_heads * s.row * s.dtype.itemsize       # row: a K/V row's storage elements
    return per_token, per_token * s.round_up(s.max_capacity) * len(engine.slots)


def test_budget_of_smollm2_gguf_matches_the_engine(smollm2_q, smollm2_gguf):
    b = budget_for("smollm2-135m", weights="gguf")
    assert (b.model, b.ctx, b.slots, b.dense) == (smollm2_gguf.stat().st_size, 8192, 1, False)
    assert (b.kv_per_token, b.kv) == _engine_kv(smollm2_q) == (23_040, 23_040 * 8192)   # fp16: 30 x 3 x 64 x 2 x 2
    assert budget_for("smollm2-135m", weights="gguf", ctx=10**6).ctx == 8192, "capped at the model's context"
    assert budget_for("smollm2-135m", weights="gguf", ctx=1000, slots=3).kv == 23_040 * 1024 * 3


def test_budget_of_smollm2_q8_0_kv_matches_the_engine(smollm2_gguf):
    from ternlm import Engine
    engine = Engine.load("smollm2-135m", weights="gguf", kv_dtype="q8_0", ctx=1000)
    b = budget_for("smollm2-135m", weights="gguf", kv_dtype="q8_0", ctx=1000)
    assert (b.kv_per_token, b.kv, b.kv_dtype) == (*_engine_kv(engine), "q8_0") == (12_240, 12_240 * 1024, "q8_0")
    assert engine.kv_stats()["bytes_per_token"] == 12_240


def test_longest_ctx_fits_and_one_step_more_does_not():
    import dataclasses
    for kvpt in (QWEN15_KV, 15_232):
        b = Budget(model=5 * GiB, kv_per_token=kvpt, ctx=1024, slots=2)
        n = longest_ctx(b, 8 * GiB)
        assert n % 1024 == 0 and n > 0
        assert dataclasses.replace(b, ctx=n).total <= 8 * GiB < dataclasses.replace(b, ctx=n + 1024).total
    assert longest_ctx(Budget(model=9 * GiB, kv_per_token=QWEN15_KV, ctx=1024, slots=1), 8 * GiB) == 0


def test_budget_of_smollm2_dense_fp32_matches_the_engine(smollm2_f32):
    b = budget_for("smollm2-135m", dtype="float32")
    assert (b.kv_per_token, b.kv) == _engine_kv(smollm2_f32) == (46_080, 46_080 * 8192)
    # 134,515,008 parameters in the file + the tied embedding's 49,152 x 576 again (lm_head's copy), x 4 bytes
    assert b.model == (134_515_008 + 49_152 * 576) * 4 and b.dense


def test_budget_of_a_hugging_face_folder(tmp_path):
    """config.json + safetensors headers only: no tokenizer or weights are read."""
    import torch
    from safetensors.torch import save_file
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64),
               "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    b = budget_for(str(tmp_path), dtype="float32", ctx=4096, slots=2)
    assert b.model == (300 * 64 + 64 * 64 + 300 * 64) * 4                 # tied embedding counted twice
    assert (b.kv_per_token, b.ctx, b.slots) == (2 * 2 * 16 * 2 * 4, 1024, 2)   # fp32 KV; ctx capped at 1,024
    assert not b.dense, "no --weights gguf to suggest for a folder"


def test_require_fit_raises_one_line(monkeypatch, smollm2_gguf):
    monkeypatch.setattr(fit, "available_memory", lambda: Available(300 * MiB, "MemAvailable"))
    with pytest.raises(DoesNotFit) as err:
        require_fit("smollm2-135m", weights="gguf", slots=4, slots_flag=True)
    line = str(err.value)
    assert "\n" not in line and err.value.fit.line == line and not err.value.fit.ok
    assert line.startswith("needs ~") and "300.0 MiB available (MemAvailable): the model alone needs" in line
    monkeypatch.setattr(fit, "available_memory", lambda: Available(600 * MiB, "MemAvailable"))
    with pytest.raises(DoesNotFit, match=r"4 slots x 8192 tokens.*: try --ctx 2048 or --slots 1 \("):
        require_fit("smollm2-135m", weights="gguf", slots=4, slots_flag=True)
    assert require_fit("smollm2-135m", weights="gguf", ctx=2048, slots=4).ok


def test_require_fit_counts_the_draft_model(monkeypatch, smollm2_gguf):
    """smollm2 drafting for itself: its file and its KV twice; a memory that fits the model alone refuses the pair,
    naming a --ctx that fits both."""
    one = budget_for("smollm2-135m", weights="gguf", ctx=2048, slots=4)
    two = budget_for("smollm2-135m", weights="gguf", ctx=2048, slots=4, draft_model="smollm2-135m")
    assert (two.model, two.draft_model, two.draft_kv_per_token) == (one.model, one.model, one.kv_per_token)
    assert two.kv == 2 * one.kv and two.total == one.total + one.model + one.kv + one.model // 8
    between = (one.total + two.total) // 2
    monkeypatch.setattr(fit, "available_memory", lambda: Available(between, "MemAvailable"))
    assert require_fit("smollm2-135m", weights="gguf", ctx=2048, slots=4).ok
    with pytest.raises(DoesNotFit, match=r"draft model .* \(both\) .*: try --ctx \d+ or --slots \d \("):
        require_fit("smollm2-135m", weights="gguf", ctx=2048, slots=4, slots_flag=True, draft_model="smollm2-135m")


def test_what_the_check_cannot_read_is_left_to_the_load(tmp_path):
    """A bad path or file is the load's to report (as before the check existed): not checked, not refused."""
    missing = require_fit(str(tmp_path / "missing.gguf"))
    assert missing.ok and missing.available is None and "does not exist" in missing.line
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(60))
    assert require_fit(str(tmp_path / "junk.gguf")).line.startswith("not checked: ")


# ---- the CLI: one line, exit 2, no traceback, nothing loaded ---------------------------------------

def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("ternlm: error:")]


def test_serve_refuses_an_impossible_configuration(smollm2_gguf):
    """Real available memory: 100,000 slots x 8,192 tokens of KV (~17 TiB) fits nowhere."""
    out = subprocess.run([sys.executable, "-m", "ternlm.cli.main", "serve", "-m", "smollm2-135m", "--slots", "100000",
                          "--port", "0"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = _error_lines(out.stderr)
    assert "KV" in line and "100000 slots x 8192 tokens" in line and "available" in line
    assert "--slots " in line.split(": try ")[1], line
    assert "loaded smollm2" not in out.stderr and "Uvicorn running" not in out.stderr


_GENERATE = """
import sys
from ternlm.engine import fit
from ternlm.cli import main as cli
fit.available_memory = lambda: fit.Available(400 << 20, "cgroup limit")   # a 400 MiB container, say
sys.exit(cli.main(sys.argv[1:]))
"""


def test_generate_refuses_in_one_line_and_no_fit_check_loads_anyway(smollm2_gguf):
    """generate has one slot: with the available memory patched to 400 MiB, smollm2's full 8,192-token
    context does not fit (model 94 + KV 180 + overhead 268 MiB) but 1,024 tokens would."""
    args = [sys.executable, "-c", _GENERATE, "generate", "-m", "smollm2-135m", "--weights", "gguf",
            "--max-tokens", "2", "Hello"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = _error_lines(out.stderr)
    assert line == ("ternlm: error: needs ~541.5 MiB (model 93.8 MiB + KV 180.0 MiB for 1 slot x 8192 tokens + "
                    "267.7 MiB overhead), 400.0 MiB available (cgroup limit): try --ctx 1024 "
                    "(--no-fit-check loads anyway)")
    assert out.stdout == ""
    ok = subprocess.run(args[:3] + ["generate", "--ctx", "1024"] + args[4:], capture_output=True, text=True,
                        timeout=300, env=env)
    assert ok.returncode == 0 and not _error_lines(ok.stderr), ok.stderr[-2000:]
    anyway = subprocess.run(args + ["--no-fit-check"], capture_output=True, text=True, timeout=300, env=env)
    assert anyway.returncode == 0 and not _error_lines(anyway.stderr), anyway.stderr[-2000:]


def test_moe_experts_count_as_the_expert_cache_keeps_them(tmp_path):
    """A mixture-of-experts file larger than RAM must not be refused for experts that will stream:
    resident counts them all, a size counts that many bytes, auto (the engine keeps what fits) none."""
    from gguf import GGMLQuantizationType as QT

    from hf_to_gguf import write_gguf
    from test_moe import MODELS, hf_model
    from ternlm.engine.fit import budget_for
    from ternlm.models.gguf import FastGGUFReader

    path = tmp_path / "moe.gguf"
    write_gguf(hf_model("qwen3moe"), path, MODELS["qwen3moe"][3], quant=QT.Q8_0)
    experts = sum(int(t.n_bytes) for t in FastGGUFReader(path).tensors if "_exps." in t.name)
    assert experts > 0
    whole = budget_for(str(path), weights="gguf", expert_cache="resident").model
    assert whole == path.stat().st_size
    assert budget_for(str(path), weights="gguf", expert_cache="auto").model == whole - experts
    assert budget_for(str(path), weights="gguf", expert_cache="4096").model == whole - experts + 4096
