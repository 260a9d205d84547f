"""Every CPU a user has: `--dtype auto` picks what the CPU runs exactly and well, an unsupported dtype
is one clear line (never a traceback from inside a layer), and the kernel fingerprint keeps one
machine's KV out of another's cache.

The AVX2-only host is reproduced on any host with oneDNN's own ISA cap (ONEDNN_MAX_CPU_ISA=AVX2 and
ATEN_CPU_CAPABILITY=avx2): under it torch's bf16 weight packing raises exactly as it does on an AVX2
EPYC ("bf16 path needs the cpu support avx_ne_convert or avx512bw..."), so the subprocess tests below
run the AVX2 code path for real wherever the suite runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from ternlm.cpu import (CLASSES, CpuInfo, UnsupportedDtypeError, choose_dtype, kernel_fingerprint, probe)

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


def cpu(flags: set[str], bf16: bool, cap: str = "", torch_version: str = "2.13.0+cpu") -> CpuInfo:
    return CpuInfo("test cpu", frozenset(flags), cap, torch_version, "AVX2", True, bf16)


HOSTS = {   # the host kinds this project has met, as their flags and torch's oneDNN bf16 check read
    "amx-sapphire-rapids": cpu(AVX512 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}, True),
    "avx512-epyc-zen4": cpu(AVX512 | {"avx512_bf16", "avx512_vnni"}, True),
    "avx512-skylake": cpu(AVX512, True),
    "avx2-epyc": cpu({"avx2", "fma", "f16c"}, False),
    "old-x86": cpu(set(), False),
}


@pytest.mark.parametrize("host,cls,auto", [
    ("amx-sapphire-rapids", "amx", "float32"), ("avx512-epyc-zen4", "avx512_bf16", "bfloat16"),
    ("avx512-skylake", "avx512", "float32"), ("avx2-epyc", "avx2", "float32"), ("old-x86", "baseline", "float32")])
def test_auto_follows_the_cpu_class(host, cls, auto):
    c = HOSTS[host]
    assert c.isa_class == cls
    choice = choose_dtype("auto", c)
    assert choice.dtype == auto and choice.kernel == "onednn-packed"
    assert choice.log_line.startswith(f"dtype auto -> {auto}, onednn-packed (cpu: ")
    assert choose_dtype("float32", c).dtype == "float32"


def test_bf16_without_onednn_bf16_is_one_clear_line():
    with pytest.raises(UnsupportedDtypeError) as e:
        choose_dtype("bfloat16", HOSTS["avx2-epyc"])
    msg = str(e.value)
    assert "\n" not in msg and "AVX2" in msg and "--dtype auto or float32" in msg
    assert choose_dtype("bf16", HOSTS["avx512-skylake"]).dtype == "bfloat16"   # works there, just slower
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        choose_dtype("int3", HOSTS["avx512-epyc-zen4"])


def test_onednn_cap_lowers_the_class_never_raises_it():
    zen4 = HOSTS["avx512-epyc-zen4"]
    assert dataclasses.replace(zen4, onednn_max_isa="AVX2").isa_class == "avx2"
    assert dataclasses.replace(zen4, onednn_max_isa="avx512_core").isa_class == "avx512"
    assert dataclasses.replace(zen4, onednn_max_isa="AVX512_CORE_AMX").isa_class == "avx512_bf16"
    assert dataclasses.replace(HOSTS["avx2-epyc"], onednn_max_isa="ALL").isa_class == "avx2"


def test_amx_is_capped_to_avx512_bf16_and_uncapped_amx_refuses_bf16(monkeypatch):
    """[ONEDNN-CAP] oneDNN's AMX bf16 rows are not batch-invariant (test_model's linear test fails with
    AMX uncapped on a Sapphire Rapids), so import caps it; a user's own cap wins."""
    from ternlm.cpu import AMX_CAP, cap_onednn_below_amx
    spr_flags = ("test", AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"})
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    assert not cap_onednn_below_amx(("test", AVX512 | {"avx512_bf16"})) and "ONEDNN_MAX_CPU_ISA" not in os.environ
    assert cap_onednn_below_amx(spr_flags) and os.environ["ONEDNN_MAX_CPU_ISA"] == AMX_CAP
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")        # the user's cap stays
    assert not cap_onednn_below_amx(spr_flags) and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"
    capped = dataclasses.replace(HOSTS["amx-sapphire-rapids"], onednn_max_isa=AMX_CAP)
    assert capped.isa_class == "avx512_bf16" and choose_dtype("auto", capped).dtype == "bfloat16"
    uncapped = HOSTS["amx-sapphire-rapids"]
    assert uncapped.isa_class == "amx" and choose_dtype("auto", uncapped).dtype == "float32"
    with pytest.raises(UnsupportedDtypeError, match="not batch-invariant") as e:
        choose_dtype("bfloat16", uncapped)
    assert "\n" not in str(e.value)


def test_this_process_runs_capped_where_the_cpu_has_amx():
    c = probe()
    if {"amx_tile", "amx_bf16"} <= c.flags and "AMX" not in c.onednn_max_isa.upper():
        assert c.isa_class != "amx"


def test_amx_the_os_does_not_grant_is_not_the_amx_class():
    """A Sapphire Rapids whose kernel does not hand out AMX tiles (Linux < 5.16, a VM hiding XTILEDATA),
    oneDNN uncapped: oneDNN computes with AVX-512 BF16 there, so the class (and the cache namespace) must
    say so, and bf16 is exact there."""
    spr = HOSTS["amx-sapphire-rapids"]
    denied = dataclasses.replace(spr, amx_granted=False)
    assert denied.isa_class == "avx512_bf16" and choose_dtype("auto", denied).dtype == "bfloat16"
    assert kernel_fingerprint(choose_dtype("float32", denied), denied) != \
        kernel_fingerprint(choose_dtype("float32", spr), spr)


def test_fingerprint_names_every_kernel_input():
    base = HOSTS["avx512-epyc-zen4"]
    prints = {kernel_fingerprint(choose_dtype(d, c), c)
              for c in (base, HOSTS["avx512-skylake"], dataclasses.replace(base, torch_version="2.14.0+cpu"),
                        dataclasses.replace(base, torch_capability="AVX512"))
              for d in ("float32", "bfloat16")}
    spr = HOSTS["amx-sapphire-rapids"]                  # uncapped AMX: float32 only (bf16 is refused)
    prints.add(kernel_fingerprint(choose_dtype("float32", spr), spr))
    assert len(prints) == 9         # 4 CPU/torch variants x 2 dtypes + AMX fp32, all different


def test_probe_agrees_with_torch():
    c = probe()
    assert c.isa_class in CLASSES and c.torch_version == torch.__version__
    assert c.mkldnn_bf16 == (c.mkldnn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    if c.isa_class in ("avx512", "avx512_bf16", "amx"):
        assert c.mkldnn_bf16
    if "amx_tile" in c.flags:    # the class says amx exactly where torch could enable the tiles
        assert c.amx_granted == bool(torch.cpu._init_amx())
    choice = choose_dtype("auto", c)
    if choice.dtype == "bfloat16":
        # what auto picks must run: pack a weight the way the model does
        from ternlm.linear.dense import Linear
        lin = Linear(torch.randn(8, 16, dtype=torch.bfloat16))
        assert lin.packed and lin(torch.randn(3, 16, dtype=torch.bfloat16)).shape == (3, 8)


# ---- the AVX2 path for real, through the CLI (oneDNN capped to AVX2 in a child process) ------------

AVX2_ENV = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "OMP_WAIT_POLICY": "PASSIVE"}


def ternlm(*args: str, env=AVX2_ENV, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ternlm.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_info_on_an_avx2_cpu():
    r = ternlm("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["cpu"]["isa_class"] == "avx2" and info["torch"]["onednn_bf16"] is False
    assert info["dtype"]["auto"]["dtype"] == "float32"
    assert "refused" in info["dtype"]["bfloat16"]
    text = ternlm("info")
    assert text.returncode == 0 and "--dtype auto      float32, onednn-packed (cpu: AVX2" in text.stdout


def test_explicit_bf16_on_an_avx2_cpu_fails_in_one_line_before_loading(smollm2_gguf):
    for cmd in (["generate", "--dtype", "bfloat16", "hi"], ["serve", "--dtype", "bf16", "--port", "1"]):
        r = ternlm(*cmd)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("ternlm: error: --dtype bfloat16 needs a CPU")


def test_auto_generates_on_an_avx2_cpu_like_float32(smollm2_gguf):
    """The default path that crashed at load on an AVX2 EPYC now loads, logs its choice and answers
    exactly as the explicit choice it resolved to does (same kernels, same greedy text): the GGUF's
    own blocks where the native kernel builds, dense float32 where it does not (TERNLM_NATIVE=0)."""
    args = ["generate", "--max-tokens", "8", "--temperature", "0", "Once upon a time"]
    auto = ternlm(*args)
    assert auto.returncode == 0, auto.stderr
    # [SMALL-FP32]: the 135M default model multiplies fp32 activations under auto (weights.py)
    assert "weights auto -> gguf (quantized blocks, fp32 activations (auto: 135M parameters, under 200M)" \
        in auto.stderr
    gguf = ternlm(*args, "--weights", "gguf")
    assert gguf.returncode == 0 and auto.stdout == gguf.stdout and auto.stdout.strip()
    no_native = {**AVX2_ENV, "TERNLM_NATIVE": "0"}
    dense = ternlm(*args, env=no_native)
    assert dense.returncode == 0, dense.stderr
    assert "dtype auto -> float32, onednn-packed (cpu: AVX2" in dense.stderr
    assert "weights auto -> dense (dense weights in the compute dtype: no native kernel" in dense.stderr
    f32 = ternlm(*args, "--dtype", "float32", env=no_native)
    assert f32.returncode == 0 and dense.stdout == f32.stdout and dense.stdout.strip()


# ---- the fingerprint in the cache: another machine's blocks are a miss, never an error -------------

def test_a_block_from_another_fingerprint_is_a_miss(tmp_path):
    from ternlm.kv.store import CacheConfig
    from tiny import tiny_engine
    here = probe()
    r = random.Random(5)
    prompt = [r.randrange(256) for _ in range(400)]

    def engine(c: CpuInfo):
        return tiny_engine("llama", seed=4, min_reuse=1, chunk_size=64, dtype="float32", cpu=c,
                           cache=CacheConfig(0, tmp_path, 1 << 30))[1]

    writer = engine(here)
    first = writer.generate(prompt, max_tokens=2, keep_logits=True)
    assert first.cached_tokens == 0
    writer.persist_cache()
    assert list(tmp_path.rglob("*.tkv"))
    others = [dataclasses.replace(here, torch_version="0.0.0-other"),
              dataclasses.replace(here, torch_capability="OTHER"),
              dataclasses.replace(here, onednn_max_isa="SSE41")]
    for other in others:
        e = engine(other)
        assert e.model_namespace != writer.model_namespace
        out = e.generate(prompt + [1], max_tokens=2, keep_logits=True)
        assert out.cached_tokens == 0 and out.restored.tier == "none"
        assert e.store.disk.stats.damaged == 0                 # a miss, not a bad file
    same = engine(here)                                        # control: the same fingerprint loads them
    out = same.generate(prompt + [1], max_tokens=2)
    assert out.restored.tier == "disk" and out.cached_tokens >= 384


def test_config_as_loaded_is_in_the_namespace():
    from tiny import tiny_engine, tiny_loaded
    from ternlm.engine.core import Engine
    _, a = tiny_engine("llama", seed=4)
    _, loaded = tiny_loaded("llama", seed=4)
    loaded.extra_sha256 = "another config.json"
    b = Engine(loaded, dtype="float32")
    assert a.model_namespace != b.model_namespace


@pytest.mark.parametrize("flags,avx512", [("fpu sse avx f16c fma avx2", "OFF"),
                                          ("avx f16c fma avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16", "ON")])
def test_peer_build_flags_follow_the_host(tmp_path, flags, avx512):
    """`make bench-peers` builds llama.cpp with the ISA options the host has: an AVX2-only CPU gets no
    AVX-512 (that build could not run there), and AMX is off everywhere (its path crashes)."""
    from pathlib import Path
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "peer-cmake-flags"
    out = subprocess.run([str(script)], env={**os.environ, "CPUINFO": str(info)}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert f"-DGGML_AVX512={avx512}" in out and "-DGGML_AVX2=ON" in out and "-DGGML_NATIVE=OFF" in out
    assert "-DGGML_AMX_INT8=OFF" in out and "-DGGML_AMX_TILE=OFF" in out
    assert ("-DGGML_AVX512_BF16=ON" in out) == (avx512 == "ON")
