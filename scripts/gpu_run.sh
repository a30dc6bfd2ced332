#!/usr/bin/env bash
# One device call: GPU tests, the CPU-suite engine tests on CUDA, kernel/sampler benchmarks, bench.py.
# Usage (on the H200, repo root): bash scripts/gpu_run.sh [parts...]; logs go to $OUT (or ./gpu-logs).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
# `readme` wants a call of its own (<= 590 s; scripts/test_times.py sums its per-test times).
# `gputests` (the whole -m gpu suite) wants a call of its own too (359 s on 2026-12-02, seventh session).
# `l2probe` / `preloadprobe`: can the idle HBM while attention runs pull the next projection's weight
# closer (L2: never; registers before the PDL wait: 2.4-3.9 us saved after an 11 us gap, but no gain
# in the engine: BENCHMARKS.md, sixth and seventh sessions).
parts=${*:-"enginetests kernels sampler bench latency"}  # gputests: a call of its own (above)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/env.log"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.log"
for part in $parts; do
  echo "=== $part ($(date -u +%H:%M:%S))"
  case $part in
    gputests) timeout 580 python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gputests.log" ;;
    leakpair) timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_engine.py -k "max_model_len or step_wise" 2>&1 | tail -15 | tee "$OUT/leakpair.log" ;;
    overlap) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_overlap.py 2>&1 | tail -15 | tee "$OUT/overlap.log" ;;
    profile1) for m in qwen3-0.6b qwen3-8b; do timeout 120 python3 benchmarks/profile_step.py --model benchmarks/configs/$m --batch 1 --context 1024 --rows 14 2>&1 | grep -v "it/s" | tee -a "$OUT/profile1.log" | tail -40; done ;;
    enginetests) timeout 180 python3 -m pytest -q -x -p no:cacheprovider tests/test_engine.py tests/test_sampling_engine.py 2>&1 | tail -30 | tee "$OUT/enginetests.log" ;;
    fused) timeout 120 python3 benchmarks/bench_fused.py --json "$OUT/fused.json" 2>&1 | tail -20 | tee "$OUT/fused.log" ;;
    decodesweep) timeout 300 python3 benchmarks/bench_kernels.py --sweep-decode-engine --json "$OUT/decodesweep.json" 2>&1 | tail -14 | tee "$OUT/decodesweep.log" ;;
    kernels) timeout 120 python3 benchmarks/bench_kernels.py --json "$OUT/kernels.json" 2>&1 | tail -20 | tee "$OUT/kernels.log" ;;
    sampler) timeout 120 python3 benchmarks/bench_sampler.py --json "$OUT/sampler.json" 2>&1 | tail -16 | tee "$OUT/sampler.log" ;;
    bench) timeout 150 python3 bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --json "$OUT/bench.json" 2>&1 | grep -v "it/s" | tail -40 | tee "$OUT/bench.log" ;;
    trimcheck) # mixed steps trimmed to graph buckets: steps and roofline fraction on the default, many and long workloads
      for w in default many long; do timeout 100 python3 bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --workload $w 2>&1 | grep -E "^(workload|output tokens|steps|their|HBM|roofline|fraction)" | tee -a "$OUT/trimcheck.log"; done ;;
    benchlong) for w in long many; do timeout 200 python3 bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --workload $w --json "$OUT/bench-$w.json" 2>&1 | grep -v "it/s" | tail -24 | tee "$OUT/bench-$w.log"; done ;;
    decodetest) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py > "$OUT/decodetest.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/decodetest.log" | head -20 ;;
    profilemixed) timeout 200 python3 benchmarks/profile_step.py --batch 400 --context 1200 --mixed-prompt 2000 --timed-steps 20 --rows 22 2>&1 | grep -v "it/s" | tee "$OUT/profilemixed.log" | grep -E "=====|mean of|kernels per" ;;
    bench8b) timeout 200 python3 bench.py --model benchmarks/configs/qwen3-8b --load-format dummy --json "$OUT/bench8b.json" 2>&1 | grep -v "it/s" | tail -40 | tee "$OUT/bench8b.log" ;;
    moelat) timeout 150 python3 bench.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --latency --latency-batch-sizes 1,2 2>&1 | grep -v "it/s" | tail -5 | tee -a "$OUT/moelat.log" ;;
    tilegpu) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv_gpu.py tests/test_kernels_gpu.py tests/test_moe_decode.py > "$OUT/tilegpu.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tilegpu.log" | head -20 ;;
    benchfilters) for f in "--top-p 0.9" "--top-k 20 --top-p 0.95"; do timeout 150 python3 bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy $f 2>&1 | grep -v "it/s" | grep -E "workload|tok/s|decode step|fraction" | tee -a "$OUT/benchfilters.log"; done ;;
    benchhf) timeout 400 python3 bench.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --compare-hf --json "$OUT/benchhf.json" 2>&1 | grep -v "it/s" | tail -20 | tee "$OUT/benchhf.log" ;;
    profile) timeout 200 python3 benchmarks/profile_step.py 2>&1 | grep -v "it/s" | tee "$OUT/profile.log" | tail -80 ;;
    latency) for m in qwen3-0.6b qwen3-8b; do timeout 100 python3 bench.py --model benchmarks/configs/$m --load-format dummy --latency --json "$OUT/latency-$m.json" 2>&1 | grep -v "it/s" | tail -6 | tee -a "$OUT/latency.log"; done ;;
    newtests) timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_routing.py tests/test_moe_decode.py tests/test_logprobs_kernel.py tests/test_moe_gpu.py tests/test_logprobs_gpu.py tests/test_sampler_gpu.py 2>&1 | tail -40 | tee "$OUT/newtests.log" ;;
    verify) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_logprobs_kernel.py tests/test_sampler_gpu.py tests/test_fused_moe.py tests/test_moe_gpu.py tests/test_logprobs_gpu.py > "$OUT/verify.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$OUT/verify.log" | head -30 ;;
    decodegpu) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_gpu.py tests/test_moe_decode.py tests/test_moe_routing.py tests/test_moe_gpu.py > "$OUT/decodegpu.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/decodegpu.log" | head -20 ;;
    moedecode) timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_decode.py tests/test_moe_gpu.py 2>&1 | tail -20 | tee "$OUT/moedecode.log" ;;
    moekernel) timeout 200 python3 benchmarks/bench_moe.py --json "$OUT/moe.json" 2>&1 | tail -30 | tee "$OUT/moekernel.log" ;;
    moebench) timeout 300 python3 bench.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --json "$OUT/moe-bench.json" 2>&1 | grep -v "it/s" | tail -20 | tee "$OUT/moebench.log"
              timeout 150 python3 bench.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --latency --latency-batch-sizes 1,8,32 2>&1 | grep -v "it/s" | tail -5 | tee -a "$OUT/moebench.log" ;;
    readme) # -v with a wall-clock stamp on every line: per-test times survive a kill at the call's limit
            s=$(date +%s); timeout 590 python3 -m pytest -n auto --dist loadgroup -v -rfE -p no:cacheprovider --durations=60 2>&1 \
              | while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N | cut -c1-14)" "$line"; done \
              | tee "$OUT/readme-full.log" | tail -75 | tee "$OUT/readme.log"
            echo "README test command: $(( $(date +%s) - s )) s" | tee -a "$OUT/readme.log" ;;
    samplercmp) for b in 1 16 256; do for t in "" --torch-thresholds; do timeout 90 python3 benchmarks/bench_sampler.py --batch $b $t --cases top_k_only top_p_only top_k_top_p mixed_topk_topp --iters 30 2>&1 | tail -5 | tee -a "$OUT/samplercmp.log"; done; done ;;
    filtergpu) timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sampling_filter.py tests/test_sampler_gpu.py > "$OUT/filtergpu.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/filtergpu.log" | head -20 ;;
    gemmsweep) timeout 300 python3 benchmarks/bench_gemm.py --sweep --json "$OUT/gemm-sweep.json" 2>&1 | tail -40 | tee "$OUT/gemmsweep.log" ;;
    moesweep) timeout 200 python3 benchmarks/bench_moe.py --sweep-gemv --json "$OUT/gemv-sweep.json" 2>&1 | tail -70 | tee "$OUT/moesweep.log" ;;
    moefsweep) timeout 400 python3 benchmarks/bench_moe.py --sweep --tokens 64 128 256 512 --json "$OUT/fused-sweep.json" 2>&1 | grep -v skipped | tail -20 | tee "$OUT/moefsweep.log" ;;
    profilemoe) timeout 150 python3 benchmarks/profile_step.py --model benchmarks/configs/qwen3-30b-a3b --batch 1 --context 1024 --rows 30 2>&1 | grep -v "it/s" | tee "$OUT/profilemoe.log" | tail -60 ;;
    diag) timeout 200 python3 scripts/diag_graph_eager.py 2>&1 | grep -v "it/s" | tail -40 | tee "$OUT/diag.log" ;;
    ttftprobe) for m in qwen3-8b qwen3-0.6b; do timeout 150 python3 benchmarks/prefill_probe.py --model benchmarks/configs/$m --sizes 128,1000 2>&1 | grep -v "it/s" | tee -a "$OUT/ttftprobe.log" | tail -26; done ;;
    gemmrows) timeout 200 python3 benchmarks/bench_gemm.py --batch-rows 64,128,256 2>&1 | tee "$OUT/gemmrows.log" ;;
    decodestep) timeout 400 python3 benchmarks/bench_kv_spread.py --sweep 2>&1 | tee "$OUT/decodestep.log" ;;
    hostprobe) for b in 1 8; do timeout 60 python3 benchmarks/host_probe.py --batch $b --steps 200 2>&1 | grep -v "it/s" | head -45 | tee -a "$OUT/hostprobe.log"; done ;;
    walk) # the candidate walk (top-p, min-p): GPU tests, then the sampler alone (walk vs thresholds, peaked / flat rows)
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_walk_sample.py tests/test_sampler_gpu.py tests/test_sampling_filter.py > "$OUT/walk.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/walk.log" | head -20
      for b in 1 16 256; do for s in 3 0.3; do for w in "" --no-walk; do timeout 60 python3 benchmarks/bench_sampler.py --batch $b --logit-scale $s $w --cases plain top_p_only min_p_only --iters 30 2>&1 | tail -4 | sed "s/^/b$b s$s $w: /" | tee -a "$OUT/walksampler.log"; done; done; done ;;
    skinny06) timeout 560 python3 benchmarks/bench_gemm.py --batch-rows 16,64,128,256 --sweep-skinny --shapes "0.6B qkv,0.6B o,0.6B gate_up,0.6B down" --top 6 --json "$OUT/skinny06.json" 2>&1 | tail -30 | tee "$OUT/skinny06.log" ;;
    skinny8b) timeout 400 python3 benchmarks/bench_gemm.py --batch-rows 128 --sweep-skinny --shapes "8B qkv,8B o,8B gate_up,8B down" --top 6 --json "$OUT/skinny8b.json" 2>&1 | tail -12 | tee "$OUT/skinny8b.log" ;;
    gemv30b) timeout 300 python3 benchmarks/bench_gemm.py --sweep --shapes "30B qkv,30B o,30B router" --json "$OUT/gemv30b.json" 2>&1 | tail -14 | tee "$OUT/gemv30b.log" ;;
    skinnyrule) timeout 300 python3 benchmarks/bench_gemm.py --batch-rows 4,8,16,32,64 --json "$OUT/skinnyrule.json" 2>&1 | tail -60 | tee "$OUT/skinnyrule.log" ;;
    abskinny) # the skinny GEMM in narrow layers at 3-16 rows (default) vs cuBLAS, then its GPU tests
      for m in qwen3-0.6b qwen3-30b-a3b; do timeout 300 python3 benchmarks/variants.py --variant skinny --variant "cublas:nanovllm.layers.linear.SKINNY_MAX_ROWS=0" --show "decode ms/token" -- --model benchmarks/configs/$m --load-format dummy --latency --latency-batch-sizes 4,8,16 2>&1 | tee -a "$OUT/abskinny.log"; done
      timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_skinny_gemm.py tests/test_engine_gpu.py -k "skinny or Skinny or identical or greedy" > "$OUT/skinnygpu.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/skinnygpu.log" | head -20 ;;
    normab) # RMSNorm inside the GEMV (default) vs its own kernel: kernel tests, 0.6B A/B, engine tests, 30B A/B
      timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gemv_gpu.py -k rms_norm 2>&1 | tail -2 | tee "$OUT/normtests.log"
      timeout 100 python3 benchmarks/variants.py --variant norm --variant "nonorm:nanovllm.layers.linear.NORM_IN_GEMV=False" --show "decode ms/token" -- --model benchmarks/configs/qwen3-0.6b --load-format dummy --latency --latency-batch-sizes 1,2 2>&1 | tee -a "$OUT/normab.log"
      timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_engine_gpu.py -k "identical or small_batch" 2>&1 | tail -3 | tee -a "$OUT/normtests.log"
      timeout 120 python3 benchmarks/variants.py --variant norm --variant "nonorm:nanovllm.layers.linear.NORM_IN_GEMV=False" --show "decode ms/token" -- --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --latency --latency-batch-sizes 1 2>&1 | tee -a "$OUT/normab.log" ;;
    l2probe) (cd benchmarks && timeout 240 python3 l2_probe.py 2>&1 | tee "$OUT/l2probe.log" | tail -40) ;;
    preloadprobe) (cd benchmarks && timeout 150 python3 preload_probe.py 2>&1 | tee "$OUT/preloadprobe.log" | tail -60) ;;
    benchn) timeout 300 python3 benchmarks/bench_n.py 2>&1 | grep -v "it/s" | tail -6 | tee "$OUT/benchn.log" ;;
  esac
done
