#!/usr/bin/env bash
export PYTHONPATH=. PYTHONUNBUFFERED=1 NANOVLLM_EXP_PDL_MAXGRID=600
run() { echo "== $1 pf=$2 qkv=$3 gu=$4"
  NANOVLLM_EXP_GEMV_PF=$2 NANOVLLM_EXP_T6144=$3 NANOVLLM_EXP_T24576=$4 timeout 100 python3 bench.py --model benchmarks/configs/$1 --load-format dummy --latency --latency-batch-sizes 1 2>&1 | grep -v "it/s" | tail -1; }
run qwen3-8b 1 "" ""
run qwen3-8b 2 "" ""
run qwen3-8b 1 "16,256,4" ""
run qwen3-8b 1 "16,256,4" "64,128,4"
run qwen3-8b 1 "" "64,128,4"
run qwen3-8b 1 "" ""
run qwen3-0.6b 1 "" ""
run qwen3-0.6b 2 "" ""
