#!/usr/bin/env bash
# Issue 46's replay: the same conversations through ternlm serve (int8 activations, reuse on; and --no-prefix-kv)
# and llama.cpp's own llama-server (built by `make bench-peers`; its defaults but one slot and 2 threads), one
# after another. Usage: benchmarks/int8_replay.sh MODEL|FILE.gguf OUTDIR [bench multiturn options...]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?MODEL}; out=${2:?OUTDIR}; shift 2
mkdir -p "$out"
bin=$(scripts/build-llamacpp | tail -1)
if [ -f "$model" ]; then file=$model; else file=$(.venv/bin/ternlm models 2>/dev/null | sed -n "s/^$model: //p"); fi
# shellcheck disable=SC2086
"$bin/llama-server" -m "$file" -t 2 -tb 2 -c 8192 -np 1 --host 127.0.0.1 --port 8091 ${LLAMA_SERVER_ARGS:-} \
  > "$out/llama-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 1; done
.venv/bin/ternlm bench multiturn -m "$model" --url http://127.0.0.1:8091/v1 --label llama-server --out "$out" "$@"
