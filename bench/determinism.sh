#!/usr/bin/env bash
# The batch-invariant numerics against the binary before them (BENCHMARKS.md "Deterministic
# inference"): the same cells with each binary in turn, ROUNDS rounds, this CPU's two cores.
#   prefill 512 and decode of 64 at depth 0 (tessera bench --repeat 3), per KV scheme (KVS)
#   decode of 32 at depth 4096 (tessera bench --depth 4096), per KV scheme
#   tessera serve at 16 concurrent (bench/load.py: 16 streamed completions of ~300 words,
#     64 tokens each), bf16
# Env: OLD, NEW (tessera binaries), MODEL, KVS, ROUNDS, SERVE (0: skip the server cell).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${OLD:?the binary before}
NEW=${NEW:-target/release/tessera}
MODEL=${MODEL:-$HOME/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf}
KVS=${KVS:-bf16 affine:4 turbo:4}
ROUNDS=${ROUNDS:-2}
SERVE=${SERVE:-1}
PORT=${PORT:-18081}
CORPUS=${CORPUS:-../shared/corpus/pride-and-prejudice.txt}
. bench/servers.sh
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') $(grep -o -m1 -E 'avx512f|avx2' /proc/cpuinfo | head -1) nproc=$(nproc) model $(basename "$MODEL")"
for round in $(seq "$ROUNDS"); do
  for which in old new; do
    if [ "$which" = old ]; then bin=$OLD; else bin=$NEW; fi
    label="round $round $which"
    for kv in $KVS; do
      "$bin" bench --model "$MODEL" --kv "$kv" --prompt-tokens 512 --gen-tokens 64 --repeat 3 2>&1 |
        grep -E "^(prefill|decode)" | sed "s|^|$label $kv d0 |"
      "$bin" bench --model "$MODEL" --kv "$kv" --prompt-tokens 512 --gen-tokens 32 --depth 4096 --repeat 1 2>&1 |
        grep -E "^decode" | sed "s|^|$label $kv d4096 |"
    done
    if [ "$SERVE" = 1 ]; then
      "$bin" serve --model "$MODEL" --port "$PORT" --max-batch 16 --max-queue 256 2>/dev/null & pid=$!
      up
      python3 bench/load.py --base-url "http://127.0.0.1:$PORT/v1" --corpus "$CORPUS" \
        --concurrency 16 --requests 32 --prompt-words 300 --max-tokens 64 --label "$label serve16"
      stop
    fi
  done
done
