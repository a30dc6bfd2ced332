"""Triton kernels for nanovllm: attention with flash-attn's names and semantics, and the rest.

- `flash_attn_varlen_func`: prefill over packed or paged (block_table) K/V (prefill_attention.py),
  optionally over a host-built query-tile table (CUDA-graph capturable launch).
- `query_tile_rows` / `build_query_tiles`: that table's tile height and its host construction.
- `flash_attn_with_kvcache`: single-token decode over the paged KV cache, split-K (decode_attention.py).
- `store_kvcache`: scatter new K/V rows into the paged cache, slots < 0 skipped (kv_store.py).
- `gumbel_sample`: one sampled token per row with counter-based noise (gumbel_max.py).
- `row_logprobs`: logprobs of given tokens and each row's top k in one pass (logprobs.py).
- `top_k_top_p_threshold`: each row's top-k/top-p probability threshold by radix select (sampling_filter.py).
- `walk_sample`: Gumbel-max sampling under top-p / min-p by walking candidates, no threshold (candidate_walk.py).
- `fused_moe`: the mixture-of-experts MLP (top-k routed SiLU experts) as two grouped GEMMs (moe.py).
- `moe_align`: its grouping of (token, slot) pairs by expert into blocks, CUDA-graph capturable (moe_sort.py).
- `moe_gemv`: the same MLP for decode steps of 1-2 tokens in two GEMV-style launches (moe_decode.py);
  `moe_gemv_routed`: the same with the routing folded into the first launch.
- `moe_route`: the router's softmax, top k and renormalisation in one launch (moe_routing.py).

Triton is imported on the first call, so `import nanovllm.kernels` works on machines
without Triton (the CPU path uses kernels/torch_attention.py); a call there raises ImportError.
"""

__all__ = ["build_query_tiles", "flash_attn_varlen_func", "flash_attn_with_kvcache", "fused_moe", "gumbel_sample",
           "moe_align", "moe_gemv", "moe_gemv_routed", "moe_route", "query_tile_rows", "row_logprobs", "store_kvcache",
           "top_k_top_p_threshold", "walk_sample"]


def _triton_missing(exc: ImportError) -> ImportError:
    return ImportError(f"nanovllm.kernels needs Triton (pip install 'triton>=3.1'); import failed: {exc}")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, block_table=None, *,
                           tile_seq=None, tile_block=None, num_tiles=None, out=None):
    """Variable-length attention, optionally into a preallocated `out`; see
    prefill_attention.flash_attn_varlen_func."""
    try:
        from .prefill_attention import flash_attn_varlen_func as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale=softmax_scale, causal=causal, block_table=block_table,
                tile_seq=tile_seq, tile_block=tile_block, num_tiles=num_tiles, out=out)


def query_tile_rows(head_dim, dtype):
    """Query rows per prefill program (BLOCK_M); see prefill_attention.query_tile_rows."""
    try:
        from .prefill_attention import query_tile_rows as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(head_dim, dtype)


def build_query_tiles(q_lens, block_m, k_lens=None):
    """Host query-tile table (tile_seq, tile_block), heaviest first; see query_tiles.build_query_tiles."""
    from .query_tiles import build_query_tiles as impl  # numpy only: no Triton needed

    return impl(q_lens, block_m, k_lens)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False,
                            num_splits=0, *, num_seqs=None, out=None):
    """Decode attention over the paged cache, optionally only the first num_seqs[0] rows and
    into a caller's `out`; see decode_attention.flash_attn_with_kvcache."""
    try:
        from .decode_attention import flash_attn_with_kvcache as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=softmax_scale, causal=causal,
                num_splits=num_splits, num_seqs=num_seqs, out=out)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
    """Write K/V rows into the paged cache; see kv_store.store_kvcache."""
    try:
        from .kv_store import store_kvcache as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(key, value, k_cache, v_cache, slot_mapping)


def gumbel_sample(x, keys, temperatures=None, is_probs=False):
    """Gumbel-max sampling of one token per row; see gumbel_max.gumbel_sample."""
    try:
        from .gumbel_max import gumbel_sample as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(x, keys, temperatures, is_probs)


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, *, tiles=None):
    """Mixture-of-experts MLP of hidden [T, H] over top-k routing; see moe.fused_moe."""
    try:
        from .moe import fused_moe as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(hidden, w13, w2, topk_weights, topk_ids, tiles=tiles)


def moe_align(topk_ids, num_experts, block_m):
    """(token, slot) pairs of topk_ids [T, K] grouped by expert into blocks; see moe_sort.moe_align."""
    try:
        from .moe_sort import moe_align as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(topk_ids, num_experts, block_m)


def row_logprobs(logits, token_ids, k, rows=None, *, workspace=None):
    """log_softmax at token_ids and each row's k most likely tokens, with scratch reused from
    `workspace` (a logprobs.LogprobsWorkspace, None: fresh); see logprobs.row_logprobs."""
    try:
        from .logprobs import row_logprobs as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(logits, token_ids, k, rows, workspace=workspace)


def top_k_top_p_threshold(probs, top_ks, top_ps):
    """Per-row top-k/top-p probability thresholds [B, 1]; see sampling_filter.top_k_top_p_threshold."""
    try:
        from .sampling_filter import top_k_top_p_threshold as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(probs, top_ks, top_ps)


def moe_route(logits, top_k, renormalize):
    """MoE routing (softmax, top k, renormalisation) in one launch; see moe_routing.moe_route."""
    try:
        from .moe_routing import moe_route as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(logits, top_k, renormalize)


def moe_gemv(hidden, w13, w2, topk_weights, topk_ids):
    """MoE experts of a 1-2 token decode step in two launches; see moe_decode.moe_gemv."""
    try:
        from .moe_decode import moe_gemv as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(hidden, w13, w2, topk_weights, topk_ids)


def moe_gemv_routed(hidden, w13, w2, router_logits, top_k, renormalize):
    """moe_route + moe_gemv in moe_gemv's two launches -> (out, weights, ids); see
    moe_decode.moe_gemv_routed."""
    try:
        from .moe_decode import moe_gemv_routed as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(hidden, w13, w2, router_logits, top_k, renormalize)


def walk_sample(logits, keys, temperatures, top_ps, min_ps):
    """One token per row under top-p / min-p; see candidate_walk.walk_sample."""
    try:
        from .candidate_walk import walk_sample as impl
    except ImportError as exc:
        raise _triton_missing(exc) from exc
    return impl(logits, keys, temperatures, top_ps, min_ps)
