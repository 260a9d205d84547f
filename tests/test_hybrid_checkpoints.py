"""Hybrid checkpoints as they are published (issue 47): Qwen3.5 on the Hub is a vision-language folder
(Qwen3_5ForConditionalGeneration: the language model under model.language_model., a vision tower under
model.visual., a multi-token-prediction block under mtp.), and llama.cpp's converter, run without --no-mtp,
appends that MTP block to the GGUF as its last block (`qwen35.nextn_predict_layers` = 1). We run the language
model, text only; the MTP block is set aside ([MTP-ASIDE], models/gguf.py).

Oracles: transformers' Qwen3_5ForConditionalGeneration on the same tiny random model (text input only; it skips
mtp.* itself), and llama.cpp's own converter (the llama-cpp-python 0.3.36 sdist, tests/nemotron_to_gguf.py) for
the GGUF files: with the MTP block and with --no-mtp, which must run the same bits.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ternlm.engine.core import Engine
from ternlm.engine.fit import budget_for
from ternlm.models.gguf import FastGGUFReader, load_gguf
from hybrid_checks import assert_fp64_parity, folder_engine, save_folder
from nemotron_to_gguf import convert
from test_hybrid import TINY
from test_moe import ids_of

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY["hidden_size"],
              patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


def hf_qwen35_vl(seed: int):
    """A tiny random Qwen3_5ForConditionalGeneration (its language model test_hybrid's TINY), norms away from
    their zero init as test_hybrid.hf_qwen35 does."""
    import transformers as tf
    cfg = tf.Qwen3_5Config(text_config=tf.Qwen3_5TextConfig(**TINY).to_dict(),
                           vision_config=tf.Qwen3_5VisionConfig(**VISION).to_dict(), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "language_model" in n and n.endswith("norm.weight"):
                p.normal_(1 if "linear_attn" in n else 0, 0.3)
    return model


def _mtp_block(seed: int) -> dict[str, torch.Tensor]:
    """Qwen3.5's MTP block as its checkpoints store it (mtp.fc, its norms, one attention layer with an MLP):
    random, since nothing here runs it; it must only not change the main model."""
    h, hd, inter = TINY["hidden_size"], TINY["head_dim"], TINY["intermediate_size"]
    q, kv = TINY["num_attention_heads"] * hd, TINY["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
              "norm.weight": (h,), "layers.0.input_layernorm.weight": (h,),
              "layers.0.post_attention_layernorm.weight": (h,), "layers.0.self_attn.q_proj.weight": (2 * q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.self_attn.q_norm.weight": (hd,),
              "layers.0.self_attn.k_norm.weight": (hd,), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter)}
    return {f"mtp.{n}": torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    """(transformers model, folder): the vision-language checkpoint with an MTP block in a shard of its own and
    text_config.mtp_num_hidden_layers = 1, as Qwen3.5's own folders have."""
    hf = hf_qwen35_vl(seed=3)
    folder = tmp_path_factory.mktemp("qwen35_vl")
    save_folder(hf, folder)
    save_file(_mtp_block(seed=4), folder / "model-mtp.safetensors")      # the converter reads model*.safetensors
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf, folder


def test_vision_language_folder_runs_its_language_model(vl_folder):
    """The folder loads as qwen35 (the language model's config and weights; the vision tower and MTP block
    skipped), its logits within fp32 rounding of transformers' on text input, argmax equal; the fit check
    sizes the same parameters the loader keeps (the vision tower and MTP block are not counted)."""
    hf, folder = vl_folder
    engine = folder_engine(folder)
    cfg = engine.config
    assert cfg.arch == "qwen35" and cfg.num_layers == 4 and cfg.layer_kinds == ("deltanet",) * 3 + ("attention",)
    ids = ids_of(120, seed=2)
    assert_fp64_parity(hf, engine.logits(ids), ids, "vision-language folder")
    language = sum(p.numel() for n, p in hf.named_parameters() if "visual" not in n)
    assert budget_for(str(folder), dtype="float32").model == language * 4


@pytest.fixture(scope="module")
def converted(vl_folder, tmp_path_factory):
    """{"mtp" | "no-mtp": GGUF path}: llama.cpp's converter on the vision-language folder (its text model,
    Qwen3_5TextModel), f32, with the MTP block and with --no-mtp."""
    _, folder = vl_folder
    out = tmp_path_factory.mktemp("qwen35_vl_gguf")
    paths = {"mtp": out / "mtp.gguf", "no-mtp": out / "no-mtp.gguf"}
    convert(folder, paths["mtp"], "f32", TINY["vocab_size"], model="qwen.Qwen3_5TextModel")
    convert(folder, paths["no-mtp"], "f32", TINY["vocab_size"], model="qwen.Qwen3_5TextModel", extra=("--no-mtp",))
    return paths


def test_converter_gguf_with_an_mtp_block_runs_the_main_model(vl_folder, converted):
    """The converter's file with the MTP block (block_count 5, nextn_predict_layers 1, blk.4.nextn.*) loads as
    the 4-layer main model with blk.4 set aside, and runs the --no-mtp file's bits exactly; within fp32 rounding
    of transformers."""
    hf, _ = vl_folder
    reader = FastGGUFReader(converted["mtp"])
    assert int(reader.get_field("qwen35.block_count").contents()) == 5
    assert int(reader.get_field("qwen35.nextn_predict_layers").contents()) == 1
    aside = {t.name for t in reader.mtp_tensors}
    assert "blk.4.nextn.eh_proj.weight" in aside and all(n.startswith("blk.4.") for n in aside)
    assert not any(t.name.startswith("blk.4.") for t in reader.tensors)
    engines = {k: Engine(load_gguf(p, torch.float32), dtype="float32", kv_dtype="float32", min_reuse=1)
               for k, p in converted.items()}
    assert engines["mtp"].config == engines["no-mtp"].config and engines["mtp"].config.num_layers == 4
    ids = ids_of(100, seed=5)
    logits = engines["mtp"].logits(ids)
    assert torch.equal(logits, engines["no-mtp"].logits(ids))
    assert_fp64_parity(hf, logits, ids, "converter gguf with an MTP block")
    with_block, without = (budget_for(str(converted[k]), dtype="float32").model for k in ("mtp", "no-mtp"))
    assert abs(with_block - without) < sum(int(t.n_bytes) for t in reader.mtp_tensors) / 10     # headers differ
