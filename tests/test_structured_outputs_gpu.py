"""Structured outputs on CUDA (bf16, the shipped default model): the CPU tests' mixed batch (four
times over: decode steps of up to 40 rows, 32 of them constrained) with CUDA graphs (decode, prefill
and mixed steps) and overlap scheduling, the token masks applied by the Triton kernel; then eager,
and without overlap scheduling.

In every run the outputs are valid and each greedy constrained token is the masked argmax of
transformers' bf16 logits on the GPU (within bf16 rounding). Runs are not compared token for token:
bf16 results may depend on a step's row count (cuBLAS picks kernels by shape; graphs pad batches;
overlap scheduling computes a row ended by EOS once more), so a near-tie may fall either way.

Unconstrained rows: compared with a twin batch of the same shape at every step, the constrained
rows replaced by unconstrained ones of the same lengths (max_tokens = their length, ignore_eos),
both without overlap scheduling (where a row ended by EOS and one ended by length leave the batch
at the same step)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from checkpoints import BF16_TOLERANCE, GPU_MAX_NUM_SEQS, GPU_MAX_STEP_TOKENS
from nanovllm import LLM
from test_structured_outputs import (
    CONSTRAINTS, EOS, FREE, MODEL_DIR, PROMPTS, assert_masked_greedy, check_text, constrained, reference_grammars,
)

pytestmark = pytest.mark.gpu

COPIES = 4


def batch() -> tuple[list[str], list]:
    params = [FREE[0]]
    for kind in CONSTRAINTS:
        params += [constrained(kind, False), constrained(kind, True)]
    params += [FREE[1]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return prompts * COPIES, params * COPIES


def run(prompts, params, **kwargs) -> tuple[list[dict], bool]:
    """(outputs, whether decode graphs ran) of a fresh bf16 engine."""
    llm = LLM(MODEL_DIR, kvcache_block_size=16, max_model_len=1024, dtype="bfloat16", max_num_seqs=GPU_MAX_NUM_SEQS,
              max_num_batched_tokens=GPU_MAX_STEP_TOKENS, num_kvcache_blocks=1024, **kwargs)
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.model_runner.graphs is not None
    finally:
        llm.exit()


@pytest.fixture(scope="module")
def reference():
    """transformers' bf16 model on the GPU, its tokenizer, and the constraints' grammars compiled here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    return model, tokenizer, reference_grammars(tokenizer, model.config.vocab_size)


@pytest.mark.parametrize("config", [{}, {"enforce_eager": True}, {"overlap_scheduling": False}],
                         ids=["graphs-overlap", "eager", "no-overlap"])
def test_outputs_are_valid_and_greedy_ones_the_masked_argmax(reference, config):
    model, tokenizer, grammars = reference
    prompts, params = batch()
    outs, graphs = run(prompts, params, **config)
    assert graphs == ("enforce_eager" not in config)
    kinds = [kind for kind in CONSTRAINTS for _ in range(2)]
    per_copy = len(outs) // COPIES
    for c in range(COPIES):
        copy = outs[c * per_copy : (c + 1) * per_copy]
        for i, (kind, out) in enumerate(zip(kinds, copy[1:-1])):
            assert out["finish_reason"] == "stop" and out["token_ids"][-1] == EOS, (kind, out)
            check_text(kind, out["text"])
            if i % 2 == 0:  # the greedy row of each constraint
                assert_masked_greedy(model, grammars[kind], tokenizer.encode(prompts[1 + i]), out["token_ids"],
                                     tolerance=BF16_TOLERANCE)


def test_unconstrained_rows_equal_those_of_a_batch_without_constraints():
    prompts, params = batch()
    outs, _ = run(prompts, params, overlap_scheduling=False)
    twin = [replace(p, structured_outputs=None, max_tokens=len(o["token_ids"]), ignore_eos=True)
            if p.structured_outputs is not None else p for p, o in zip(params, outs)]
    again, _ = run(prompts, twin, overlap_scheduling=False)
    assert [len(o["token_ids"]) for o in again] == [len(o["token_ids"]) for o in outs]  # the same batch shapes
    free = [i for i, p in enumerate(params) if p.structured_outputs is None]
    assert [again[i]["token_ids"] for i in free] == [outs[i]["token_ids"] for i in free]
