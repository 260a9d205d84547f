"""Shared fixtures: the real default model and its transformers oracle, loaded once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


# Data the tests read, committed with its licence (tests/data/README.md); nothing outside the repository.
TEST_DATA = Path(__file__).resolve().parent / "data"


def _onednn_bf16() -> bool:
    from ternlm.cpu import probe
    return probe().mkldnn_bf16


# bf16 kernels exist only where oneDNN runs bf16 (AVX-512 BW/VL/DQ, AVX-NE-CONVERT, AMX); elsewhere the
# engine refuses bfloat16 (cpu.py), so bf16 cases skip and say why. Their float32 twins run everywhere.
needs_bf16 = pytest.mark.skipif(not _onednn_bf16(), reason="bf16 kernels: oneDNN has no bf16 on this CPU "
                                "(e.g. AVX2 only); the float32 cases check the same property")
BF16 = pytest.param(torch.bfloat16, marks=needs_bf16, id="bfloat16")
FP32 = pytest.param(torch.float32, id="float32")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TERNLM_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="opt-in: needs the 491 MB qwen2.5-coder-0.5b; run with TERNLM_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from ternlm.models.registry import model_path
    return model_path("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own GGUF loader and model: the oracle, fp32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_f32():
    from ternlm import Engine
    return Engine.load("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def smollm2_bf16():
    if not _onednn_bf16():
        pytest.skip(needs_bf16.kwargs["reason"])
    from ternlm import Engine
    return Engine.load("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="session")
def smollm2_q():
    """The default model with --weights gguf: its Q4_1 blocks kept quantized, the native kernel (built
    for this CPU with the system C compiler on first use; a missing compiler fails here, loudly), and
    int8 activations (kernels/qint8.c; what `auto` picks for models of 200M parameters and more, weights.py
    [SMALL-FP32]; named here so the int8 tests keep testing int8)."""
    from ternlm import Engine
    return Engine.load("smollm2-135m", weights="gguf", activations="int8")


@pytest.fixture(scope="session")
def smollm2_qf():
    """smollm2_q with fp32 activations (`--activations fp32`): every product is GGML's weight times
    the fp32 activation, the transformers-parity path."""
    from ternlm import Engine
    return Engine.load("smollm2-135m", weights="gguf", activations="fp32")


@pytest.fixture(scope="session")
def smollm2_q32():
    """smollm2_qf with an fp32 KV cache (`--kv-dtype float32`; the default is fp16 with these weights)."""
    from ternlm import Engine
    return Engine.load("smollm2-135m", weights="gguf", kv_dtype="float32", activations="fp32")
