"""Write a synthetic mixture-of-experts GGUF (qwen3moe layout) of a real model's geometry (issue 36).

Random but well-formed weights: Q4_K blocks for attention, gate/up experts and the embedding, Q6_K for
the LM head and the down experts of llama.cpp's Q4_K_M layers (use_more_bits), Q4_K elsewhere, every fp16 scale finite and small;
the router, norms F32. Meaningless text, real bytes: real file size, routing spread and timings
(quality is the tiny-model parity's job: tests/test_moe.py). A minimal byte-level BPE tokenizer and a
ChatML template make it loadable by `ternlm serve` and by llama.cpp.

Written streaming: the header first, then one tensor at a time (the largest, qwen3-30b-a3b's token
embedding, ~175 MB), so the script's memory stays far below the file.

    python benchmarks/synth_moe_gguf.py --preset olmoe-small -o /tmp/olmoe-small.gguf        # ~1.1 GB
    python benchmarks/synth_moe_gguf.py --preset qwen3-30b-a3b -o /data/qwen3-30b-a3b-synth.gguf  # ~17 GB
    python benchmarks/synth_moe_gguf.py --layers 4 --experts 16 --active 4 --hidden 512 --expert-ffn 256 ...
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

ARCH = "qwen3moe"


@dataclass(frozen=True)
class Geometry:
    layers: int
    experts: int
    active: int
    hidden: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int = 32768


PRESETS = {
    # Qwen3-30B-A3B: 48 layers, 128 experts (8 active), hidden 2048, expert FFN 768, 32 q / 4 kv heads of 128
    "qwen3-30b-a3b": Geometry(48, 128, 8, 2048, 768, 32, 4, 128, 151936, 40960),
    # OLMoE-1B-7B's routing (64 experts, 8 active) at half its width and depth: ~1.1 GB, fits in RAM
    "olmoe-small": Geometry(16, 64, 8, 1024, 512, 16, 4, 64, 50304, 4096),
}

_BLOCK = {QT.Q4_K: (256, 144), QT.Q6_K: (256, 210), QT.Q8_0: (32, 34)}
_F16_FIELDS = {QT.Q4_K: (0, 2), QT.Q6_K: (208,), QT.Q8_0: (0,)}   # d, dmin / d / d: the fp16 scales kept finite and small
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int, lead: int = 1) -> np.ndarray:
    """(lead, rows, cols / block * type_size) uint8: random codes and sub-scales, fp16 super-scales
    drawn from N(0, 0.02) (finite; the hidden state stays in range over many layers)."""
    block, size = _BLOCK[qtype]
    n = lead * rows * (cols // block)
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        raw[:, off:off + 2] = (rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(lead, rows, -1) if lead > 1 else raw.reshape(rows, -1)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the byte-level BPE's first 256 tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def add_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """A byte-level BPE: 256 byte tokens, a few merges, ChatML's special tokens, fillers to `vocab`."""
    alphabet = _byte_alphabet()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e"]
    tokens = alphabet + [a.replace(" ", "") for a in merges] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    special = {len(tokens) - 3, len(tokens) - 2, len(tokens) - 1}
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(vocab)])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def tensor_plan(g: Geometry) -> list[tuple[str, QT | None, tuple[int, ...]]]:
    """(name, type or None for F32, shape in numpy order: (E,) rows, cols) of every tensor, in file order."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    plan = [("token_embd.weight", QT.Q4_K, (g.vocab, g.hidden)), ("output_norm.weight", None, (g.hidden,)),
            ("output.weight", QT.Q6_K, (g.vocab, g.hidden))]
    for i in range(g.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", None, (g.hidden,)), (b + "attn_q.weight", QT.Q4_K, (q, g.hidden)),
                 (b + "attn_k.weight", QT.Q4_K, (kv, g.hidden)), (b + "attn_v.weight", QT.Q6_K, (kv, g.hidden)),
                 (b + "attn_q_norm.weight", None, (g.head_dim,)), (b + "attn_k_norm.weight", None, (g.head_dim,)),
                 (b + "attn_output.weight", QT.Q4_K, (g.hidden, q)), (b + "ffn_norm.weight", None, (g.hidden,)),
                 (b + "ffn_gate_inp.weight", None, (g.experts, g.hidden)),
                 (b + "ffn_gate_exps.weight", QT.Q4_K, (g.experts, g.expert_ffn, g.hidden)),
                 (b + "ffn_up_exps.weight", QT.Q4_K, (g.experts, g.expert_ffn, g.hidden)),
                 (b + "ffn_down_exps.weight", QT.Q6_K if _more_bits(i, g.layers) else QT.Q4_K,
                  (g.experts, g.hidden, g.expert_ffn))]
    return plan


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for ffn_down: Q6_K on the first and last eighth and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _nbytes(qtype: QT | None, shape: tuple[int, ...]) -> int:
    n = int(np.prod(shape))
    if qtype is None:
        return 4 * n
    block, size = _BLOCK[qtype]
    return n // block * size


def _data(rng: np.random.Generator, name: str, qtype: QT | None, shape: tuple[int, ...]) -> np.ndarray:
    if qtype is not None:
        return random_blocks(rng, qtype, shape[-2], shape[-1], shape[0] if len(shape) == 3 else 1)
    if name.endswith("ffn_gate_inp.weight"):                  # the router: spread, so many experts are used
        return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(np.float32)
    return np.ones(shape, dtype=np.float32)                   # norms


def write(path: Path, g: Geometry, seed: int = 0, log=print) -> int:
    """Writes the file; returns its size in bytes."""
    for dim, block in ((g.hidden, 256), (g.expert_ffn, 256), (g.heads * g.head_dim, 256)):
        if dim % block:
            raise ValueError(f"{dim} is not a multiple of the K-quant block {block}")
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, ARCH)
    w.add_name(f"synthetic {ARCH} {g.layers}x{g.experts}e (random weights)")
    w.add_block_count(g.layers)
    w.add_context_length(g.context)
    w.add_embedding_length(g.hidden)
    w.add_feed_forward_length(g.expert_ffn * g.active)
    w.add_expert_feed_forward_length(g.expert_ffn)
    w.add_expert_count(g.experts)
    w.add_expert_used_count(g.active)
    w.add_head_count(g.heads)
    w.add_head_count_kv(g.kv_heads)
    w.add_key_length(g.head_dim)
    w.add_value_length(g.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(15)                                       # LLAMA_FTYPE_MOSTLY_Q4_K_M
    add_tokenizer(w, g.vocab)
    plan = tensor_plan(g)
    for name, qtype, shape in plan:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(None, shape))
        else:
            block, size = _BLOCK[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _nbytes(qtype, shape), raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0, done = time.perf_counter(), 0
    total = sum(_nbytes(q, s) for _, q, s in plan)
    for i, (name, qtype, shape) in enumerate(plan):
        data = _data(rng, name, qtype, shape)
        w.write_tensor_data(data)
        done += data.nbytes
        del data
        if log and (i % 50 == 0 or i == len(plan) - 1):
            log(f"  {done / 2**30:6.2f} / {total / 2**30:.2f} GiB  ({time.perf_counter() - t0:.0f} s)")
    w.close()
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default=None)
    ap.add_argument("-o", "--output", required=True, type=Path)
    for field in Geometry.__dataclass_fields__:
        ap.add_argument(f"--{field.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    given = {f: getattr(args, f) for f in Geometry.__dataclass_fields__ if getattr(args, f) is not None}
    if args.preset:
        g = replace(PRESETS[args.preset], **given)
    else:
        missing = [f for f in Geometry.__dataclass_fields__ if f not in given and f != "context"]
        if missing:
            ap.error(f"without --preset give every dimension; missing: {', '.join(missing)}")
        g = Geometry(**given)
    total = sum(_nbytes(q, s) for _, q, s in tensor_plan(g))
    print(f"writing {args.output}: {asdict(g)} ~{total / 2**30:.2f} GiB", file=sys.stderr)
    size = write(args.output, g, args.seed, log=lambda m: print(m, file=sys.stderr))
    print(f"{args.output}: {size} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
