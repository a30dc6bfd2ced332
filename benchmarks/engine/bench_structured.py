"""Structured outputs' cost: a JSON-schema workload against the same prompts unconstrained.

    python -m benchmarks.engine.bench_structured --tokenizer DIR [--model DIR] [--load-format auto] [--num-prompts 256]
    python -m benchmarks.engine.bench_structured --tokenizer DIR --device cpu --num-prompts 8   # a CPU smoke run

The engine runs --model's shape (random weights when it has no *.safetensors, as bench.py) with the
tokenizer of --tokenizer (needed for grammars; a Qwen-sized one without downloading:
`python scripts/grammar_libraries.py --build-tokenizer DIR`). The first --num-prompts prompts of
bench.py's default workload decode greedily under a bounded JSON schema (compact JSON), so each ends
by EOS where its JSON closes. The unconstrained side runs the same prompts with each request's
max_tokens set to its constrained completion's length and EOS ignored: the same tokens, and the same
batch at every step. Each side runs on a fresh engine after a warm-up (the schema is compiled there) on
prompts none of whose blocks the timed ones share (no timed prompt is served from the prefix cache).

Per decode step it reports the host's time (launch + postprocess; the latter includes filling the
next step's token masks) against the step's wall time, wait_s, the time the host waited for the
device's tokens (while it stays above zero the device, not the host, sets the pace), and mask wait,
the part of the host's time spent waiting for the masks' fill (overlap scheduling runs it on a
worker thread beside the host's other work: what that work did not hide). On the CPU (`--device
cpu`, a smoke run) the "device" work runs on the host, inside the host time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from benchmarks.harness.engine_options import add_model_options, require_cuda, resolve_load_format
from benchmarks.harness.workloads import workload_prefix
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.sampling_params import StructuredOutputsParams

# Every string and number bounded (an unbounded "number" let random weights write digits until max_tokens),
# so every completion closes within MAX_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["module", "class", "function", "method"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "public": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "tags", "score", "public"],
    "additionalProperties": False,
}
MAX_TOKENS = 512
# Requests of each side's untimed warm-up generate.
WARMUP_PROMPTS = 4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def model_with_tokenizer(model: str, tokenizer: str, into: str) -> str:
    """A directory holding `model`'s files and `tokenizer`'s tokenizer files (links)."""
    for name in os.listdir(model):
        os.symlink(os.path.abspath(os.path.join(model, name)), os.path.join(into, name))
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer, name)):
            target = os.path.join(into, name)
            if os.path.lexists(target):
                os.remove(target)
            shutil.copy(os.path.join(tokenizer, name), target)
    return into


def run_side(model: str, load_format: str, prompts: list[list[int]], params: list[SamplingParams],
             device: str = "cuda"):
    """(outputs, seconds, decode steps' (host_s, wait_s, wall_s, mask_wait_s)) on a fresh engine, after a
    warm-up (kernels, the schema's compile) on the first WARMUP_PROMPTS prompts reversed: their lengths and
    ids, but no block the timed prompts find in the prefix cache."""
    llm = LLM(model, load_format=load_format, device=device)
    try:
        llm.generate([p[::-1] for p in prompts[:WARMUP_PROMPTS]], params[:WARMUP_PROMPTS], use_tqdm=False)
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
        outs, steps = {}, []
        start = time.perf_counter()
        while not llm.is_finished():
            t = time.perf_counter()
            result = llm.step()
            wall = time.perf_counter() - t
            if result.kind is StepKind.DECODE:
                steps.append((result.launch_s + result.postprocess_s, result.wait_s, wall, result.mask_wait_s))
            for out in result.finished:
                outs[out.request_id] = out
        return [outs[i] for i in ids], time.perf_counter() - start, steps
    finally:
        llm.exit()


def closed_count(outs) -> int:
    """How many completions ended by EOS (their JSON closed), not by max_tokens."""
    return sum(o.finish_reason == "stop" for o in outs)


def describe(name: str, outs, seconds: float, steps) -> float:
    tokens = sum(len(o.token_ids) for o in outs)
    host, wait, wall, mask_wait = (statistics.mean(s[i] for s in steps) * 1e3 for i in range(4))
    hidden = sum(s[1] > 0 for s in steps) / len(steps)
    print(f"{name:13s} {tokens} tokens / {seconds:.2f} s = {tokens / seconds:,.0f} tok/s; decode steps: "
          f"{len(steps)}, host {host:.2f} ms (of which mask wait {mask_wait:.2f}), wait {wait:.2f} ms, "
          f"wall {wall:.2f} ms a step; host waited for the device in {100 * hidden:.0f}% of them")
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(ap)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer directory (model vocabulary or smaller)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of the measurement (slow; use few prompts)")
    args = ap.parse_args()
    if args.device == "cuda":
        require_cuda("bench_structured.py")
    load_format, weights_line = resolve_load_format(args.load_format, args.model)
    prompts, _ = workload_prefix(n=args.num_prompts)
    print(weights_line)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_with_tokenizer(args.model, args.tokenizer, tmp)
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        constrained = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec)] * len(prompts)
        outs, seconds, steps = run_side(model, load_format, prompts, constrained, args.device)
        free = [SamplingParams(temperature=0, max_tokens=len(o.token_ids), ignore_eos=True) for o in outs]
        free_outs, free_seconds, free_steps = run_side(model, load_format, prompts, free, args.device)
    print(f"{closed_count(outs)} of {len(outs)} constrained completions closed their JSON (EOS)")
    a = describe("json schema", outs, seconds, steps)
    b = describe("unconstrained", free_outs, free_seconds, free_steps)
    print(f"json schema / unconstrained tok/s: {a / b:.3f}")


if __name__ == "__main__":
    main()
