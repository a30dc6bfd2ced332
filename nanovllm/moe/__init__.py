"""Mixture-of-experts (Qwen3-MoE): what a dense-model reader can skip.

- layer.py: `SparseMoeBlock` (replicated router + experts) and `MoeExperts` (stacked w13 / w2,
  tensor-parallel slices); the path is chosen at construction.
- checkpoint_names.py: expert tensors' checkpoint spellings -> the stacked parameters and shard ids.
- fp8_experts.py: FP8 experts' scale modes (per channel, per 128 x 128 block), checked per launch.
- routing.py: softmax, top k and renormalisation in one Triton launch.
- align.py: the counting sort of (token, expert) pairs into single-expert blocks.
- grouped_gemm.py: the fused MoE (grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM).
- tiles.py: the grouped GEMMs' tilings (decode, prefill, W8A8 prefill) and a call's plan by size class.
- decode.py: decode steps of 1-2 tokens as two GEMV-style launches that route too.
"""
