#!/usr/bin/env bash
# Speculative decoding side by side (BENCHMARKS.md "Speculative decoding"): prompt-lookup
# (n-gram) drafting in tessera against llama.cpp's llama-lookup, and plain decode of both,
# on Qwen2.5-Coder-1.5B-Instruct, greedy, 160 tokens out, up to 8 drafted per round.
#   editing: the model rewrites a file of this repository with one identifier renamed
#   free:    free generation (an explanation), where little of the output repeats the prompt
# Both engines read the same ChatML text (special tokens parsed from it).
# Env: TESSERA, LLAMA_BIN (llama.cpp's build/bin), MODEL, FILE (the file to rewrite),
# N (tokens out), K (most drafted).
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_BIN=${LLAMA_BIN:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
MODEL=${MODEL:-$HOME/.cache/tessera/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
FILE=${FILE:-crates/tessera-kv/src/retention.rs}
N=${N:-160}
K=${K:-8}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
chatml() { printf '<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$1"; }
chatml "Rewrite this Rust file with the identifier \`slots\` renamed to \`ring_slots\` everywhere. Output the whole file and nothing else.
\`\`\`rust
$(sed -n 1,90p "$FILE")
\`\`\`" > "$tmp/editing.txt"
chatml "Explain in a few paragraphs how a key-value cache speeds up transformer decoding, and what quantizing it trades away." > "$tmp/free.txt"

echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') nproc=$(nproc) model=$(basename "$MODEL") N=$N K=$K"
for task in editing free; do
  p="$tmp/$task.txt"
  plain=$("$TESSERA" generate --model "$MODEL" --prompt-file "$p" --temperature 0 --max-tokens "$N" 2>&1 >/dev/null | tail -1)
  spec=$("$TESSERA" generate --model "$MODEL" --prompt-file "$p" --temperature 0 --max-tokens "$N" --spec ngram --draft-tokens "$K" 2>&1 >/dev/null | tail -1)
  echo "$task tessera plain: $plain"
  echo "$task tessera ngram: $spec"
  prompt_tokens=$(echo "$plain" | sed -n 's/.*prompt \([0-9]*\) tokens.*/\1/p')
  "$LLAMA_BIN/llama-bench" -m "$MODEL" -t 2 -p 0 -n "$N" -d "$prompt_tokens" -r 1 -o md 2>/dev/null | grep -E "tg$N" | sed "s/^/$task llama plain (llama-bench -d $prompt_tokens): /"
  "$LLAMA_BIN/llama-lookup" -m "$MODEL" -t 2 -f "$p" -n "$N" --temp 0 --spec-draft-n-max "$K" > "$tmp/lookup.out" 2> "$tmp/lookup.err" || true
  echo "$task llama-lookup: $(grep -E "n_draft|n_predict|n_drafted|n_accept|accept|decoded" "$tmp/lookup.err" | tr '\n' ' ')"
done
