"""Triton kernels of the dense path, one family per module; import the module you need.

- prefill_attention.py: `flash_attn_varlen_func` (flash-attn's name and semantics), paged K/V over a
  query-tile table; prefill_plan.py: its host-side plan (the tile, the table and `query_tile_rows`, its
  tile height, the programs that walk it).
- decode_attention.py: `flash_attn_with_kvcache`, one query per sequence over the paged cache, split-K;
  decode_plan.py: its host-side plan (key tile, split count, where the splits merge); decode_fp8.py:
  its inner loop over an FP8 cache (int32 words in fp16 planes).
- online_softmax.py: the running max / sum step both attention kernels take per key tile.
- fused_rope.py: per-head q/k RMSNorm + RoPE + the K/V cache write in one launch.
- fp8_kv.py: the FP8 KV cache's quantizing step, shared by the cache writers, and its word-wise read.
- fused_norm.py, fused_activation.py: add + RMSNorm (for an FP8 layer quantizing its output), SiLU-and-mul.
- fp8_quant.py: activations quantized for torch._scaled_mm (RowQuant says how, per layer).
- gemv.py, skinny_gemm.py: projections of 1-2 rows, of narrow layers at 3-16 rows and of FP8 layers
  at 3-192 rows; gemv_plan.py, skinny_plan.py: their tilings.
- paging.py: where a key tile lives in the paged cache (fetched a tile ahead by both attention kernels).
- pdl.py, counters.py, checks.py: programmatic dependent launch, per-device scratch, argument checks.
- torch_attention.py: the plain-PyTorch attention contract (the CPU path; no Triton).

The MoE kernels live in nanovllm/moe/, the sampling kernels in nanovllm/sampling/. Modules that
define Triton kernels import Triton; the layers import them only on the CUDA path they choose
at construction (layers/kernel_path.py), so the CPU path runs without Triton.
"""
