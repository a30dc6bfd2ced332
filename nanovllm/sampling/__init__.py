"""Token sampling: logits of a step's last positions -> next tokens (and logprobs).

- sampler.py: `Sampler`, the one batched pass (greedy / temperature / top-k / top-p / min-p).
- batch.py: `SamplingBatch` / `SamplingPack`, the step's per-row parameters as device tensors.
- gumbel_torch.py / gumbel_max.py: the counter-based Gumbel noise (PyTorch twin / Triton kernel).
- candidate_walk.py: top-p / min-p sampling by walking Gumbel-max candidates (Triton).
- radix_filter.py: top-k / top-p thresholds by radix select for large batches (Triton).
- logprobs_kernel.py: row logprobs and each row's top k in one pass (Triton).
"""
