#!/usr/bin/env bash
# GuideLLM (a load generator nobody on the team wrote) against tessera serve and llama-server
# on the same GGUF, one server at a time: /v1/completions, synthetic prompts of PROMPT_TOKENS
# tokens, OUTPUT_TOKENS out (GuideLLM sends ignore_eos, which both servers honour), at each
# concurrency of CONCS for REQUESTS_PER_STREAM × streams requests. GuideLLM counts tokens
# with the GGUF's own tokenizer, written out once by transformers (needs `gguf`).
# Usage: GUIDELLM_VENV=/tmp/gllm bash bench/guidellm.sh   (venv: pip install guidellm gguf)
# Env: TESSERA, LLAMA_SERVER, MODEL, CONCS ("16 64"), PROMPT_TOKENS (400), OUTPUT_TOKENS (64),
# REQUESTS_PER_STREAM (2), OUT (a folder for GuideLLM's JSON, default /tmp/guidellm-out).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GUIDELLM_VENV:?a venv with guidellm and gguf installed}
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_SERVER=${LLAMA_SERVER:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server}
MODEL=${MODEL:-$HOME/.cache/tessera/models/gemma-3-270m-q4_k_m.gguf}
OUT=${OUT:-/tmp/guidellm-out}
PORT=${PORT:-18090}
mkdir -p "$OUT"
TOK="$OUT/tokenizer-$(basename "$MODEL" .gguf)"
[ -d "$TOK" ] || "$VENV/bin/python" -c 'import sys, os
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(os.path.dirname(sys.argv[1]), gguf_file=os.path.basename(sys.argv[1])).save_pretrained(sys.argv[2])' "$MODEL" "$TOK"
. bench/servers.sh
run() {  # label, streams
  "$VENV/bin/guidellm" run --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/completions" \
    --profile "kind=concurrent,streams=$2" \
    --constraint "kind=max_requests,count=$(( $2 * ${REQUESTS_PER_STREAM:-2} ))" \
    --tokenizer "kind=huggingface_auto,model=$TOK" \
    --data "kind=synthetic_text,prompt_tokens=${PROMPT_TOKENS:-400},output_tokens=${OUTPUT_TOKENS:-64}" \
    --disable-progress --output "kind=json,path=$OUT/$1-$2.json" 2>&1 \
    | sed -n '/Request Latency Statistics/,$p' | grep -E '^\|' | sed "s/^/$1 /"
}
echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') nproc=$(nproc) $(basename "$MODEL")"
for c in ${CONCS:-16 64}; do
  "$LLAMA_SERVER" -m "$MODEL" -t 2 -np "$c" -cb -c $(( c * 1024 )) --port "$PORT" >/dev/null 2>&1 & pid=$!
  up; run llama-server "$c"; stop
  "$TESSERA" serve --model "$MODEL" --port "$PORT" --max-batch "$c" --max-queue 256 2>/dev/null & pid=$!
  up; run tessera "$c"; stop
done
