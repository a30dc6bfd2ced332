"""Plain-PyTorch references of vLLM's logits rules, one row and one rule at a time in float64, written
from vLLM's documented semantics (not from nanovllm's vectorised code):

    allowed_token_ids  -> every other token -inf
    bad_words          -> a word's last token -inf where its other tokens end the generated ones
    min_tokens         -> EOS and stop_token_ids -inf while fewer tokens are generated
    logit_bias         -> + bias
    repetition_penalty -> each token of prompt or output: logit / r if logit > 0 else logit * r
    frequency_penalty, presence_penalty -> logit -= f * count(output) + p * (count(output) > 0)

applied in that order (vLLM V1's sampler), before the argmax.
"""

from __future__ import annotations

from collections import Counter

import torch

from nanovllm import SamplingParams


def bad_word_token_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: the word with leading spaces stripped, plus the word after
    one space when that starts with another token and has as many tokens."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def reference_row(logits: torch.Tensor, prompt: list[int], generated: list[int], params: SamplingParams,
                  stop_ids: set[int], bad_sequences: list[list[int]]) -> torch.Tensor:
    """One row's logits [V] after the rules of `params`, given the prompt and the tokens generated
    before this one; `stop_ids`: EOS ids (min_tokens masks them and params.stop_token_ids)."""
    x = logits.double().clone()
    vocab = x.shape[0]
    if params.allowed_token_ids is not None:
        for t in range(vocab):
            if t not in params.allowed_token_ids:
                x[t] = -torch.inf
    for seq in bad_sequences:
        prefix = seq[:-1]
        if len(generated) >= len(prefix) and (not prefix or generated[len(generated) - len(prefix):] == prefix):
            x[seq[-1]] = -torch.inf
    if len(generated) < params.min_tokens:
        for t in stop_ids | set(params.stop_token_ids):
            x[t] = -torch.inf
    for t, bias in (params.logit_bias or {}).items():
        x[t] += bias
    for t in set(prompt) | set(generated):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, count in Counter(generated).items():
        x[t] -= params.frequency_penalty * count + params.presence_penalty
    return x


def assert_rules_argmax(reference, prompt: list[int], completion: list[int], params: SamplingParams,
                        stop_ids: set[int], bad_sequences: list[list[int]], atol: float = 1e-4,
                        range_fraction: float = 0.0) -> None:
    """Every token of `completion` is an argmax (up to float ties) of transformers' logits at its
    position after the rules (`reference`: the checkpoint's transformers model, on any device).
    Tolerance: `atol`, plus `range_fraction` of the row's finite logit range (a bf16 engine)."""
    assert completion, "empty completion"
    device = next(reference.parameters()).device
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + completion], device=device)).logits[0].double().cpu()  # [len, V]
    for i, token in enumerate(completion):
        row = reference_row(logits[len(prompt) - 1 + i], prompt, completion[:i], params, stop_ids, bad_sequences)
        finite = row[torch.isfinite(row)]
        best = row.max().item()
        tol = atol + range_fraction * (best - finite.min().item())  # this row's: never carried to the next
        assert row[token].item() >= best - tol, (
            f"token {i} ({token}): processed logit {row[token].item():.6f}, argmax {row.argmax().item()} {best:.6f}")
