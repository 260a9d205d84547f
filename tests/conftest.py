"""Shared fixtures: the real default model and its transformers oracle, loaded once per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


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
    from ternlm import Engine
    return Engine.load("smollm2-135m", dtype="bfloat16")
