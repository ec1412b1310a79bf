#!/usr/bin/env bash
# CPU speed side by side (BENCHMARKS.md "CPU speed"): llama-bench and tessera bench on the
# same GGUF files, ROUNDS rounds, this CPU's two cores.
#   prefill 512, decode of 64 at depth 0: llama-bench -p 512 -n 64 -r 3 against
#     tessera bench --prompt-tokens 512 --gen-tokens 64 --repeat 3 (bf16 cache, f16 for llama.cpp)
#   decode of 32 at depth 4096 (DEPTH=1): llama-bench -p 0 -n 32 -d 4096 -r 1 against
#     tessera bench --prompt-tokens 512 --gen-tokens 32 --depth 4096 --repeat 1
#   decode of 32 at depth 16384 with 4-bit caches (DEEP=1): llama-bench -fa 1 -ctk q4_0
#     -ctv q4_0 -p 0 -n 32 -d 16384 -r 1 against tessera bench --kv affine:4 / turbo:4
#     --prompt-tokens 16 --gen-tokens 32 --depth 16384 --repeat 1
#   the AVX2 level (LLAMA_BIN_AVX2 set: a llama.cpp built with -DGGML_NATIVE=OFF
#     -DGGML_AVX2=ON -DGGML_AVX512=OFF): the first section again, tessera at --isa avx2
# Env: TESSERA, LLAMA_BIN (llama.cpp's build/bin), LLAMA_BIN_AVX2, MODELS (GGUF paths),
# ROUNDS, DEPTH, DEEP, DEPTH0 (0: skip the depth-0 section), DEEP_KVS (tessera's caches at
# depth 16384, default "affine:4 turbo:4").
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_BIN=${LLAMA_BIN:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
M=$HOME/.cache/tessera/models
MODELS=${MODELS:-"$M/gemma-3-270m-q4_k_m.gguf $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
ROUNDS=${ROUNDS:-2}
DEPTH=${DEPTH:-0}
DEEP=${DEEP:-0}
DEPTH0=${DEPTH0:-1}
DEEP_KVS=${DEEP_KVS:-affine:4 turbo:4}
LLAMA_BIN_AVX2=${LLAMA_BIN_AVX2:-}
# llama-bench and tessera bench at depth 0 on model $2, labelled $3; $1 is llama.cpp's bin,
# the rest tessera's extra flags.
side_by_side() {
  local bin=$1 model=$2 label=$3; shift 3
  "$bin/llama-bench" -m "$model" -t 2 -p 512 -n 64 -r 3 2>/dev/null |
    grep -E "pp512|tg64" | awk -F'|' -v l="$label" '{print l " llama.cpp " $7 " " $8}'
  "$TESSERA" bench "$@" --model "$model" --prompt-tokens 512 --gen-tokens 64 --repeat 3 2>&1 |
    grep -E "^(prefill|decode)" | sed "s/^/$label tessera /"
}
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) | $(date -u +'%F %H:%M UTC') | commit $(git rev-parse --short HEAD)"
for round in $(seq "$ROUNDS"); do
  for model in $MODELS; do
    name=$(basename "$model" .gguf)
    if [ "$DEPTH0" = 1 ]; then
      side_by_side "$LLAMA_BIN" "$model" "round $round $name"
    fi
    if [ -n "$LLAMA_BIN_AVX2" ]; then
      side_by_side "$LLAMA_BIN_AVX2" "$model" "round $round $name avx2" --isa avx2
    fi
    if [ "$DEPTH" = 1 ]; then
      "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -p 0 -n 32 -d 4096 -r 1 2>/dev/null |
        grep -E "tg32" | awk -F'|' -v r="$round" -v m="$name" '{print "round " r " " m " llama.cpp " $7 " " $8}'
      "$TESSERA" bench --model "$model" --prompt-tokens 512 --gen-tokens 32 --depth 4096 --repeat 1 2>&1 |
        grep -E "^decode" | sed "s/^/round $round $name tessera /"
    fi
    if [ "$DEEP" = 1 ]; then
      "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -fa 1 -ctk q4_0 -ctv q4_0 -p 0 -n 32 -d 16384 -r 1 2>/dev/null |
        grep -E "tg32" | awk -F'|' -v r="$round" -v m="$name" '{print "round " r " " m " llama.cpp q4_0 " $(NF-2) " " $(NF-1)}'
      for kv in $DEEP_KVS; do
        "$TESSERA" bench --kv "$kv" --model "$model" --prompt-tokens 16 --gen-tokens 32 --depth 16384 --repeat 1 2>&1 |
          grep -E "^decode" | sed "s/^/round $round $name tessera $kv /"
      done
    fi
  done
done
