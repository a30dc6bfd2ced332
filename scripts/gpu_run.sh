#!/usr/bin/env bash
# One device call: bench.py runs, kernel micro-benchmarks, GPU tests. Run from the repository root:
#   bash scripts/gpu_run.sh [parts...]        (default: bench latency kernels sampler); logs go to $OUT (or ./gpu-logs)
#   BEFORE_DIR=DIR bash scripts/gpu_run.sh compare1, then compare2 in a second call: DIR's tree against this one
#   (compare: both sets in one call, as many runs as fit in 520 s; comparescore: the 0.6B scoring workload, two pairs)
# `gputests` (359 s on 2026-12-02) and `readme` (<= 590 s) each want a call of their own.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
parts=${*:-"bench latency kernels sampler"}
CONFIGS=benchmarks/configs
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/env.log"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.log"

# bench NAME TIMEOUT ARGS...: bench.py with its report in $OUT/NAME.log and its JSON in $OUT/NAME.json
bench() { local name=$1 limit=$2; shift 2
  timeout "$limit" python3 bench.py "$@" --json "$OUT/$name.json" 2>&1 | grep -v "it/s" | tail -40 | tee "$OUT/$name.log"; }

for part in $parts; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case $part in
    gputests) timeout 580 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gputests.log" ;;
    readme) # -v with a wall-clock stamp on every line: per-test times survive a kill at the call's limit (scripts/test_times.py)
      s=$(date +%s); timeout 590 python3 -m pytest -n auto --dist loadgroup -v -rfE -p no:cacheprovider --durations=60 2>&1 \
        | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N | cut -c1-14)" "$line"; done \
        | tee "$OUT/readme-full.log" | tail -75 | tee "$OUT/readme.log"
      echo "README test command: $(( $(date +%s) - s )) s" | tee -a "$OUT/readme.log" ;;
    bench) for w in default long; do bench "bench-$w" 200 --model $CONFIGS/qwen3-0.6b --workload $w; done ;;
    bench8b) bench bench8b 240 --model $CONFIGS/qwen3-8b ;;
    score) for m in qwen3-0.6b qwen3-8b; do bench "score-$m" 240 --model $CONFIGS/$m --workload score; done ;;
    benchhf) bench benchhf 400 --model $CONFIGS/qwen3-0.6b --compare-hf ;;
    small) # Qwen2.5-0.5B's geometry (2 kv heads of 64, 896 wide): the engine's two presets, the decode split study at
           # its heads, cuBLAS at its layers (BENCHMARKS.md, fifty-third session)
      for w in default rollout; do bench "small-$w" 150 --model $CONFIGS/qwen2.5-0.5b --workload $w; done
      timeout 200 python3 -m benchmarks.kernels.bench_kernels --splits --heads 14,2,64 --json "$OUT/small-splits.json" 2>&1 \
        | tail -20 | tee "$OUT/small-splits.log"
      timeout 150 python3 -m benchmarks.kernels.bench_gemm --batch-rows 64,128,256,512 \
        --shapes "0.5B qkv,0.5B o,0.5B gate_up,0.5B down" --json "$OUT/small-gemm.json" 2>&1 | tail -20 | tee "$OUT/small-gemm.log" ;;
    narrow) # head_dim 64 over an FP8 cache, two kv heads a decode program (decode_plan.heads_per_program; BENCHMARKS.md,
            # fifty-fourth session): its GPU tests, Qwen2.5-0.5B and Llama-3.2-1B with each cache, the kernel at 1 / 2 / 4 heads
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv_gpu.py tests/test_decode_groups.py \
        -k "decode or narrow or groups" 2>&1 | tail -8 | tee "$OUT/narrow-tests.log"
      for m in qwen2.5-0.5b llama-3.2-1b; do for kv in fp8 auto; do
        bench "narrow-$m-$kv" 90 --model $CONFIGS/$m --kv-cache-dtype $kv; done; done
      # rows sharing a prompt (decode groups, whose kernel now loops over a group a tile at a time)
      bench narrow-rollout-qwen3-0.6b 120 --model $CONFIGS/qwen3-0.6b --workload rollout
      for h in 14,2,64 32,8,64; do timeout 60 python3 -m benchmarks.kernels.bench_kernels --pack --heads $h 2>&1 \
        | tail -8 | tee "$OUT/narrow-pack-$h.log"; done ;;
    moebench) bench moebench 300 --model $CONFIGS/qwen3-30b-a3b ;;
    moepair) # #32's 30B-A3B pair in one call: FP8 weights + FP8 KV, then bf16 (the ratio is taken within the call).
      # An H200's memory only (run's needs_h200): on 80 GB the bf16 weights leave 561 KV blocks and the bf16 run
      # preempts (2.05x, sixty-third session), against 2,889 blocks on the H200 where #32's 1.5x is set
      bench moepair-fp8 200 --model $CONFIGS/qwen3-30b-a3b --quantization fp8 --kv-cache-dtype fp8
      bench moepair-bf16 200 --model $CONFIGS/qwen3-30b-a3b ;;
    latency) for m in qwen3-0.6b qwen3-8b qwen3-30b-a3b; do
               bench "latency-$m" 200 --model $CONFIGS/$m --latency --latency-batch-sizes 1,2,8,32; done ;;
    compare|compare1|compare2|comparescore) # the same bench.py runs in $BEFORE_DIR's tree and this one (benchmarks/engine/compare.py)
      if [ -z "${BEFORE_DIR:-}" ]; then echo "$part: set BEFORE_DIR to the source tree to compare against"; continue; fi
      which=${part#compare}
      python3 -m benchmarks.engine.compare --before "$BEFORE_DIR" --set "${which:-all}" --out "$OUT" 2>&1 | tee "$OUT/$part.log" ;;
    kernels) timeout 200 python3 -m benchmarks.kernels.bench_kernels --json "$OUT/kernels.json" 2>&1 | tail -20 | tee "$OUT/kernels.log" ;;
    sampler) timeout 120 python3 -m benchmarks.kernels.bench_sampler --json "$OUT/sampler.json" 2>&1 | tail -20 | tee "$OUT/sampler.log" ;;
    gemm) timeout 200 python3 -m benchmarks.kernels.bench_gemm --json "$OUT/gemm.json" 2>&1 | tail -50 | tee "$OUT/gemm.log" ;;
    fused) timeout 120 python3 -m benchmarks.kernels.bench_fused --json "$OUT/fused.json" 2>&1 | tail -20 | tee "$OUT/fused.log" ;;
    moekernel) timeout 200 python3 -m benchmarks.kernels.bench_moe --json "$OUT/moe.json" 2>&1 | tail -30 | tee "$OUT/moekernel.log" ;;
    kvspread) timeout 300 python3 -m benchmarks.kernels.bench_kv_spread 2>&1 | tee "$OUT/kvspread.log" ;;
    sleepbench) for m in "qwen3-0.6b 200" "qwen3-8b 300"; do set -- $m
                  timeout "$2" python3 -m benchmarks.engine.bench_sleep --model $CONFIGS/$1 2>&1 | grep -v "it/s" | tail -12 \
                    | tee "$OUT/sleep-$1.log"; done ;;
    benchn) timeout 300 python3 -m benchmarks.engine.bench_n 2>&1 | grep -v "it/s" | tail -6 | tee "$OUT/benchn.log" ;;
    rayreplica) # needs ray: python3 scripts/ray_wheels.py here, then carry .whl (the script's docstring)
      RAY_USAGE_STATS_ENABLED=0 timeout 400 python3 -m benchmarks.engine.bench_ray 2>&1 | grep -v "it/s\|INFO" | tail -12 | tee "$OUT/rayreplica.log" ;;
    structured) # a Qwen-sized tokenizer trained offline (kept in /tmp for later calls), then the JSON-schema workload
      [ -f /tmp/tok151k/tokenizer.json ] || timeout 300 python3 scripts/grammar_libraries.py --build-tokenizer /tmp/tok151k
      timeout 280 python3 -m benchmarks.engine.bench_structured --tokenizer /tmp/tok151k 2>&1 | grep -v "it/s" | tail -8 \
        | tee "$OUT/structured.log" ;;
    profile) timeout 200 python3 -m benchmarks.engine.profile_step 2>&1 | grep -v "it/s" | tee "$OUT/profile.log" | tail -80 ;;
    *) echo "unknown part $part" ;;
  esac
done
