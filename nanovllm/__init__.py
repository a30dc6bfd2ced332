"""nanovllm: a compact offline LLM inference engine.

    from nanovllm import LLM, SamplingParams
    llm = LLM("path/to/Qwen3")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=64))
    outputs[0].outputs[0].text                          # vLLM's RequestOutput (also outputs[0]["text"])
"""

from nanovllm.inputs import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "TokensPrompt", "TextPrompt"]
