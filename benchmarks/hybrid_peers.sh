#!/usr/bin/env bash
# Issue 47's engine run: the synthetic qwen35 file (benchmarks/synth_qwen35_gguf.py: 24 layers, hidden 1024,
# Q4_K_M-like) through ternlm bench engine (int8 activations, the default) beside llama.cpp's own llama-bench
# (built by `make bench-peers`), 2 threads, medians of 3, OpenMP at its default for both, one after another.
# Usage: benchmarks/hybrid_peers.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}
mkdir -p "$out"
bin=$(scripts/build-llamacpp | tail -1)
f="$out/qwen35-24x1024.gguf"
[ -f "$f" ] || .venv/bin/python benchmarks/synth_qwen35_gguf.py -o "$f" >/dev/null
date -u; git rev-parse --short HEAD; grep -o 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
echo "== ternlm bench engine"
.venv/bin/ternlm bench engine -m "$f" --threads 2 --repeats 3 --peers none --prompt-tokens 512 \
  --decode-context 512 --decode-tokens 64 --out "$out/ternlm" 2>&1 | grep -A2 "prefill tok/s"
echo "== llama-bench"
"$bin/llama-bench" -m "$f" -t 2 -r 3 -p 512 -n 0 | grep -E "pp512"
"$bin/llama-bench" -m "$f" -t 2 -r 3 -p 0 -n 64 -d 512 | grep -E "tg64"
date -u
