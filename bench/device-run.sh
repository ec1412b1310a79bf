#!/usr/bin/env bash
# Runs on the device machine (see ../shared/gpu/README.md): unpacks the gzipped (or xz) binaries
# carried in .device/, then the steps named as arguments, each logged under $OUT.
#   parity  kv-cache-parity (the CUDA KV backend against the CPU cache)
#   chunkread  kv-read-bench chunk: the fused chunk read alone against an f64 reference, timed
#   plantfail  kv-cache-parity --plant-failure: one output perturbed, so the run must fail here
#   readparity  kv-read-bench parity: every decode-read kernel against an f64 reference
#   eval    perplexity of a synthetic gemma3-270m, --device cpu vs cuda, bf16/affine:4/affine:8
#   e2e     tessera bench --device cuda, synthetic gemma3-270m, depth 32k, batch 1 and 16
#   e2eglobal  synthetic gemma3-270m, batch 16, depth 32k, affine:4 on the global layers only
#   profile the same with --kv-profile (synchronized cache write / read times)
#   profile8b  the synthetic Llama-3-8B, batch 1, depth 32k, with --kv-profile
#   e2e12b  the same for a synthetic gemma3-12b, batch 1
#   e2e8b   synthetic Llama-3-8B (every layer global): batch 1 and 16 at 32k, batch 1 at 128k
#           (E2E8B_RUNS: "BATCH:DEPTH ..." instead; E2E8B_GEN tokens, 32; E2E8B_PROMPT / E2E8B_REPEAT:
#           the timed prefill's tokens, 2048, and runs, 1; E2E8B_BINS: the
#           carried tessera binaries to run in turn, "tessera"; E2E8B_KVS, "bf16 affine:4";
#           E2E8B_FLAGS: more bench flags, e.g. --no-step-graphs)
#   verifyceiling  synthetic Llama-3-8B, batch 1, depth 32k: a speculative verification round
#           of K drafts against a one-token step, K = 1..16 (VERIFY_KS), bf16 and affine:4
#           (bench --verify-rounds; VERIFY_REPEAT timed rounds and steps per K, 8)
#   serve8b tessera serve --device cuda, synthetic Llama-3-8B, bench/load.py at 1, 16, 64
#           concurrent (openai wheels carried in .device/wheels), then bench --batch 1/16/64
#           (SERVE8B_CONC: the concurrencies; SERVE8B_LOAD: load.py's prompt/output flags;
#           SERVE8B_GEN: bench's --gen-tokens; SERVE8B_FLAGS: more serve flags; SERVE8B_BENCH=0
#           skips the bench runs)
#   budget8b  tessera serve --device cuda, synthetic Llama-3-8B, one --kv-budget (BUDGET8B_MIB,
#           2048) for each scheme (BUDGET8B_KVS), 16 concurrent requests of ~4k-token prompts
#           (BUDGET8B_LOAD: load.py's request flags): rows admitted and per-request speed
#   ncustep  the GPU-only time of a decode step (GPU-step issue): tessera bench on the synthetic
#           Llama-3-8B for NCU_KVS, then the same run under Nsight Compute (clocks and caches
#           left alone), every kernel's duration in $OUT/ncu-*.csv (bench/ncu_steps.py sums
#           them per step, NCU_SUMMARY its flags); NCU_DEPTH context first, NCU_BATCH rows,
#           NCU_PROMPT / NCU_REPEAT the timed prefill's tokens and runs, NCU_SKIP launches
#           unprofiled
#   weights weights-bench: tessera's Q4_0 matvec / bf16-GEMM path against an f64 reference
#           and candle's, then every matmul of one 8B forward timed, ours and candle's
#   greedy8b  each of GREEDY_BINS' greedy text (md5, bf16 and affine:4) and tessera eval on the
#           synthetic 8B
#   graphprobe  a batch-1 decode step of the synthetic 8B captured as a CUDA graph and replayed,
#           against eager steps, and recaptured + cuGraphExecUpdate each step (bench --graph-probe;
#           PROBE_KVS, PROBE_DEPTHS, PROBE_STEPS)
#   graphrows  step graphs for every row count (--step-graph-rows 16) on batch 16: a tiny
#           synthetic Llama with and without graphs, then under compute-sanitizer memcheck, then
#           the synthetic 8B (GRAPHROWS_8B=0 skips it; GRAPHROWS_KV, affine:4)
#   graphcheck  batch-16 decode on the tiny synthetic Llama, a synthetic Qwen 3 0.6B (and the 8B
#           unless GRAPHCHECK_8B=0)
#           eager, then with step graphs up to 1, 4 and 16 rows: bench's tokens digest must
#           match across them (GRAPHCHECK_KVS, "affine:4 bf16"); then compute-sanitizer memcheck
#           of batch 1 (graphs at 1 row), batch 4 and batch 16 (graphs up to 16 rows), the
#           first errors of each (tiny Llama and Qwen 3)
#   llamabuild  llama.cpp's CUDA build (carried source), in the background; llamawait waits
#           for it (LLAMA_WAIT seconds at most); llamabench runs llama-bench on the synthetic 8B
#           (LLAMA_KVS caches, LLAMA_DEPTHS, LLAMA_REPS)
#   wparity weights-bench's parity checks alone
#   wvariants  weights-bench variants: weights.cu's build choices (and the host's input split)
#           checked against the f64 reference and timed per kind of matrix (WVARIANTS: more
#           --variant=NAME=V,… flags)
#   wprofile  weights-bench profile under Nsight Compute (--set full): the tensor-core
#           launches of an output and a down matrix at 1 and 8 rows, in $OUT/weights-profile.txt
#   e2eweights  the synthetic Llama-3-8B with tessera's weight kernels and with candle's
#           (--candle-weights), in turn: tessera bench for each E2EW_RUNS "BATCH:DEPTH"
#           (default "1:0 1:32768 16:32768"), --kv E2EW_KV (affine:4)
#   promptcache  tessera cache save --device cuda, generate --prompt-cache on cuda (== cold)
#           and cpu, bench --prompt-cache on the synthetic 270M and 8B
#   stage   appends the carried .device/stage/sN pieces to $STAGED (each piece once)
#   real    tessera bench on the staged real Gemma 3 270M file ($STAGED)
#   realeval  eval (decode regime) of the staged file, --device cpu vs cuda
#   reads   kv-read-bench parity and time (our decode read; READS_FILTER: +TEXT filters) and
#           torch SDPA
#   firstrun  a fresh process's one-time GPU work (tiny synthetic Llama, generate): the driver's
#           JIT cache empty, filled and off (CUDA_CACHE_PATH / CUDA_CACHE_DISABLE); bench's
#           steady step beside it, NVRTC's time per source (FIRSTRUN_PROMPT_FILE or
#           FIRSTRUN_PROMPT: the prompt; FIRSTRUN_BINS, FIRSTRUN_ROUNDS: binaries alternated)
#   determinism  tessera-kernels' determinism_cuda test (carried as .device/determinism_cuda.*):
#           deterministic mode's logits bit-identical however run, on synthetic models
#   detcost  deterministic mode's cost: tessera bench with and without --deterministic, in
#           turn, on the synthetic Llama-3-8B (Q4_0, tessera's weight kernels) and Gemma 3 270M
#           (Q8_0, candle's matmuls), DETCOST_RUNS "MODEL:BATCH:DEPTH" (8b / 270m), bf16 and
#           affine:4 (DETCOST_KVS), DETCOST_GEN tokens (64), DETCOST_PROMPT prefill tokens (512)
#   variants  decode-read kernel variants at 32k tokens, then the folded ones again under each
#           VARIANT_DEFINES entry (NAME:VALUE, a #define)
# Any failing command fails the run (set -e, and pipefail through the `| tee` logs): a parity
# miss (kv-cache-parity, kv-read-bench parity / chunk exit 1 on any) stops it with a nonzero
# status and names the step.
set -eEuo pipefail
step=setup
trap 'echo "device-run.sh: step \"$step\" failed (line $LINENO, status $?)" >&2' ERR
NV=$(python3 -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13","lib"))')
export LD_LIBRARY_PATH=$NV:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
B=/tmp/tessera-bin; mkdir -p $B
# Always unpacked: a warm machine may still hold an older build under the same name.
for f in .device/*.gz; do [ -f "$f" ] || continue; n=$(basename $f .gz); gunzip -c $f > $B/$n && chmod +x $B/$n; done
# xz packs a binary in half gzip's bytes (the carry is 64 MiB); Python's lzma unpacks it.
for f in .device/*.xz; do
  [ -f "$f" ] || continue; n=$(basename $f .xz)
  python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' $f $B/$n
  chmod +x $B/$n
done
T=$B/${TESSERA_BIN:-tessera} # the carried CLI binary the steps run (TESSERA_BIN: another)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
STAGED=${STAGED:-/tmp/stage/gemma-3-270m-q4_k_m.gguf}
log() { echo "== $*"; }
synth() { [ -f /tmp/$1.gguf ] || $T model synth --arch gemma3 --preset $1 --dtype ${2:-q4_0} --out /tmp/$1.gguf; }
for step in "$@"; do
  case $step in
    parity) log parity; $B/kv-cache-parity 2>&1 | tee $OUT/parity.txt ;;
    chunkread) log chunkread; $B/kv-read-bench chunk 2>&1 | tee $OUT/chunk-read.txt ;;
    plantfail) log plantfail; $B/kv-cache-parity --plant-failure 2>&1 | tee $OUT/plant-failure.txt ;;
    readparity) log readparity; $B/kv-read-bench parity 2>&1 | tee $OUT/read-parity.txt ;;
    eval)
      log eval; synth gemma3-270m
      for dev in cpu cuda; do
        $T eval --model /tmp/gemma3-270m.gguf --device $dev --text .device/text.txt \
          --kv bf16,affine:8,affine:4 --prefill 256 --tokens 128 2>&1 | tee $OUT/eval-$dev.txt
      done ;;
    e2e)
      log e2e; synth gemma3-270m
      for batch in 1 16; do for kv in bf16 affine:4; do
        $T bench --model /tmp/gemma3-270m.gguf --device cuda --kv $kv --depth 32768 \
          --gen-tokens 64 --prompt-tokens 2048 --repeat 2 --batch $batch 2>&1 | tee -a $OUT/e2e-270m.txt
      done; done ;;
    e2eglobal)
      log e2eglobal; synth gemma3-270m
      for kv in bf16 affine:4:global affine:4; do
        $T bench --model /tmp/gemma3-270m.gguf --device cuda --kv $kv --depth 32768 \
          --gen-tokens 128 --prompt-tokens 512 --repeat 1 --batch 16 2>&1 | tee -a $OUT/e2e-global.txt
      done ;;
    profile)
      log profile; synth gemma3-270m
      for kv in bf16 affine:4:global; do
        $T bench --kv-profile --model /tmp/gemma3-270m.gguf --device cuda --kv $kv --depth 32768 \
          --gen-tokens 256 --prompt-tokens 512 --repeat 1 --batch 16 2>&1 | tee -a $OUT/profile.txt
      done ;;
    profile8b)
      log profile8b; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for kv in bf16 affine:4; do
        $T bench --kv-profile --model /tmp/llama3-8b.gguf --device cuda --kv $kv --depth 32768 \
          --gen-tokens 160 --prompt-tokens 512 --repeat 1 --batch 1 2>&1 | tee -a $OUT/profile-8b.txt
      done ;;
    e2e12b)
      log e2e12b; synth gemma3-12b
      for kv in bf16 affine:4; do
        $T bench --model /tmp/gemma3-12b.gguf --device cuda --kv $kv --depth 32768 \
          --gen-tokens 32 --prompt-tokens 2048 --repeat 1 --batch 1 2>&1 | tee -a $OUT/e2e-12b.txt
      done ;;
    e2e8b)
      log e2e8b; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for run in ${E2E8B_RUNS:-1:32768 16:32768 1:130000}; do set -- ${run/:/ }
        for bin in ${E2E8B_BINS:-tessera}; do for kv in ${E2E8B_KVS:-bf16 affine:4}; do
          echo "-- $bin" | tee -a $OUT/e2e-8b.txt
          $B/$bin bench --model /tmp/llama3-8b.gguf --device cuda --kv $kv --depth $2 ${E2E8B_FLAGS:-} \
            --gen-tokens ${E2E8B_GEN:-32} --prompt-tokens ${E2E8B_PROMPT:-2048} --repeat ${E2E8B_REPEAT:-1} --batch $1 2>&1 | tee -a $OUT/e2e-8b.txt
        done; done
      done ;;
    determinism)
      log determinism
      $B/determinism_cuda --ignored --nocapture --test-threads=1 2>&1 | tee $OUT/determinism-cuda.txt ;;
    detcost)
      log detcost
      for run in ${DETCOST_RUNS:-8b:1:0 8b:16:0 8b:1:4096 8b:16:4096 270m:1:0 270m:16:0}; do
        IFS=: read -r m batch depth <<< "$run"
        case $m in
          8b) model=/tmp/llama3-8b.gguf; [ -f $model ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out $model ;;
          270m) model=/tmp/gemma3-270m-q8_0.gguf; [ -f $model ] || $T model synth --arch gemma3 --preset gemma3-270m --dtype q8_0 --out $model ;;
        esac
        for kv in ${DETCOST_KVS:-bf16 affine:4}; do for flags in "" --deterministic; do
          echo "-- $m batch $batch depth $depth $kv ${flags:-default}" | tee -a $OUT/detcost.txt
          $T bench --model $model --device cuda --kv $kv --depth $depth $flags --gen-tokens ${DETCOST_GEN:-64} \
            --prompt-tokens ${DETCOST_PROMPT:-512} --repeat 1 --batch $batch > /tmp/detcost.log 2>&1 \
            || echo "FAILED: $(tail -3 /tmp/detcost.log)" | tee -a $OUT/detcost.txt
          grep -E '^(model|prefill|decode)' /tmp/detcost.log | tee -a $OUT/detcost.txt || true
        done; done
      done ;;
    graphprobe)
      # One batch-1 decode step of the synthetic 8B captured as a CUDA graph and replayed,
      # against the eager steps (tessera bench --graph-probe), per PROBE_KVS and PROBE_DEPTHS.
      log graphprobe; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for d in ${PROBE_DEPTHS:-0 32768}; do for kv in ${PROBE_KVS:-affine:4}; do
        $T bench --model /tmp/llama3-8b.gguf --device cuda --kv $kv --depth $d --gen-tokens ${PROBE_STEPS:-64} \
          --graph-probe 2>&1 | tee -a $OUT/graph-probe.txt
      done; done ;;
    graphrows)
      log graphrows; m=/tmp/llama-tiny-256.gguf; kv=${GRAPHROWS_KV:-affine:4}
      [ -f $m ] || $T model synth --arch llama --preset tiny-256 --dtype q4_0 --out $m
      tiny="bench --model $m --device cuda --kv $kv --batch 16 --depth 0 --prompt-tokens 64 --gen-tokens 8"
      for g in 1 16; do echo "-- tiny, --step-graph-rows $g"; $T $tiny --step-graph-rows $g 2>&1 | tee -a $OUT/graph-rows.txt || true; done
      CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
      echo "-- memcheck ($CS), tiny, --step-graph-rows 16" | tee -a $OUT/graph-rows.txt
      [ -n "$CS" ] && timeout 240 $CS --tool memcheck --print-limit 12 $T $tiny --step-graph-rows 16 2>&1 | tail -80 | tee -a $OUT/graph-rows.txt || true
      if [ "${GRAPHROWS_8B:-1}" = 1 ]; then
        [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
        for g in 16 1; do echo "-- 8b, --step-graph-rows $g" | tee -a $OUT/graph-rows.txt
          $T bench --model /tmp/llama3-8b.gguf --device cuda --kv $kv --batch 16 --depth 0 --prompt-tokens 512 --gen-tokens 32 --step-graph-rows $g 2>&1 | tail -3 | tee -a $OUT/graph-rows.txt || true
        done
      fi ;;
    graphcheck)
      # Llama's q and k leave a graph as views of one q|k, Qwen 3's (QK-norm) as their own.
      log graphcheck; m=/tmp/llama-tiny-256.gguf; q3=/tmp/qwen3-0.6b.gguf
      [ -f $m ] || $T model synth --arch llama --preset tiny-256 --dtype q4_0 --out $m
      [ -f $q3 ] || $T model synth --arch qwen3 --preset qwen3-0.6b --dtype q4_0 --out $q3
      models="$m $q3"
      if [ "${GRAPHCHECK_8B:-1}" = 1 ]; then
        [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
        models="$models /tmp/llama3-8b.gguf"
      fi
      for model in $models; do for kv in ${GRAPHCHECK_KVS:-affine:4 bf16}; do for g in none 1 4 16; do
        if [ $g = none ]; then flags=--no-step-graphs; else flags="--step-graph-rows $g"; fi
        r=$($T bench --model $model --device cuda --kv $kv --batch 16 --depth 0 --prompt-tokens 64 \
          --gen-tokens 32 --repeat 1 $flags 2>&1 | grep -E 'decode|error' || true)
        echo "-- $(basename $model) $kv $flags: $r" | tee -a $OUT/graph-check.txt
      done; done; done
      CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)
      for model in $m $q3; do for spec in "1 1" "4 16" "16 16"; do set -- $spec
        echo "-- memcheck, $(basename $model), batch $1, --step-graph-rows $2" | tee -a $OUT/graph-check.txt
        timeout 150 $CS --tool memcheck --print-limit 3 $T bench --model $model --device cuda --kv affine:4 \
          --batch $1 --depth 0 --prompt-tokens 64 --gen-tokens 8 --repeat 1 --step-graph-rows $2 > /tmp/mc.txt 2>&1 || true
        head -45 /tmp/mc.txt | tee -a $OUT/graph-check.txt; grep -E "ERROR SUMMARY|decode" /tmp/mc.txt | tee -a $OUT/graph-check.txt || true
      done; done ;;
    greedy8b)
      # Each carried binary's greedy text and eval figures on the synthetic 8B (GREEDY_BINS,
      # "tessera-old tessera"): a kernel change that keeps the arithmetic must match them all.
      log greedy8b; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      head -c 9000 .device/text.txt > /tmp/greedy-prompt.txt
      for bin in ${GREEDY_BINS:-tessera-old tessera}; do for kv in bf16 affine:4; do
        $B/$bin generate --model /tmp/llama3-8b.gguf --device cuda --kv $kv --temperature 0 --max-tokens 96 \
          --prompt-file /tmp/greedy-prompt.txt > $OUT/greedy-$bin-${kv/:/}.txt 2>/dev/null
        echo "$bin $kv: $(md5sum < $OUT/greedy-$bin-${kv/:/}.txt)" | tee -a $OUT/greedy8b.txt
      done
        $B/$bin eval --model /tmp/llama3-8b.gguf --device cuda --text .device/text.txt --kv bf16,affine:4 \
          --prefill 256 --tokens 64 2>&1 | tee -a $OUT/greedy8b.txt
      done ;;
    llamabuild)
      # llama.cpp's CUDA build from the carried source (.device/llamacpp-src.tgz: the
      # llama-cpp-python 0.3.36 sdist's vendor/llama.cpp without build/, models/, docs/,
      # examples/, tests/ and the other GPU backends), started in the background (setsid, so it
      # outlives this call on a warm machine) and niced; `llamawait` waits for it. The tools
      # land in /tmp/llama/llama.cpp/build/bin.
      log llamabuild; rm -rf /tmp/llama; mkdir -p /tmp/llama; tar xzf .device/llamacpp-src.tgz -C /tmp/llama
      export PATH=/usr/local/cuda/bin:$PATH
      command -v nvcc > /dev/null || { n=$(find /usr/local /opt /usr -name nvcc -type f 2>/dev/null | head -1)
        [ -n "$n" ] && export PATH=$(dirname $n):$PATH; }; echo "nvcc: $(command -v nvcc || echo none)"
      setsid nohup bash -c 'cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DCMAKE_BUILD_TYPE=Release > /tmp/llama/build.log 2>&1 && nice -n 10 cmake --build build -j ${LLAMA_JOBS:-14} \
        --target llama-bench llama-batched-bench >> /tmp/llama/build.log 2>&1; echo "status $?" > /tmp/llama/done' \
        > /dev/null 2>&1 < /dev/null & ;;
    llamawait)
      log llamawait; for i in $(seq 1 ${LLAMA_WAIT:-540}); do [ -f /tmp/llama/done ] && break; sleep 1; done
      cat /tmp/llama/done 2>/dev/null || echo "llama.cpp build still running"; tail -4 /tmp/llama/build.log ;;
    llamabench)
      # llama-bench on the synthetic 8B (the file tessera synthesizes): pp512 and tg64 at
      # depth 0 and 32768, f16 and q4_0 caches, flash attention (the issue's table).
      log llamabench; L=/tmp/llama/llama.cpp/build/bin
      [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for kv in ${LLAMA_KVS:-f16 q4_0}; do
        $L/llama-bench -m /tmp/llama3-8b.gguf -ngl 99 -fa 1 -ctk $kv -ctv $kv -p 512 -n 64 \
          -d ${LLAMA_DEPTHS:-0,32768} -r ${LLAMA_REPS:-2} 2>&1 | tee -a $OUT/llama-bench.txt
      done ;;
    weights) log weights; $B/weights-bench 2>&1 | tee $OUT/weights-bench.txt ;;
    wparity) log wparity; $B/weights-bench parity 2>&1 | tee $OUT/weights-parity.txt ;;
    wprofile)
      # Nsight Compute's full set on the model's launches for the output and a down matrix at
      # 1 and 8 rows (weights-bench profile).
      log wprofile; ncu --set full -k regex:q4_0_mma --clock-control none $B/weights-bench profile 2>&1 \
        | tee $OUT/weights-profile.txt | grep -E "q4_0_mma|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles|Issue|Duration|Block Limit|L1/TEX Hit|L2 Hit|Eligible|Executed Ipc" ;;
    wvariants) log wvariants; $B/weights-bench variants ${WVARIANTS:-} 2>&1 | tee $OUT/weights-variants.txt ;;
    e2eweights)
      log e2eweights; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for run in ${E2EW_RUNS:-1:0 1:32768 16:32768}; do set -- ${run/:/ }
        for flags in "" --candle-weights; do
          echo "-- ${flags:-tessera weights}: batch $1, depth $2" | tee -a $OUT/e2e-weights.txt
          $T bench --model /tmp/llama3-8b.gguf --device cuda --kv ${E2EW_KV:-affine:4} --depth $2 \
            --gen-tokens 32 --prompt-tokens 2048 --repeat 1 --batch $1 $flags 2>&1 | tee -a $OUT/e2e-weights.txt
        done
      done ;;
    verifyceiling)
      log verifyceiling; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for kv in bf16 affine:4; do
        $T bench --model /tmp/llama3-8b.gguf --device cuda --kv $kv --depth 32768 --batch 1 \
          --verify-rounds ${VERIFY_KS:-1,2,3,4,6,8,12,16} --repeat ${VERIFY_REPEAT:-8} 2>&1 | tee -a $OUT/verify-ceiling.txt
      done ;;
    serve8b)
      # tessera serve --device cuda on the synthetic Llama-3-8B under bench/load.py (the
      # openai client, carried as wheels in .device/wheels), then tessera bench --batch at
      # the same batch sizes: what the server's own bookkeeping costs.
      log serve8b; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      python3 -m pip install -q --no-index --find-links .device/wheels --target /tmp/pylib openai
      export PYTHONPATH=/tmp/pylib
      $T serve --model /tmp/llama3-8b.gguf --device cuda --port 18080 --max-batch 64 \
        --max-queue 256 ${SERVE8B_FLAGS:-} 2>>$OUT/serve8b-server.txt & SP=$!
      python3 -c 'import time,urllib.request as u
for _ in range(600):
    try: u.urlopen("http://127.0.0.1:18080/health", timeout=2); break
    except OSError: time.sleep(0.5)'
      for c in ${SERVE8B_CONC:-1 16 64}; do
        python3 bench/load.py --base-url http://127.0.0.1:18080/v1 --corpus .device/text.txt \
          --concurrency $c --requests $(( c < 4 ? 4 : c )) ${SERVE8B_LOAD:---prompt-words 200 --max-tokens 64} \
          --label "serve cuda ${SERVE8B_FLAGS:-}" --metrics-url http://127.0.0.1:18080/metrics 2>&1 | tee -a $OUT/serve8b.txt
      done
      kill $SP; wait $SP || true
      [ "${SERVE8B_BENCH:-1}" = 1 ] && for c in ${SERVE8B_CONC:-1 16 64}; do
        $T bench --model /tmp/llama3-8b.gguf --device cuda --batch $c --prompt-tokens 256 \
          --gen-tokens ${SERVE8B_GEN:-64} --repeat 1 2>&1 | tee -a $OUT/serve8b.txt
      done ;;
    budget8b)
      # The serve issue's budget figure where a decode step is memory-bound: how many rows a
      # 4-bit cache admits under the budget that admits a few bf16 rows, and how fast each
      # request streams.
      log budget8b; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      python3 -m pip install -q --no-index --find-links .device/wheels --target /tmp/pylib openai
      export PYTHONPATH=/tmp/pylib
      for kv in ${BUDGET8B_KVS:-bf16 affine:4 turbo:4}; do
        $T serve --model /tmp/llama3-8b.gguf --device cuda --port 18080 --kv $kv --max-batch 32 \
          --kv-budget ${BUDGET8B_MIB:-2048} --max-queue 256 2>>$OUT/budget8b-server.txt & SP=$!
        python3 -c 'import time,urllib.request as u
for _ in range(600):
    try: u.urlopen("http://127.0.0.1:18080/health", timeout=2); break
    except OSError: time.sleep(0.5)'
        # The synthetic model's vocabulary makes ~7.8 tokens of a word: 510 words ≈ 4k tokens.
        timeout 150 python3 bench/load.py --base-url http://127.0.0.1:18080/v1 --corpus .device/text.txt \
          --concurrency 16 ${BUDGET8B_LOAD:---requests 24 --prompt-words 510 --max-tokens 320} \
          --label "cuda $kv budget ${BUDGET8B_MIB:-2048} MiB" \
          --metrics-url http://127.0.0.1:18080/metrics 2>&1 | tee -a $OUT/budget8b.txt
        kill $SP; wait $SP || true
      done ;;
    ncustep)
      log ncustep; [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      for kv in ${NCU_KVS:-affine:4}; do
        b="bench --model /tmp/llama3-8b.gguf --device cuda --kv $kv --prompt-tokens ${NCU_PROMPT:-16} --repeat ${NCU_REPEAT:-1} --depth ${NCU_DEPTH:-0} --batch ${NCU_BATCH:-1}"
        $T $b --gen-tokens 32 2>&1 | tee -a $OUT/ncustep.txt
        # NCU_SKIP: launches left unprofiled first (a deep run's context fill, ~1100 a chunk).
        name=ncu-${kv/:/}-b${NCU_BATCH:-1}-d${NCU_DEPTH:-0}-p${NCU_PROMPT:-16}
        timeout ${NCU_TIMEOUT:-300} ncu --clock-control none --cache-control none \
          --launch-skip ${NCU_SKIP:-0} --launch-count ${NCU_COUNT:-12000} \
          --metrics gpu__time_duration.sum --csv --log-file $OUT/$name.csv \
          $T $b --gen-tokens ${NCU_GEN:-8} > $OUT/$name-bench.txt 2>&1 || echo "ncu: status $?"
        python3 bench/ncu_steps.py $OUT/$name.csv ${NCU_SUMMARY:-} 2>&1 | tee -a $OUT/ncustep.txt || true
      done ;;
    promptcache)
      # Prompt caches saved from the device (through the host) and loaded onto it: a prompt
      # extending the cached one gives the cold run's greedy text (the cold run reads the
      # cached part as one chunk, as the save did); a CUDA-made file also loads on the CPU;
      # then time to first token cached vs cold, on the synthetic 270M and 8B.
      log promptcache; synth gemma3-270m
      [ -f /tmp/llama3-8b.gguf ] || $T model synth --arch llama --preset llama3-8b --dtype q4_0 --out /tmp/llama3-8b.gguf
      head -c 2400 .device/text.txt > /tmp/doc.txt; { cat /tmp/doc.txt; echo " and then"; } > /tmp/doc-q.txt
      for kv in bf16 affine:4 turbo:4; do
        f=/tmp/pc-$kv.tpc
        $T cache save --model /tmp/gemma3-270m.gguf --device cuda --prompt-file /tmp/doc.txt --out $f --kv $kv --prefill-chunk 100000 2>&1 | tee -a $OUT/promptcache.txt
        n=$($T cache info $f --json | python3 -c 'import json,sys;print(json.load(sys.stdin)["rows"][0])')
        warm=$($T generate --model /tmp/gemma3-270m.gguf --device cuda --prompt-file /tmp/doc-q.txt --prompt-cache $f \
          --temperature 0 --max-tokens 24 --prefill-chunk $n 2>>$OUT/promptcache.txt)
        cold=$($T generate --model /tmp/gemma3-270m.gguf --device cuda --prompt-file /tmp/doc-q.txt --kv $kv \
          --temperature 0 --max-tokens 24 --prefill-chunk $n 2>>$OUT/promptcache.txt)
        cpu=$($T generate --model /tmp/gemma3-270m.gguf --device cpu --prompt-file /tmp/doc-q.txt --prompt-cache $f \
          --temperature 0 --max-tokens 4 2>>$OUT/promptcache.txt)
        echo "$kv: cuda warm == cold: $([ "$warm" == "$cold" ] && echo yes || echo NO) (cached $n tokens); loads on cpu: yes" | tee -a $OUT/promptcache.txt
        [ "$warm" == "$cold" ]
        $T bench --model /tmp/gemma3-270m.gguf --device cuda --prompt-cache $f --repeat 3 2>&1 | tee -a $OUT/promptcache.txt
      done
      head -c 17300 .device/text.txt > /tmp/doc4k.txt
      for kv in bf16 affine:4; do
        f=/tmp/pc8b-$kv.tpc
        $T cache save --model /tmp/llama3-8b.gguf --device cuda --prompt-file /tmp/doc4k.txt --out $f --kv $kv 2>&1 | tee -a $OUT/promptcache.txt
        $T bench --model /tmp/llama3-8b.gguf --device cuda --prompt-cache $f --repeat 3 2>&1 | tee -a $OUT/promptcache.txt
        rm -f $f
      done ;;
    stage)
      mkdir -p $(dirname $STAGED)
      for f in .device/stage/s*; do
        [ -f "$f" ] || { echo "stage: no .device/stage/s* pieces carried" >&2; exit 2; }
        [ -f $STAGED.$(basename $f) ] || { cat $f >> $STAGED && touch $STAGED.$(basename $f); }
      done; ls -la $STAGED ;;
    real)
      log real; sha256sum $STAGED
      for batch in 1 16; do for kv in bf16 affine:4; do
        $T bench --model $STAGED --device cuda --kv $kv --depth 32768 --gen-tokens 64 \
          --prompt-tokens 2048 --repeat 2 --batch $batch 2>&1 | tee -a $OUT/e2e-real.txt
      done; done ;;
    realeval)
      log realeval
      for dev in cpu cuda; do
        $T eval --model $STAGED --device $dev --text .device/text.txt \
          --kv bf16,affine:8,affine:4 --prefill 256 --tokens 256 2>&1 | tee $OUT/eval-real-$dev.txt
      done ;;
    reads) log reads; $B/kv-read-bench parity copy time ${READS_FILTER:-} 2>&1 | tee $OUT/reads.txt
           python3 bench/sdpa_decode.py 2>&1 | tee -a $OUT/reads.txt ;;
    variants)
      # The folded affine kernel against the older tensor-core one, and its compile-time
      # knobs, on the shapes the acceptance names (32k tokens).
      log variants
      $B/kv-read-bench copy time +affine +n32768 2>&1 | tee $OUT/variants.txt
      for defs in ${VARIANT_DEFINES:-}; do
        echo "-- --defines=#define ${defs//:/ }" | tee -a $OUT/variants.txt
        $B/kv-read-bench time +Folded +n32768 "--defines=#define ${defs//:/ }" 2>&1 | tee -a $OUT/variants.txt
      done ;;
    firstrun)
      # A fresh process's one-time GPU work: the driver's JIT of our PTX with its disk cache
      # empty, filled, and off, then NVRTC's time per source on this host's CPU, then
      # `tessera bench` for the steady step. The prompt: FIRSTRUN_PROMPT_FILE (a file), else
      # FIRSTRUN_PROMPT.
      log firstrun; m=/tmp/llama-tiny-256.gguf
      [ -f $m ] || $T model synth --arch llama --preset tiny-256 --dtype q4_0 --out $m > /dev/null
      if [ -n "${FIRSTRUN_PROMPT_FILE:-}" ]; then prompt=(--prompt-file "$FIRSTRUN_PROMPT_FILE")
      else prompt=(--prompt "${FIRSTRUN_PROMPT:-The first run of a process on a machine}"); fi
      # FIRSTRUN_BINS: the carried binaries to compare (each with a JIT cache of its own),
      # alternated over FIRSTRUN_ROUNDS rounds.
      for round in $(seq ${FIRSTRUN_ROUNDS:-1}); do
        for bin in ${FIRSTRUN_BINS:-tessera}; do
          jit=/tmp/firstrun-jit-$bin-$round; rm -rf $jit
          for cache in empty filled filled off; do
            gen() { $B/$bin generate --model $m --device cuda --kv affine:4 --temperature 0 --max-tokens 128 \
                "${prompt[@]}" 2>/tmp/firstrun.err >/tmp/firstrun.out
              echo "$(tail -2 /tmp/firstrun.err | tr '\n' ' ')text md5 $(md5sum < /tmp/firstrun.out | cut -c1-12)"; }
            if [ $cache = off ]; then r=$(CUDA_CACHE_DISABLE=1 gen); else r=$(CUDA_CACHE_PATH=$jit gen); fi
            echo "-- round $round $bin, JIT cache $cache: $r"
          done
          du -sh $jit
        done
      done 2>&1 | tee $OUT/firstrun.txt
      $B/kernels-compile --quick --times 2>&1 | grep -E "^(planes|weights|greedy|decode.cu (bf16|affine:4:64|turbo:4:4) |kernels)" \
        | tee -a $OUT/firstrun.txt
      for bin in ${FIRSTRUN_BINS:-tessera}; do
        $B/$bin bench --model $m --device cuda --kv affine:4 --prompt-tokens 512 --gen-tokens 128 --repeat 1 \
          2>&1 | grep -E '^(prefill|decode)' | sed "s/^/$bin: /"
      done | tee -a $OUT/firstrun.txt ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
