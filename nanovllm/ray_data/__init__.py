"""Data-parallel generation on Ray Data: a dataset of prompts spread over engine replicas.

    import ray.data
    from nanovllm.ray_data import LLMPredictor

    ds = ray.data.read_json("prompts.jsonl")                  # a "prompt", "prompt_token_ids" or "messages" column
    ds = ds.map_batches(LLMPredictor, fn_constructor_kwargs=dict(model="path/to/Qwen3-0.6B",
                        sampling_params={"temperature": 0, "max_tokens": 64}),
                        compute=ray.data.ActorPoolStrategy(size=4), batch_size=256, num_gpus=1)

Each actor of the pool holds one `LLM` (tensor-parallel over its GPUs when `num_gpus` > 1) and
hands each batch to one `generate` call (predictor.py). `python -m nanovllm.ray_data` does the same
from JSON lines on the command line (__main__.py). Ray is an optional extra: `import nanovllm`
never imports it, and this package says how to install it when it is missing.
"""

try:
    import ray  # noqa: F401
    import ray.data  # noqa: F401  (pyarrow and pandas: the "data" extra of ray)
except ImportError as err:
    raise ImportError(
        f"nanovllm.ray_data needs Ray Data ({err}): pip install 'nanovllm[ray]'"
    ) from err

from nanovllm.ray_data.predictor import LLMPredictor

__all__ = ["LLMPredictor"]
