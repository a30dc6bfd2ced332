"""The start-up warm-up (CUDA): before the KV cache is sized, run the largest step the engine can
schedule and every sampler path at full batch, so that

- the device's peak memory is this process's largest (engine/kv_cache.py sizes the cache from it:
  the cache takes what is left), and
- the kernels of those paths compile here, not at the first request that takes them.

Invariants: it runs on a one-block KV cache (every block-table entry is block 0), which the real
cache replaces once sized; it sets no FP8 scales (no calibrating metadata) and draws no noise key
from the runner's RNG; it returns with the device idle.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nanovllm.config import Config
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.step_inputs import StepInputBuilder
from nanovllm.engine.step_plan import StepPlan
from nanovllm.sampling.batch import SamplingBatch
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.token_mask import TokenMask, mask_words
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.context import attention_context
from nanovllm.utils.host_to_device import to_device


@torch.inference_mode()
def warm_up(model: torch.nn.Module, sampler: Sampler, builder: StepInputBuilder, config: Config,
            device: torch.device) -> None:
    """One step at the largest token budget (and a sampler pass at each path), to measure peak
    memory; `model` has its one-block cache attached."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    seq_len = min(config.max_model_len, config.max_num_batched_tokens)
    num_seqs = max(1, min(config.max_num_batched_tokens // seq_len, config.max_num_seqs))
    plan = StepPlan(StepKind.PREFILL, starts=[0] * num_seqs, num_new_tokens=[seq_len] * num_seqs,
                    token_ids=[0] * (num_seqs * seq_len), block_tables=[[0] * config.max_blocks_per_seq] * num_seqs,
                    sampled=[True] * num_seqs)
    inputs = builder.varlen(plan, builder.varlen_copy(plan, builder.exact_layout(plan)), None)
    with attention_context(inputs.meta):
        every = model(inputs.input_ids, inputs.positions)  # [num_seqs * seq_len, hidden]
    hidden = every[inputs.sample_indices]  # [num_seqs, hidden]
    if inputs.meta.query_tiles is not None:
        _other_prefill_tile(model, builder, device, inputs.meta.query_tiles.long)
    rows = hidden[-1:].expand(config.max_num_seqs, -1)  # [max_num_seqs, hidden]
    logits = model.compute_logits(rows)  # [max_num_seqs, vocab] on rank 0, None elsewhere
    if logits is not None:
        # Each threshold path the sampler can take, at full batch, so its kernels compile here
        # and its peak memory is what the KV cache leaves room for: top-p alone (on the CPU a
        # full sort), top-k with top-p and every row's logprobs (as many as max_logprobs allows,
        # and where the Triton logprobs pass serves fewer, its largest k too), plain sampling, and
        # where the sampler has the radix select (CUDA), a top-k too large for torch.topk, which
        # takes it; with the Triton top-k kernel (CUDA), each of its list lengths.
        keys = [0] * config.max_num_seqs
        logprob_ks = {config.logprobs_limit}
        if sampler.token_logprobs_max_k is not None:
            logprob_ks.add(min(config.logprobs_limit, sampler.token_logprobs_max_k))
        passes = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0),
                  *(SamplingParams(temperature=1.0, top_k=50, top_p=0.9, logprobs=k) for k in sorted(logprob_ks))]
        passes += [SamplingParams(temperature=0.6, top_k=k, top_p=0.95) for k in sampler.topk_list_ks]
        if sampler.radix_min_rows is not None:
            passes.append(SamplingParams(temperature=1.0, top_k=sampler.topk_max_k + 1, top_p=0.9))
        for sp in passes:
            batch = SamplingBatch.build([sp] * config.max_num_seqs, keys, device, logits.shape[-1])
            sampler(logits, batch)
        # the token-mask kernel (structured outputs) compiles here too, not at the first such request
        allow_all = torch.full((1, mask_words(logits.shape[-1])), -1, dtype=torch.int32, device=device)
        sampler.apply_token_mask(logits, TokenMask(torch.zeros(1, dtype=torch.int64, device=device), allow_all))
    torch.cuda.synchronize(device)


def _other_prefill_tile(model: torch.nn.Module, builder: StepInputBuilder, device: torch.device,
                        taken_long: bool) -> None:
    """Compile the prefill kernel's other tile (kernels/prefill_plan.py: the 64-row one, or where steps
    may take it the long-context one), the one the warm-up step did not take: a forward of one small
    prompt forced onto it (the kernel takes either tile's table at any size)."""
    long = not taken_long
    if long and builder.long_tile_rows is None:
        return  # no step takes the long tile
    n = builder.query_tile_rows
    plan = StepPlan(StepKind.PREFILL, starts=[0], num_new_tokens=[n], token_ids=[0] * n,
                    block_tables=[[0] * builder.table_width], sampled=[True])
    layout = replace(builder.exact_layout(plan), long_tiles=long)
    flat = to_device(builder.varlen_array(plan, layout), device)
    inputs = builder.varlen_inputs(flat, layout, n, n, 1, with_decode_rows=False)
    with attention_context(inputs.meta):
        model(inputs.input_ids, inputs.positions)
