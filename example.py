"""Generate completions with nanovllm.

    python example.py                      # the small model shipped in nanovllm/default_model
    python example.py --model ~/Qwen3-0.6B # any Qwen3, Llama 3.x or Qwen2/2.5 checkpoint directory
    python example.py --device cpu         # on the CPU even where CUDA exists

The shipped model completes code; another checkpoint with a chat template answers
questions through llm.chat (its template wraps them), one without completes the code.
"""

from __future__ import annotations

import argparse
import os

from nanovllm import LLM, SamplingParams
from nanovllm.engine.chat import has_chat_template

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nanovllm", "default_model")
# Code prompts for the shipped model (trained on Python's standard library). A prompt
# ending in a space ends in a token the model rarely saw in training, so none does.
CODE_PROMPTS = [
    "def read_config(path):\n",
    "class Stack:\n    def __init__(self",
    "    def __repr__(self):\n        return",
    "import os\nimport sys\n\n\ndef main(",
]
CHAT_PROMPTS = ["introduce yourself", "list all prime numbers within 100"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: CUDA when present")
    args = parser.parse_args()

    llm = LLM(args.model, enforce_eager=args.enforce_eager, max_model_len=1024, device=args.device)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if os.path.realpath(args.model) != os.path.realpath(DEFAULT_MODEL) and has_chat_template(llm.tokenizer):
        prompts = CHAT_PROMPTS
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        prompts = CODE_PROMPTS
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        print("=" * 60)
        print(f"Prompt: {prompt!r}")
        print(f"Completion: {output.outputs[0].text!r}")
    llm.exit()


if __name__ == "__main__":
    main()
