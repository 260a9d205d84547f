#!/usr/bin/env bash
# The resident OLMoE-shaped file (issue 49's resident row; issue 46's MoE int8 path): ternlm with int8 and fp32
# activations beside llama.cpp's own llama-bench (built by `make bench-peers`), 2 threads, medians of 3,
# OpenMP at its default (spinning) for both, one after another. Usage: benchmarks/moe_int8_peers.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}
mkdir -p "$out"
bin=$(scripts/build-llamacpp | tail -1)
f="$out/olmoe-small.gguf"
[ -f "$f" ] || .venv/bin/python benchmarks/synth_moe_gguf.py --preset olmoe-small -o "$f" >/dev/null
date -u; git rev-parse --short HEAD; grep -o 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for act in int8 fp32; do
  echo "== ternlm bench engine --activations $act"
  .venv/bin/ternlm bench engine -m "$f" --activations $act --threads 2 --repeats 3 --peers none --prompt-tokens 512 \
    --decode-context 512 --decode-tokens 64 --out "$out/ternlm-$act" 2>&1 | grep -A2 "prefill tok/s"
done
echo "== llama-bench"
"$bin/llama-bench" -m "$f" -t 2 -r 3 -p 512 -n 0 | grep -E "pp512"
"$bin/llama-bench" -m "$f" -t 2 -r 3 -p 0 -n 64 -d 512 | grep -E "tg64"
rm -f "$f"                       # synthetic: rebuilt from the script's fixed seed
date -u
