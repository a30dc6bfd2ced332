"""The overlapped mask fill of structured outputs (CPU, the shipped default model): under overlap
scheduling the next step's token masks are filled on the grammar backend's worker thread while the
engine records the step and prepares the one after (engine/step_pipeline.py, StepPipeline.step).

Checked here: the same tokens as the serial path (overlap scheduling off, where the masks are filled
on the engine's thread) for greedy and seeded rows of every constraint kind; a fill that fails is
raised in the step that uses its masks, and the engine serves again after abort_all; aborting
constrained requests between steps (a forwarded step and its fill pending) leaves the others' tokens
as they were; no fill outlives the block that started it, however the block ends.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

from checkpoints import cpu_llm
from nanovllm import SamplingParams
from nanovllm.engine.structured_outputs import GrammarBackend
from nanovllm.sampling_params import StructuredOutputsParams

MODEL_DIR = str(Path(__file__).resolve().parent.parent / "nanovllm" / "default_model")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "id": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "id", "ok"],
    "additionalProperties": False,
}
SPECS = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         StructuredOutputsParams(regex=r"[a-z]{1,6}-[0-9]{2,4}"),
         StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"])]
PROMPTS = ["def main():\n    data = ", "    return ", "import os\nx = ", "# config\nvalue = ", "print("]
FILL_THREAD = "nanovllm-mask-fill"  # GrammarBackend's worker thread's name prefix


def workload() -> tuple[list[str], list[SamplingParams]]:
    """Greedy and seeded rows of each constraint kind, and two unconstrained rows among them."""
    prompts, params = [], []
    for i in range(12):
        spec = SPECS[i % len(SPECS)]
        noise = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 1.0, "seed": 100 + i}
        prompts.append(PROMPTS[i % len(PROMPTS)])
        params.append(SamplingParams(max_tokens=64, structured_outputs=spec, **noise))
    prompts += PROMPTS[:2]
    params += [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
               SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)]
    return prompts, params


def fill_threads() -> int:
    return sum(t.name.startswith(FILL_THREAD) for t in threading.enumerate())


@pytest.fixture(scope="module")
def serial():
    """The workload's token ids with overlap scheduling off: every mask filled on the engine's thread."""
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=256, overlap_scheduling=False)
    try:
        return [o.token_ids for o in engine.generate(*workload(), use_tqdm=False)]
    finally:
        engine.exit()


@pytest.fixture(scope="module")
def llm():
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=256)
    yield engine
    engine.exit()


def test_overlapped_fill_gives_the_serial_path_tokens(llm, serial):
    before = fill_threads()
    outputs = llm.generate(*workload(), use_tqdm=False)
    assert [o.token_ids for o in outputs] == serial
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:12])  # each grammar closed
    assert fill_threads() >= 1 and before <= fill_threads()  # the masks were filled on the worker thread


def test_exit_stops_the_fill_thread():
    engine = cpu_llm(MODEL_DIR, kvcache_block_size=16, max_model_len=256)
    before = fill_threads()
    prompts, params = workload()
    engine.generate(prompts[:3], params[:3], use_tqdm=False)
    assert fill_threads() == before + 1
    engine.exit()
    assert fill_threads() == before


def test_aborting_constrained_requests_between_steps_leaves_the_others_as_they_were(llm, serial):
    """Each step after the first leaves a constrained step forwarded (its masks to be filled by the
    next call): aborting requests then, greedy and seeded, constrained and not, changes no other
    request's tokens, and the engine ends with nothing pending."""
    prompts, params = workload()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    victims: set[int] = set()
    got: dict[int, list[int]] = {}
    for step in range(12):
        if step in (4, 7):  # two pending requests each time: the first constrained one, and the last one
            pending = [i for i in ids if i in llm.scheduler.requests and i not in victims]
            chosen = {pending[0], pending[-1]}
            llm.abort_request(chosen)
            victims |= chosen
        for out in llm.step().finished:
            got[out.request_id] = out.token_ids
    while not llm.is_finished():
        for out in llm.step().finished:
            got[out.request_id] = out.token_ids
    assert victims.isdisjoint(got)
    assert {i: got[i] for i in ids if i not in victims} == {i: t for i, t in zip(ids, serial) if i not in victims}
    assert llm.scheduler.num_constrained == 0


def test_a_failing_fill_is_raised_in_the_step_and_the_engine_serves_again(llm, serial):
    """A grammar whose masks cannot be filled (compiled for another vocabulary size: xgrammar
    refuses the engine's bitmask shape; its language takes any text, so it accepts the tokens the
    sample has) makes the step that fills them raise, naming the fill; after abort_all the engine
    serves the workload as before."""
    other = GrammarBackend(llm.tokenizer, 4 * llm.config.model_config.vocab_size, llm.eos_token_ids,
                           llm.model_runner.device)
    misfit = other.compile(StructuredOutputsParams(regex=r"[\s\S]*"))
    prompts, params = workload()
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(3):  # steady decode: the next fill runs on the worker thread
        llm.step()
    llm.scheduler.requests[ids[0]].samples[0].grammar = other.sample_grammar(misfit)
    with pytest.raises(RuntimeError, match=r"filling the token masks of \d+ constrained rows .* failed: .*bitmask"):
        for _ in range(4):
            llm.step()
    llm.abort_all()
    assert llm.is_finished()
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == serial


def test_leaving_a_filling_block_waits_for_the_fill_and_its_error_reaches_mask(llm):
    backend = llm.grammars
    compiled = backend.compile(SPECS[1])
    grammars = [backend.sample_grammar(compiled) for _ in range(4)]
    with pytest.raises(KeyError):
        with backend.filling([0, 2, 3, 5], grammars) as fill:
            raise KeyError("the host work beside the fill failed")
    assert fill.done.done()  # no fill outlives its block
    with backend.filling([0, 2, 3, 5], grammars) as fill:
        mask = fill.mask()
    assert mask.rows.tolist() == [0, 2, 3, 5]
    assert mask.bitmask.equal(backend.token_mask([0, 2, 3, 5], grammars).bitmask)
    misfit = GrammarBackend(llm.tokenizer, 4 * backend.vocab_size, llm.eos_token_ids, backend.device)
    bad = misfit.sample_grammar(misfit.compile(SPECS[1]))
    with backend.filling([1], [bad]) as fill:
        with pytest.raises(RuntimeError, match=r"filling the token masks of 1 constrained rows \(batch rows \[1\]\)"):
            fill.mask()
