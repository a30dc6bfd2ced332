"""LLM.beam_search (vLLM's; nanovllm/beam_search.py) against a beam search over transformers'
float64 log-probabilities: the same beams in the same order with the same cumulative logprobs,
under length penalties, EOS endings (with and without ignore_eos) and beams that reach
max_model_len; the refusals; the engine serving afterwards."""

from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest
import torch
from checkpoints import build_checkpoint, cpu_llm, load_reference, make_prompts

from nanovllm import SamplingParams
from nanovllm.beam_search import BeamSearchOutput
from nanovllm.sampling_params import BeamSearchParams

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("beam")), seed=6)


@pytest.fixture(scope="module")
def reference(ckpt):
    return load_reference(ckpt).double()


def reference_beams(model, prompt: list[int], params: BeamSearchParams, eos: set[int],
                    max_len: int = MAX_MODEL_LEN) -> list[tuple[list[int], float]]:
    """(tokens, cumulative logprob) of the best beams, best first, from float64 transformers; scores in
    Decimal, whose exponents do not overflow where len ** length_penalty does in floats."""
    def score(beam):
        tokens, cum = beam
        return Decimal(cum) / Decimal(len(tokens) - (tokens[-1] in eos)) ** Decimal(params.length_penalty)

    stops = set() if params.ignore_eos else eos

    def full(beam):  # grows no more: at max_len, past a full prompt (which generate serves one token)
        return len(beam[0]) >= max_len and len(beam[0]) > len(prompt)

    live, done = [(list(prompt), 0.0)], []
    for _ in range(params.max_tokens):
        done += [b for b in live if full(b)]
        live = [b for b in live if not full(b)]
        if not live:
            break
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], dim=-1)
            top = logprobs.topk(2 * params.beam_width)
            for token, logprob in zip(top.indices.tolist(), top.values.tolist()):
                (done if token in stops else grown).append((tokens + [token], cum + logprob))
        live = sorted(grown, key=score, reverse=True)[: params.beam_width]
    return sorted(done + live, key=score, reverse=True)[: params.beam_width]


def assert_same_beams(ours: BeamSearchOutput, expected: list[tuple[list[int], float]]) -> None:
    assert [s.tokens for s in ours.sequences] == [tokens for tokens, _ in expected]
    for seq, (_, cum) in zip(ours.sequences, expected):
        assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (3, 1.0), (4, 0.5), (2, 2.0)])
def test_beams_match_a_float64_transformers_search(ckpt, reference, width, length_penalty):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
    try:
        prompts = make_prompts(width, 3, 5, 20)
        params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=length_penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        eos = set(llm.eos_token_ids)
        for prompt, out in zip(prompts, outs):
            assert_same_beams(out, reference_beams(reference, prompt, params, eos))
            for seq in out.sequences:
                completion = seq.tokens[len(prompt):]
                assert seq.tokens[: len(prompt)] == prompt and len(seq.logprobs) == len(completion)
                assert all(token in step for token, step in zip(completion, seq.logprobs))
                assert seq.text == llm.get_tokenizer().decode(seq.tokens)  # vLLM's: prompt and EOS included
                if seq.finish_reason == "stop":
                    assert completion[-1] in eos
                else:
                    assert seq.finish_reason == "length" and len(completion) == 6
        if width == 1:  # one beam is greedy decoding
            greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
            assert [o.sequences[0].tokens for o in outs] == [p + g.outputs[0].token_ids for p, g in zip(prompts, greedy)]
        # a text prompt, a concurrency limit: the same beams
        again = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, concurrency_limit=2)
        assert [[s.tokens for s in o.sequences] for o in again] == [[s.tokens for s in o.sequences] for o in outs]
        # a NumPy limit as BeamSearchParams takes NumPy counts (and vLLM slices by it): it was a TypeError
        drawn = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, concurrency_limit=np.int64(2))
        assert [[s.tokens for s in o.sequences] for o in drawn] == [[s.tokens for s in o.sequences] for o in outs]
    finally:
        llm.exit()


def test_eos_ends_a_beam_unless_ignore_eos(ckpt, reference, tmp_path):
    """EOS is made the most likely first token of the prompt: a finished beam competes with the live ones."""
    prompt = make_prompts(9, 1, 8, 12)[0]
    with torch.no_grad():
        first = int(reference(torch.tensor([prompt])).logits[0, -1].argmax())
    path = build_checkpoint(str(tmp_path / "eos"), seed=6, eos_token_id=first)
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
    try:
        eos = set(llm.eos_token_ids)
        assert first in eos
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        assert_same_beams(out, reference_beams(reference, prompt, params, eos))
        stopped = [s for s in out.sequences if s.finish_reason == "stop"]
        assert stopped and all(s.tokens[-1] == first and s.stop_reason == first for s in stopped)
        ignoring = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], ignoring)
        assert_same_beams(out, reference_beams(reference, prompt, ignoring, eos))
        assert all(s.finish_reason == "length" and len(s.tokens) == len(prompt) + 5 for s in out.sequences)
        # A large |length_penalty| ranks by length first: len ** length_penalty overflows a float at +1000
        # (it was an OverflowError) and underflows to 0 at -1000 (a ZeroDivisionError), after every step ran.
        for length_penalty, stopped_first in ((-1000.0, True), (1000.0, False)):
            ranked = BeamSearchParams(beam_width=3, max_tokens=5, length_penalty=length_penalty)
            (out,) = llm.beam_search([{"prompt_token_ids": prompt}], ranked)
            assert_same_beams(out, reference_beams(reference, prompt, ranked, eos))
            assert (out.sequences[0].finish_reason == "stop") == stopped_first
    finally:
        llm.exit()


def test_beams_stop_growing_at_max_model_len(ckpt, reference):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
    try:
        prompt = make_prompts(4, 1, MAX_MODEL_LEN - 3, MAX_MODEL_LEN - 2)[0]
        params = BeamSearchParams(beam_width=2, max_tokens=10)
        (out,) = llm.beam_search([{"prompt_token_ids": prompt}], params)
        assert all(len(s.tokens) == MAX_MODEL_LEN and s.finish_reason == "length" for s in out.sequences)
        assert_same_beams(out, reference_beams(reference, prompt, params, set(llm.eos_token_ids)))
        # A prompt of max_model_len tokens gets one token, as generate() serves it: beam_width beams of one
        # token each (it was the bare prompt alone, no completion, cum_logprob 0).
        full = make_prompts(5, 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1)[0]
        served = llm.generate([{"prompt_token_ids": full}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(served[0].outputs[0].token_ids) == 1
        (out,) = llm.beam_search([{"prompt_token_ids": full}], params)
        assert len(out.sequences) == 2
        assert all(len(s.tokens) == MAX_MODEL_LEN + 1 and len(s.logprobs) == 1 for s in out.sequences)
        assert out.sequences[0].tokens == full + served[0].outputs[0].token_ids
        assert_same_beams(out, reference_beams(reference, full, params, set(llm.eos_token_ids)))
    finally:
        llm.exit()


@pytest.mark.parametrize("kwargs,error,message", [
    ({"beam_width": 0, "max_tokens": 4}, ValueError, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, ValueError, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, ValueError, "temperature must be >= 0"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, TypeError, "length_penalty must be a finite"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, TypeError, "ignore_eos must be a bool"),
])
def test_bad_params_are_refused_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        BeamSearchParams(**kwargs)


def test_numpy_scalars_are_numbers():
    """As SamplingParams takes them (scripts draw widths and penalties with NumPy); np.int64 was refused."""
    params = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int32(3), temperature=np.float32(0.5),
                              length_penalty=np.float64(1.5))
    assert params == BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5, length_penalty=1.5)
    assert type(params.beam_width) is int and type(params.max_tokens) is int and type(params.temperature) is float


def test_bad_calls_are_refused_before_any_step_and_the_engine_keeps_serving(ckpt):
    llm = cpu_llm(ckpt, kvcache_block_size=16, max_model_len=MAX_MODEL_LEN)
    try:
        params = BeamSearchParams(beam_width=2, max_tokens=3)
        with pytest.raises(TypeError, match="params must be BeamSearchParams"):
            llm.beam_search([[1, 2, 3]], SamplingParams())
        with pytest.raises(ValueError, match="more than max_model_len"):
            llm.beam_search([[1, 2, 3], [5] * (MAX_MODEL_LEN + 1)], params)
        with pytest.raises(ValueError, match="concurrency_limit"):
            llm.beam_search([[1, 2, 3]], params, concurrency_limit=0)
        with pytest.raises(ValueError, match="LoRA"):
            llm.beam_search([[1, 2, 3]], params, lora_request="adapter")
        with pytest.raises(ValueError, match=r"beam_width=11: each step reads the 2 x beam_width most likely tokens, "
                                             r"more than the 20 .* raise LLM\(max_logprobs=...\) to at least 22"):
            llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=3))
        # fields edited after construction are checked at the call too (beam_width 0 returned no beams,
        # a str length_penalty was a TypeError from ** once every step had run)
        for field, value, error, words in (("beam_width", 0, ValueError, "beam_width must be >= 1, got 0"),
                                           ("length_penalty", "long", TypeError, "length_penalty must be a finite"),
                                           ("ignore_eos", 1, TypeError, "ignore_eos must be a bool, got 1")):
            edited = BeamSearchParams(beam_width=2, max_tokens=3)
            setattr(edited, field, value)
            with pytest.raises(error, match=words):
                llm.beam_search([[1, 2, 3]], edited)
        assert llm.is_finished() and llm.block_manager.num_free_blocks == llm.num_kvcache_blocks
        (out,) = llm.beam_search(["the quick brown fox"], params)  # a text prompt
        ids = llm.get_tokenizer().encode("the quick brown fox")
        assert len(out.sequences) == 2 and all(s.tokens[: len(ids)] == ids for s in out.sequences)
    finally:
        llm.exit()
