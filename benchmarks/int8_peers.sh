#!/usr/bin/env bash
# Issue 46's side-by-side run: ternlm (int8 activations, the default; fp32 for the 1.5B) beside llama.cpp's own
# llama-bench (built by `make bench-peers`), 2 threads, medians of 3, one model after another on a quiet host;
# then decode against the bandwidth bound. OpenMP left at its default (spinning) for both engines, as a user
# runs them. Usage: benchmarks/int8_peers.sh OUTDIR   (raw JSON and the log under OUTDIR)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}
mkdir -p "$out"
bin=$(scripts/build-llamacpp | tail -1)
path() { .venv/bin/ternlm models 2>/dev/null | sed -n "s/^$1: //p"; }
date -u; git rev-parse --short HEAD; grep -o 'avx512_vnni\|amx_int8\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for m in qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m gemma3-270m; do
  f=$(path $m)
  for ctx in 1024 4000; do
    [ "$ctx" = 4000 ] && [ "$m" != qwen2.5-coder-1.5b ] && continue
    dt=$([ "$ctx" = 1024 ] && echo 128 || echo 64)
    echo "== $m: ternlm bench engine --decode-context $ctx"
    .venv/bin/ternlm bench engine -m $m --threads 2 --repeats 3 --peers none --prompt-tokens 1024 \
      --decode-context $ctx --decode-tokens $dt --out "$out/$m-int8-$ctx" 2>&1 | grep -A2 "prefill tok/s"
    echo "== $m: llama-bench"
    if [ "$ctx" = 1024 ]; then "$bin/llama-bench" -m "$f" -t 2 -r 3 -p 1024 -n 0 | grep -E "pp1024"; fi
    "$bin/llama-bench" -m "$f" -t 2 -r 3 -p 0 -n $dt -d $ctx | grep -E "tg$dt"
  done
done
echo "== qwen2.5-coder-1.5b: ternlm --activations fp32"
.venv/bin/ternlm bench engine -m qwen2.5-coder-1.5b --activations fp32 --threads 2 --repeats 3 --peers none \
  --prompt-tokens 1024 --decode-context 1024 --decode-tokens 128 --out "$out/qwen2.5-coder-1.5b-fp32-1024" 2>&1 | grep -A2 "prefill tok/s"
echo "== decode_bound"
.venv/bin/python benchmarks/decode_bound.py -m qwen2.5-coder-1.5b --context 1024 --threads 2 --json "$out/decode-bound-1024.json" 2>&1 | grep -v "^ternlm:"
date -u
