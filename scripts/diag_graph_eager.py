"""Where do a CUDA-graph engine and an eager one part? (GPU diagnostic, not a test.)

Builds test_moe_gpu.py's Qwen3-MoE checkpoint (or takes --model), runs the same greedy prompts on
three bf16 engines (graphs with prefill graphs, decode graphs only, eager) asking for the top-20
logprobs of every generated token, and prints for each pair the first position whose logprobs
differ at all and the first whose token differs. Position 0 is sampled from the prefill step's
logits, so a difference there is in prefill; a later first difference is in decode.

    PYTHONPATH=. python3 scripts/diag_graph_eager.py [--model DIR] [--batch 2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# Top alternatives compared per token: enough to see a near-tie move.
TOP_K = 20


def run(model: str, batches, **kw) -> list[list[dict]]:
    """Each batch's outputs from one bf16 engine with the GPU tests' settings (checkpoints.gpu_generate)."""
    from checkpoints import GPU_KV_TOKENS, GPU_MAX_MODEL_LEN, GPU_MAX_NUM_SEQS, GPU_MAX_STEP_TOKENS, served_len
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP_K)
    llm = LLM(model, **{"kvcache_block_size": 16, "max_model_len": served_len(model, GPU_MAX_MODEL_LEN), "dtype": "bfloat16",
                        "max_num_seqs": GPU_MAX_NUM_SEQS, "max_num_batched_tokens": GPU_MAX_STEP_TOKENS,
                        "num_kvcache_blocks": GPU_KV_TOKENS // 16, **kw})
    try:
        return [llm.generate(ps, params, use_tqdm=False) for ps in batches]
    finally:
        llm.exit()


def first_difference(a: list[dict], b: list[dict]) -> str:
    for i, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        if x != y:
            shared = set(x) & set(y)
            gap = max((abs(x[t] - y[t]) for t in shared), default=float("nan"))
            token = "tokens differ" if a["token_ids"][i] != b["token_ids"][i] else "same token"
            return f"position {i}: logprobs differ by up to {gap:.2e} ({token})"
    return "identical"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: test_moe_gpu.py's MoE checkpoint)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 8])
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("diag_graph_eager.py compares CUDA engines; no CUDA device is visible")
    from checkpoints import build_moe_checkpoint, make_prompts

    model = args.model
    if model is None:
        from test_moe_gpu import SHAPE

        model = build_moe_checkpoint(tempfile.mkdtemp(prefix="diag-moe-"), SHAPE)
    batches = [make_prompts(3, b, 20, 200) for b in args.batch]
    engines = {"graphs": {}, "decode graphs only": {"prefill_graphs": False}, "eager": {"enforce_eager": True}}
    outs = {name: run(model, batches, **kw) for name, kw in engines.items()}
    names = list(engines)
    for x in range(len(names)):
        for y in range(x + 1, len(names)):
            print(f"== {names[x]} vs {names[y]}")
            for b, (ox, oy) in zip(args.batch, zip(outs[names[x]], outs[names[y]])):
                for s, (a, c) in enumerate(zip(ox, oy)):
                    verdict = first_difference(a, c)
                    if verdict != "identical" or s == 0:
                        print(f"  batch {b} sequence {s}: {verdict}")


if __name__ == "__main__":
    main()
