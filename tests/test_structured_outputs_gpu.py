"""Structured outputs on CUDA (bf16, the shipped default model): the CPU tests' mixed batch with CUDA
graphs (decode, prefill and mixed steps) and overlap scheduling, the token masks applied by the
Triton kernel. Outputs valid; greedy constrained tokens the masked argmax of transformers' bf16
logits on the GPU (within bf16 rounding); graphs on, eager and overlap off give the same tokens.

Unconstrained rows: bf16 results may depend on the batch's row count (cuBLAS picks kernels by
shape), so they are compared with a twin batch of the same shape at every step: the constrained
rows replaced by unconstrained ones of the same lengths (max_tokens = their length, ignore_eos)."""

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

COPIES = 4  # the batch four times over: decode steps of 40 rows, half of them constrained


def batch() -> tuple[list[str], list]:
    params = [FREE[0]]
    for kind in CONSTRAINTS:
        params += [constrained(kind, False), constrained(kind, True)]
    params += [FREE[1]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    return prompts * COPIES, params * COPIES


def run(prompts, params, **kwargs) -> tuple[list[dict], list[dict], bool, object]:
    """(outputs, the two FREE rows alone, whether decode graphs ran, the tokenizer) of one engine."""
    llm = LLM(MODEL_DIR, kvcache_block_size=16, max_model_len=1024, dtype="bfloat16", max_num_seqs=GPU_MAX_NUM_SEQS,
              max_num_batched_tokens=GPU_MAX_STEP_TOKENS, num_kvcache_blocks=1024, **kwargs)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        alone = llm.generate([prompts[0], prompts[-1]], FREE, use_tqdm=False)
        graphs = llm.model_runner.graphs is not None
        return outs, alone, graphs, llm.tokenizer
    finally:
        llm.exit()


@pytest.fixture(scope="module")
def graph_run():
    prompts, params = batch()
    outs, alone, graphs, tokenizer = run(prompts, params)
    assert graphs
    return prompts, params, outs, alone, tokenizer


def test_outputs_are_valid(graph_run):
    prompts, params, outs, _, _ = graph_run
    per_copy = len(outs) // COPIES
    kinds = [kind for kind in CONSTRAINTS for _ in range(2)]
    for c in range(COPIES):
        copy = outs[c * per_copy : (c + 1) * per_copy]
        for kind, out in zip(kinds, copy[1:-1]):
            assert out["finish_reason"] == "stop" and out["token_ids"][-1] == EOS, (kind, out)
            check_text(kind, out["text"])


def test_unconstrained_rows_equal_those_of_a_batch_without_constraints(graph_run):
    prompts, params, outs, _, _ = graph_run
    twin = [replace(p, structured_outputs=None, max_tokens=len(o["token_ids"]), ignore_eos=True)
            if p.structured_outputs is not None else p for p, o in zip(params, outs)]
    again, _, _, _ = run(prompts, twin)
    free = [i for i, p in enumerate(params) if p.structured_outputs is None]
    assert [again[i]["token_ids"] for i in free] == [outs[i]["token_ids"] for i in free]
    assert [len(o["token_ids"]) for o in again] == [len(o["token_ids"]) for o in outs]  # the same batch shapes


@torch.no_grad()
def test_greedy_constrained_tokens_are_the_masked_argmax_of_transformers_bf16_logits(graph_run):
    from transformers import AutoModelForCausalLM

    prompts, params, outs, _, tokenizer = graph_run
    reference = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.bfloat16).cuda().eval()
    grammars = reference_grammars(tokenizer, reference.config.vocab_size)
    for i, kind in enumerate(CONSTRAINTS):
        assert_masked_greedy(reference, grammars[kind], tokenizer.encode(prompts[1 + 2 * i]),
                             outs[1 + 2 * i]["token_ids"], tolerance=BF16_TOLERANCE)


@pytest.mark.parametrize("config", [{"enforce_eager": True}, {"overlap_scheduling": False}], ids=["eager", "no-overlap"])
def test_graphs_eager_and_no_overlap_give_the_same_tokens(graph_run, config):
    prompts, params, outs, _, _ = graph_run
    again, _, _, _ = run(prompts, params, **config)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in outs]
