#!/usr/bin/env bash
# Issue 46's quality figures beside llama.cpp's own (benchmarks/RESULTS.md, "Quality of int8 activations"):
# llama.cpp's top-token agreement and perplexity of the quantized file against the same weights as F32
# (llama-perplexity --kl-divergence-base / --kl-divergence: "Same top p"), then ternlm's agreement on the same
# tokens and scored positions and on bench quality's stream, with lm_head and layers int8|fp32 (int8_agreement.py).
#   benchmarks/int8_quality_peer.sh OUT_DIR TMP_DIR   (TMP_DIR holds the F32 files, up to 6.6 GiB, and the
#   base logits, up to 0.5 GiB; deleted F32 files after use). Env: B (llama.cpp's bin), L (its source), M (models).
set -euo pipefail
out=$(realpath -m "$1"); tmp=$(realpath -m "$2"); mkdir -p "$out" "$tmp"
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
B="${B:-$("$root/scripts/build-llamacpp" | tail -1)}"
L="${L:-$("$root/scripts/llamacpp-src" | tail -1)}"
M="${M:-$HOME/.cache/ternlm/models}"
"$py" "$root/benchmarks/int8_agreement.py" --write-text "$tmp/text.txt"
for spec in smollm2-135m:SmolLM2-135M-Instruct.Q4_1.gguf gemma3-270m:gemma-3-270m-q4_k_m.gguf \
            qwen2.5-coder-0.5b:qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
            qwen2.5-coder-1.5b:qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; do
  name=${spec%%:*}; file=${spec#*:}
  "$py" "$root/benchmarks/dequant_gguf.py" "$M/$file" "$tmp/$name-f32.gguf" --llama-src "$L"
  "$B/llama-perplexity" -m "$tmp/$name-f32.gguf" -f "$tmp/text.txt" -c 512 -b 512 --chunks 4 -t 1 \
    --kl-divergence-base "$tmp/$name.kld" > "$out/$name-base.log" 2>&1
  "$B/llama-perplexity" -m "$M/$file" -f "$tmp/text.txt" -c 512 -b 512 --chunks 4 -t 1 \
    --kl-divergence-base "$tmp/$name.kld" --kl-divergence > "$out/$name-kld.log" 2>&1
  rm -f "$tmp/$name-f32.gguf"
  OMP_WAIT_POLICY=PASSIVE PYTHONPATH="$root/src" "$py" "$root/benchmarks/int8_agreement.py" -m "$name" \
    --kld-base "$tmp/$name.kld" --threads 1 --out "$out/agreement-$name.json" > "$out/agreement-$name.log" 2>&1
done
