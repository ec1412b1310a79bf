#!/usr/bin/env bash
# Side-by-side load runs (BENCHMARKS.md "Serving"): tessera serve and llama-server on the
# same GGUF, one server at a time, driven by bench/load.py (the openai client under
# asyncio). Usage:
#   bash bench/serve-load.sh throughput   # 1, 4, 16, 64 concurrent (CONCS), ~400-token prompts
#   bash bench/serve-load.sh budget       # 4k-token prompts under one --kv-budget, per scheme
#     (BUDGET_MIB, BUDGET_KVS, BUDGET_REQUESTS, BUDGET_MAX_TOKENS)
# Env: TESSERA (binary, default target/release/tessera), LLAMA_SERVER (llama-server binary),
# MODEL (GGUF, default the default model), CORPUS (text for prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_SERVER=${LLAMA_SERVER:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
MODEL=${MODEL:-$HOME/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf}
CORPUS=${CORPUS:-../shared/corpus/pride-and-prejudice.txt}
PORT=${PORT:-18080}
. bench/servers.sh
load() { python3 bench/load.py --base-url "http://127.0.0.1:$PORT/v1" --corpus "$CORPUS" "$@"; }

echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') nproc=$(nproc)"
case "${1:-throughput}" in
throughput)
  for c in ${CONCS:-1 4 16 64}; do
    n=$(( c < 4 ? 4 : c ))
    "$LLAMA_SERVER" -m "$MODEL" -t 2 -np "$c" -cb -c $(( c * 1024 )) --port "$PORT" >/dev/null 2>&1 & pid=$!
    up; load --concurrency "$c" --requests "$n" --prompt-words 300 --max-tokens 64 --label llama-server; stop
    "$TESSERA" serve --model "$MODEL" --port "$PORT" --max-batch "$c" --max-queue 256 2>/dev/null & pid=$!
    up; load --concurrency "$c" --requests "$n" --prompt-words 300 --max-tokens 64 \
      --label "tessera bf16" --metrics-url "http://127.0.0.1:$PORT/metrics"; stop
  done ;;
budget)
  # One KV budget for every scheme: how many 4k-token requests run at once, and how fast each.
  for kv in ${BUDGET_KVS:-bf16 affine:4 turbo:4}; do
    "$TESSERA" serve --model "$MODEL" --port "$PORT" --kv "$kv" --max-batch 32 \
      --kv-budget "${BUDGET_MIB:-64}" --max-queue 256 2>/dev/null & pid=$!
    up; load --concurrency 16 --requests "${BUDGET_REQUESTS:-16}" --prompt-words 3000 \
      --max-tokens "${BUDGET_MAX_TOKENS:-64}" \
      --label "tessera $kv budget ${BUDGET_MIB:-64} MiB" --metrics-url "http://127.0.0.1:$PORT/metrics"; stop
  done ;;
esac
