"""What every loader (GGUF file, Hugging Face folder) returns: one shape for the engine to consume."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig


@dataclass
class LoadedModel:
    config: ModelConfig
    # Hugging Face parameter names and layouts ("model.layers.0.self_attn.q_proj.weight": (out, in)),
    # already in the compute dtype. GGUF's permuted llama Q/K rows are undone by the GGUF loader.
    # When config.tie_word_embeddings, "lm_head.weight" may be absent. With `--weights gguf` the
    # quantized projection/embedding matrices are QWeights (models/qweight.py) instead of tensors.
    weights: dict[str, "torch.Tensor | object"]
    tokenizer: "object"          # ternlm.text.tokenizer.Tokenizer
    chat_template: str | None    # jinja2 source, HF semantics; None when the model has none
    sha256: str                  # hex digest identifying the weights (part of the cache namespace)
    source: Path
    # digest of what else the loader read that shapes the computation and is not in `sha256`
    # (an HF folder's config.json: rope scaling, eps, ... may change without the weights); "" if none
    extra_sha256: str = ""
    # mixture of experts streamed from the file (models/moe.StreamedExperts; `--expert-cache`): its
    # experts' weights are then absent from `weights`; None: every expert is in `weights`
    experts: "object | None" = None
