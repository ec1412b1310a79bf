#!/usr/bin/env bash
# CPU speed side by side (BENCHMARKS.md "CPU speed"): llama-bench and tessera bench on the
# same GGUF files, ROUNDS rounds, this CPU's two cores.
#   prefill 512, decode of 64 at depth 0: llama-bench -p 512 -n 64 -r 3 against
#     tessera bench --prompt-tokens 512 --gen-tokens 64 --repeat 3 (bf16 cache, f16 for llama.cpp)
#   decode of 32 at depth 4096 (DEPTH=1): llama-bench -p 0 -n 32 -d 4096 -r 1 against
#     tessera bench --prompt-tokens 512 --gen-tokens 32 --depth 4096 --repeat 1
# Env: TESSERA, LLAMA_BIN (llama.cpp's build/bin), MODELS (GGUF paths), ROUNDS, DEPTH,
# ISA (tessera --isa; llama.cpp is whatever LLAMA_BIN was built for).
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_BIN=${LLAMA_BIN:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
M=$HOME/.cache/tessera/models
MODELS=${MODELS:-"$M/gemma-3-270m-q4_k_m.gguf $M/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"}
ROUNDS=${ROUNDS:-2}
DEPTH=${DEPTH:-0}
ISA=${ISA:-}
isa=(); [ -n "$ISA" ] && isa=(--isa "$ISA")
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs) | $(date -u +'%F %H:%M UTC') | commit $(git rev-parse --short HEAD)"
for round in $(seq "$ROUNDS"); do
  for model in $MODELS; do
    name=$(basename "$model" .gguf)
    "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -p 512 -n 64 -r 3 2>/dev/null |
      grep -E "pp512|tg64" | awk -F'|' -v r="$round" -v m="$name" '{print "round " r " " m " llama.cpp " $7 " " $8}'
    "$TESSERA" bench "${isa[@]}" --model "$model" --prompt-tokens 512 --gen-tokens 64 --repeat 3 2>&1 |
      grep -E "^(prefill|decode)" | sed "s/^/round $round $name tessera /"
    if [ "$DEPTH" = 1 ]; then
      "$LLAMA_BIN/llama-bench" -m "$model" -t 2 -p 0 -n 32 -d 4096 -r 1 2>/dev/null |
        grep -E "tg32" | awk -F'|' -v r="$round" -v m="$name" '{print "round " r " " m " llama.cpp " $7 " " $8}'
      "$TESSERA" bench "${isa[@]}" --model "$model" --prompt-tokens 512 --gen-tokens 32 --depth 4096 --repeat 1 2>&1 |
        grep -E "^decode" | sed "s/^/round $round $name tessera /"
    fi
  done
done
