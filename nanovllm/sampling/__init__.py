"""Token sampling: logits of a step's last positions -> next tokens (and logprobs).

- sampler.py: `Sampler`, the one batched pass (greedy / temperature / top-k / top-p / min-p).
- batch.py: `SamplingBatch` / `SamplingPack`, the step's per-row parameters as device tensors.
- gumbel_torch.py / gumbel_max.py: the counter-based Gumbel noise (PyTorch twin / Triton kernel).
- candidate_walk.py: top-p / min-p sampling by walking Gumbel-max candidates (Triton).
- topk_sample.py: top-k (<= 128) sampling, with top-p / min-p within the k (Triton).
- radix_filter.py: top-k / top-p thresholds by radix select for large batches (Triton).
- row_logprobs.py: `RowLogprobs` and `token_logprobs`, the logprobs contract (PyTorch path).
- logprobs_kernel.py: row logprobs, ranks and each row's top k in one pass (Triton).
- sort_keys.py: the packed (value, column) keys the top-k sampler and the logprobs pass rank with.
- logits_rules.py: a step's allowed tokens, bans, biases and penalties on the logits (vLLM's order).
- penalties.py: repetition / frequency / presence penalties from token counts kept on the device;
  penalties_kernel.py: their one Triton pass over a penalized row.
- token_mask.py / token_mask_kernel.py: structured outputs' token masks applied on the device.
"""
