#!/usr/bin/env bash
# Speculative decoding side by side (BENCHMARKS.md "Speculative decoding"): prompt-lookup
# (n-gram) drafting and draft-model drafting in tessera against llama.cpp's llama-lookup and
# llama-speculative, and plain decode of both, on Qwen2.5-Coder-1.5B-Instruct with the 0.5B
# as drafter, greedy, 160 tokens out, up to 8 drafted per round.
#   editing: the model rewrites a file of this repository with one identifier renamed
#   free:    free generation (an explanation), where little of the output repeats the prompt
# Both engines read the same ChatML text (special tokens parsed from it).
# Env: TESSERA, LLAMA_BIN (llama.cpp's build/bin), MODEL, DRAFT (the draft model), FILE (the
# file to rewrite), N (tokens out), K (most drafted), CTX (llama.cpp's context for lookup and
# speculative; enough for the prompt, N and a round).
# Prints one labelled line per engine and method per task, then a summary: tok/s, speedup over
# the same engine's plain decode, acceptance, and whether tessera's speculative output equals
# its plain output (it must under greedy, short of logit near-ties).
set -euo pipefail
cd "$(dirname "$0")/.."
TESSERA=${TESSERA:-target/release/tessera}
LLAMA_BIN=${LLAMA_BIN:-/root/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
MODEL=${MODEL:-$HOME/.cache/tessera/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
DRAFT=${DRAFT:-$HOME/.cache/tessera/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
FILE=${FILE:-crates/tessera-kv/src/retention.rs}
N=${N:-160}
K=${K:-8}
CTX=${CTX:-4096}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
chatml() { printf '<|im_start|>system\nYou are a helpful coding assistant.<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$1"; }
chatml "Rewrite this Rust file with the identifier \`slots\` renamed to \`ring_slots\` everywhere. Output the whole file and nothing else.
\`\`\`rust
$(sed -n 1,90p "$FILE")
\`\`\`" > "$tmp/editing.txt"
chatml "Explain in a few paragraphs how a key-value cache speeds up transformer decoding, and what quantizing it trades away." > "$tmp/free.txt"

# tessera generate on prompt $1, text to $2; prints the last stderr line (its summary, or the
# error). Never fails the script.
tess() {
  local p=$1 out=$2 rc=0; shift 2
  "$TESSERA" generate --model "$MODEL" --prompt-file "$p" --temperature 0 --max-tokens "$N" "$@" \
    2>"$out.err" >"$out" || rc=$?
  if [ "$rc" -ne 0 ]; then echo "(exit $rc) $(why "$out.err")"; else tail -1 "$out.err"; fi
}
# Why a run failed: the first error line of its stderr $1, else its last non-blank line.
why() {
  local e; e=$(grep -m1 -iE '(^|[^a-z_])(error|failed|illegal instruction)' "$1" || true)
  echo "${e:-$(grep -v '^ *$' "$1" | tail -1 || true)}"
}
# A llama.cpp example's stats (stdout and stderr of run $1), on one line.
llstats() {
  # (log lines may carry a "0.56.087.863 I " time and level prefix)
  cat "$1.out" "$1.err" 2>/dev/null | sed -E 's/^[0-9.]+ [A-Z] //' \
    | grep -E "^ *(decoded|n_draft|n_predict|n_drafted|n_accept|accept) " | tr -s ' ' | tr '\n' ' ' | sed 's/ *$//' || true
}
# The first number matched by sed -E pattern $2 (group 1) in text $1, or nothing.
num() { printf '%s\n' "$1" | sed -nE "s/$2/\1/p" | head -1; }

# Summary fields (one word each; "n/a" when a number is missing).
na() { local v; v=$(cat); echo "${v:-n/a}"; }
t_rate() { num "$1" '.*generated [0-9]+ tokens, ([0-9.]+) tok\/s.*' | na; }
t_acc() { num "$1" '.* accepted \(([0-9.]+)%\).*' | na; }
l_rate() { num "$1" '.*decoded [0-9]+ tokens in [0-9.]+ seconds, speed: ([0-9.]+) t\/s.*' | na; }
l_acc() { num "$1" '.*accept = ([0-9.]+)%.*' | na; }
# Whether tessera's output for task $1, method $2 equals its plain output.
same() {
  local a="$tmp/$1.plain" b="$tmp/$1.$2"
  if [ ! -s "$a" ] || [ ! -s "$b" ]; then echo n/a
  elif cmp -s "$a" "$b"; then echo yes
  else echo "no_(first_difference_at_byte_$(cmp "$a" "$b" 2>/dev/null | sed -nE 's/.*byte ([0-9]+).*/\1/p'))"
  fi
}

echo "# $(date -u +%FT%TZ) $(lscpu | sed -n 's/^Model name: *//p') nproc=$(nproc) model=$(basename "$MODEL") draft=$(basename "$DRAFT") N=$N K=$K"
summary=()
for task in editing free; do
  p="$tmp/$task.txt"
  plain=$(tess "$p" "$tmp/$task.plain")
  ngram=$(tess "$p" "$tmp/$task.ngram" --spec ngram --draft-tokens "$K")
  draft=$(tess "$p" "$tmp/$task.draft" --draft-model "$DRAFT" --draft-tokens "$K")
  echo "$task tessera plain: $plain"
  echo "$task tessera ngram: $ngram"
  echo "$task tessera draft: $draft"

  prompt_tokens=$(num "$plain" '.*prompt ([0-9]+) tokens.*')
  bench=""
  if [ -n "$prompt_tokens" ]; then
    bench=$("$LLAMA_BIN/llama-bench" -m "$MODEL" -t 2 -p 0 -n "$N" -d "$prompt_tokens" -r 1 -o md 2>/dev/null \
      | grep -E "tg$N" | tr -s ' ' || true)
  fi
  echo "$task llama plain (llama-bench -d ${prompt_tokens:-?}): ${bench:-n/a (no prompt token count from tessera, or llama-bench failed)}"
  "$LLAMA_BIN/llama-lookup" -m "$MODEL" -t 2 -c "$CTX" -f "$p" -n "$N" --temp 0 --spec-draft-n-max "$K" \
    > "$tmp/lookup.out" 2> "$tmp/lookup.err" && rc=0 || rc=$?
  lookup=$(llstats "$tmp/lookup")
  echo "$task llama-lookup: ${lookup:-n/a (exit $rc) $(why "$tmp/lookup.err")}"
  "$LLAMA_BIN/llama-speculative" -m "$MODEL" -md "$DRAFT" -t 2 -td 2 -c "$CTX" -f "$p" -n "$N" --temp 0 \
    --spec-draft-n-max "$K" > "$tmp/spec.out" 2> "$tmp/spec.err" && rc=0 || rc=$?
  specl=$(llstats "$tmp/spec")
  echo "$task llama-speculative: ${specl:-n/a (exit $rc) $(why "$tmp/spec.err")}"

  # llama-bench's md row: the last column is "rate ± spread".
  b_rate=$(printf '%s\n' "$bench" | awk -F'|' 'NF > 2 { split($(NF-1), a, " "); print a[1]; exit }' | na)
  summary+=("$task tessera plain $(t_rate "$plain") - -")
  summary+=("$task tessera ngram $(t_rate "$ngram") $(t_acc "$ngram") $(same "$task" ngram)")
  summary+=("$task tessera draft $(t_rate "$draft") $(t_acc "$draft") $(same "$task" draft)")
  summary+=("$task llama plain $b_rate - -")
  summary+=("$task llama lookup $(l_rate "$lookup") $(l_acc "$lookup") -")
  summary+=("$task llama speculative $(l_rate "$specl") $(l_acc "$specl") -")
done

echo "# summary: tok/s, speedup over the same engine's plain decode on the same task, % of drafts accepted, output = tessera plain"
printf '%s\n' "${summary[@]}" | awk '
  function ok(x) { return x ~ /^[0-9]+(\.[0-9]+)?$/ }
  {
    task = $1; eng = $2; meth = $3; rate = $4; acc = $5; same = $6
    if (meth == "plain") base[task, eng] = ok(rate) ? rate : ""
    b = base[task, eng]
    speed = (ok(rate) && ok(b) && b > 0) ? sprintf("%.2fx", rate / b) : "n/a"
    line = sprintf("%s %s %s: %s, %s", task, eng, meth, ok(rate) ? rate " tok/s" : "n/a tok/s", speed)
    if (acc != "-") line = line ", accepted " (ok(acc) ? acc "%" : "n/a")
    if (same != "-") { gsub(/_/, " ", same); line = line ", output = plain: " same }
    print line
  }'
