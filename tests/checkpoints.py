"""Builds small checkpoints (random weights) of each supported family and a small BPE tokenizer
for tests, and `cpu_llm`, the engine constructor of every test not marked `gpu`.

transformers' own classes (Qwen3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3MoeForCausalLM) write the checkpoints, so the files have exactly the names, shapes and
config keys that real checkpoints have (in transformers 5's spelling; `rewrite_config_published`
turns one into the published spelling); they are also the reference the engine's tokens are
checked against.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

# Words the test tokenizer is trained on; enough variety for a few hundred merges.
_CORPUS_WORDS = (
    "the quick brown fox jumps over a lazy dog while paged attention stores keys and values "
    "in blocks of tokens so that prefix caching can share them between requests and the "
    "scheduler batches prefill and decode steps continuously until every sequence finishes"
).split()
TEST_VOCAB_SIZE = 384


@dataclass(frozen=True)
class TinyShape:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1024
    vocab_size: int = TEST_VOCAB_SIZE


def build_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TEST_VOCAB_SIZE, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    lines = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(path)


def build_checkpoint(path: str, shape: TinyShape = TinyShape(), seed: int = 0,
                     max_shard_size: str | None = None, eos_token_id: int | list[int] = 0) -> str:
    """Write a random-weight Qwen3 checkpoint plus the test tokenizer to `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, rms_norm_eps=1e-6,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
        # Larger init than the 0.02 default so logits are spread and argmax ties are rare.
        initializer_range=0.2,
    )
    return _save_checkpoint(path, Qwen3ForCausalLM(config), max_shard_size)


@dataclass(frozen=True)
class LlamaShape:
    """A tiny Llama 3: llama3-scaled RoPE whose original context (64) is shorter than the
    prompts tests use, so all three wavelength bands of the scaling matter."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = 32  # None: config.json has no head_dim (hidden / heads, as Llama 3.1 8B)
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 512
    vocab_size: int = TEST_VOCAB_SIZE
    rope_theta: float = 500000.0
    rope_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 64
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    initializer_range: float = 0.2  # weights' std: large, so logits are spread and argmax ties rare


@dataclass(frozen=True)
class Qwen2Shape:
    """A tiny Qwen2 / Qwen2.5 (q/k/v biases always; head_dim = hidden / heads)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1024
    vocab_size: int = TEST_VOCAB_SIZE
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.2  # weights' std: large, so logits are spread and argmax ties rare


# Std of the random biases written into checkpoints (transformers initialises them to zero,
# which would leave a bias bug invisible); about the weights' scale (initializer_range).
BIAS_STD = 0.2


def _save_family_checkpoint(path: str, model, seed: int, max_shard_size: str | None = None) -> str:
    """Randomise `model`'s biases, save it in float32 with the test tokenizer."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * BIAS_STD)
    return _save_checkpoint(path, model, max_shard_size)


def _save_checkpoint(path: str, model, max_shard_size: str | None) -> str:
    """Save `model` in float32 (in shards of at most `max_shard_size` when given) with the test tokenizer."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(torch.float32).eval().save_pretrained(path, **kwargs)
    build_tokenizer(path)
    return path


def build_llama_checkpoint(path: str, shape: LlamaShape = LlamaShape(), seed: int = 0,
                           max_shard_size: str | None = None, eos_token_id: int | list[int] = 0) -> str:
    """Write a random-weight Llama 3 checkpoint (llama3 RoPE scaling) plus the test tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=head_dim,
        max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=shape.tie_word_embeddings,
        rms_norm_eps=shape.rms_norm_eps, attention_bias=shape.attention_bias, mlp_bias=shape.mlp_bias,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": shape.rope_factor,
            "low_freq_factor": shape.low_freq_factor, "high_freq_factor": shape.high_freq_factor,
            "original_max_position_embeddings": shape.original_max_position_embeddings,
        },
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, initializer_range=shape.initializer_range,
    )
    _save_family_checkpoint(path, LlamaForCausalLM(config), seed, max_shard_size)
    if shape.head_dim is None:
        rewrite_config(path, head_dim=None)
    return path


def build_qwen2_checkpoint(path: str, shape: Qwen2Shape = Qwen2Shape(), seed: int = 0,
                           max_shard_size: str | None = None, eos_token_id: int | list[int] = 0) -> str:
    """Write a random-weight Qwen2 checkpoint (random q/k/v biases) plus the test tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, initializer_range=shape.initializer_range,
    )
    return _save_family_checkpoint(path, Qwen2ForCausalLM(config), seed, max_shard_size)


@dataclass(frozen=True)
class MoeShape:
    """A tiny Qwen3-MoE: 8 experts of width 32, 2 per token, in every layer but `mlp_only_layers`
    and those `decoder_sparse_step` skips (those run a dense MLP of width intermediate_size)."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1024
    vocab_size: int = TEST_VOCAB_SIZE
    initializer_range: float = 0.2  # weights' std: large, so logits are spread and argmax ties rare


def build_moe_checkpoint(path: str, shape: MoeShape = MoeShape(), seed: int = 0,
                         max_shard_size: str | None = None, eos_token_id: int | list[int] = 0) -> str:
    """Write a random-weight Qwen3-MoE checkpoint plus the test tokenizer. transformers keeps the
    experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and
    writes one tensor per expert and projection, as published checkpoints have them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
        norm_topk_prob=shape.norm_topk_prob, decoder_sparse_step=shape.decoder_sparse_step,
        mlp_only_layers=list(shape.mlp_only_layers), max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings, rms_norm_eps=1e-6,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, initializer_range=shape.initializer_range,
    )
    return _save_checkpoint(path, Qwen3MoeForCausalLM(config), max_shard_size)


Shape = TinyShape | LlamaShape | Qwen2Shape | MoeShape
# The builder of each shape's family.
_BUILDERS = {TinyShape: build_checkpoint, LlamaShape: build_llama_checkpoint, Qwen2Shape: build_qwen2_checkpoint,
             MoeShape: build_moe_checkpoint}


def build_shaped_checkpoint(path: str, shape: Shape, seed: int = 0, max_shard_size: str | None = None) -> str:
    """Write a random-weight checkpoint of `shape`'s family (Qwen3, Llama 3, Qwen2, Qwen3-MoE)."""
    return _BUILDERS[type(shape)](path, shape, seed=seed, max_shard_size=max_shard_size)


def rewrite_checkpoint_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a checkpoint's *.safetensors files by one file holding `tensors`."""
    from safetensors.torch import save_file

    for name in os.listdir(path):
        if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
            os.remove(os.path.join(path, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))


def rewrite_config_published(path: str) -> None:
    """Rewrite a saved config.json (transformers 5: `rope_parameters`, `dtype`) into the spelling of
    published checkpoints: top-level `rope_theta`, `rope_scaling` (the scaling keys, or null for
    plain RoPE) and `torch_dtype`."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    cfg["torch_dtype"] = cfg.pop("dtype")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def cpu_llm(model: str, **kwargs):
    """An engine on the CPU, for every test not marked `gpu`: with CUDA present, LLM()
    would otherwise size a KV cache from most of the card and capture decode graphs."""
    from nanovllm import LLM

    return LLM(model, device="cpu", **kwargs)


def checkpoint_fixture(name: str, shape: Shape = TinyShape(), seed: int = 0):
    """A module-scoped fixture giving build_shaped_checkpoint(shape, seed) in a temporary folder
    named after `name`, built once per test module. A test module assigns it: `ckpt = checkpoint_fixture(...)`."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory) -> str:
        return build_shaped_checkpoint(str(tmp_path_factory.mktemp(name)), shape, seed=seed)

    return checkpoint


def checkpoint_params_fixture(shapes: dict[str, Shape], max_shard_sizes: dict[str, str] | None = None):
    """A module-scoped fixture parametrized over `shapes` (test id -> shape): each one's checkpoint,
    in a temporary folder named after its id, sharded where `max_shard_sizes` names it."""
    shard = max_shard_sizes or {}

    @pytest.fixture(scope="module", params=list(shapes))
    def checkpoint(request, tmp_path_factory) -> str:
        path = str(tmp_path_factory.mktemp(request.param))
        return build_shaped_checkpoint(path, shapes[request.param], max_shard_size=shard.get(request.param))

    return checkpoint


def lazy_checkpoints_fixture(shapes: dict[str, Shape]):
    """A module-scoped fixture giving get(name, seed=0) -> the path of shapes[name]'s checkpoint
    built with `seed`, each built on first use (in a folder named after name and a non-zero seed)."""

    @pytest.fixture(scope="module")
    def checkpoints(tmp_path_factory):
        built: dict[tuple[str, int], str] = {}

        def get(name: str, seed: int = 0) -> str:
            if (name, seed) not in built:
                folder = str(tmp_path_factory.mktemp(f"{name}{seed or ''}"))
                built[name, seed] = build_shaped_checkpoint(folder, shapes[name], seed=seed)
            return built[name, seed]

        return get

    return checkpoints


def reference_fixture():
    """A module-scoped fixture giving load_reference(ckpt) (`ckpt`: the module's checkpoint fixture)."""

    @pytest.fixture(scope="module")
    def reference(ckpt):
        return load_reference(ckpt)

    return reference


def gpu_reference_fixture():
    """A module-scoped fixture giving transformers' bf16 model of `ckpt` (sdpa attention) on CUDA."""

    @pytest.fixture(scope="module")
    def reference(ckpt):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, attn_implementation="sdpa")
        return model.cuda().eval()

    return reference


def cpu_llm_fixture(**kwargs):
    """A module-scoped fixture giving cpu_llm(ckpt, **kwargs) (`ckpt`: the module's checkpoint
    fixture), exited after the module's tests. A test module assigns it: `llm = cpu_llm_fixture(...)`."""

    @pytest.fixture(scope="module")
    def engine(ckpt):
        llm = cpu_llm(ckpt, **kwargs)
        yield llm
        llm.exit()

    return engine


def make_sequence(seq_id: int, prompt: list[int], params, **kwargs):
    """A Sequence as the engine builds a request's sample 0: the request's id its own, the params'
    seed and max_tokens (set), `kwargs` the rest (rules, wants_prompt_logprobs)."""
    from nanovllm.engine.sequence import Sequence

    return Sequence(seq_id, prompt, params, request_id=seq_id, seed=params.seed, max_tokens=params.max_tokens,
                    **kwargs)


def make_prompts(seed: int, n: int, lo: int, hi: int, vocab: int = TEST_VOCAB_SIZE) -> list[list[int]]:
    """n prompts of random ids in [1, vocab) with lengths in [lo, hi), the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(1, vocab, (L,), generator=g).tolist() for L in lens]


def complete_tokens(llm, prompts, params) -> list[list[int]]:
    """The token ids of each prompt's completion from `llm`, checked to be whole: one output per
    prompt, and the completion of a request nothing but its length can end (ignore_eos, no stop
    strings, stop ids or grammar) as long as max_tokens (less only where max_model_len ends it: one
    token past a full prompt), so a check of its tokens cannot pass on a truncated or empty one."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts)
    for i, out in enumerate(outs):
        sp = params[i] if isinstance(params, (list, tuple)) else params
        if (sp.ignore_eos and sp.max_tokens is not None and not sp.stop and not sp.stop_token_ids
                and sp.structured_outputs is None):
            room = max(1, llm.config.max_model_len - len(out.prompt_token_ids))
            assert len(out.outputs[0].token_ids) == min(sp.max_tokens, room), (i, len(out.outputs[0].token_ids))
    return [o["token_ids"] for o in outs]


def generate_tokens(path: str, prompts, params, **kwargs):
    """(token ids of each prompt, whole: complete_tokens; the exited engine) from a CPU engine with
    16-token blocks and max_model_len 512 unless kwargs say otherwise."""
    llm = cpu_llm(path, **{"kvcache_block_size": 16, "max_model_len": 512, **kwargs})
    try:
        return complete_tokens(llm, prompts, params), llm
    finally:
        llm.exit()


def check_greedy_tokens(path: str, prompts, params) -> None:
    """generate_tokens' completions (ignore_eos greedy `params`) have max_tokens tokens each, every one
    an argmax of transformers' logits."""
    outs, _ = generate_tokens(path, prompts, params)
    reference = load_reference(path)
    for prompt, out in zip(prompts, outs):
        assert len(out) == params.max_tokens
        assert_greedy_matches_reference(reference, prompt, out)


def check_scheduling_regimes(path: str, prompts, params, preempt_blocks: int) -> list[list[int]]:
    """Without the prefix cache the tokens are transformers' greedy ones; with the cache (which
    must hit), with 16-token prefill chunks, and with `preempt_blocks` KV blocks (which must
    preempt) they are the same. Returns them."""
    baseline, _ = generate_tokens(path, prompts, params, enable_prefix_caching=False)
    reference = load_reference(path)
    for prompt, out in zip(prompts, baseline):
        assert_greedy_matches_reference(reference, prompt, out)
    cached, llm = generate_tokens(path, prompts, params)
    assert cached == baseline
    assert llm.block_manager.num_prefix_hit_blocks > 0
    chunked, _ = generate_tokens(path, prompts, params, max_num_batched_tokens=16)
    assert chunked == baseline
    preempted, llm = generate_tokens(path, prompts, params, num_kvcache_blocks=preempt_blocks)
    assert preempted == baseline
    assert llm.scheduler.num_preemptions > 0
    return baseline


def load_reference(path: str):
    """transformers' model of the checkpoint's architecture, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def rewrite_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@torch.no_grad()
def assert_greedy_matches_reference(reference, prompt_ids: list[int], completion: list[int], atol: float = 1e-4) -> None:
    """Every generated token must be an argmax (up to float ties) of the reference's logits; an
    empty completion fails (nothing was checked)."""
    assert completion, "empty completion"
    ids = torch.tensor([prompt_ids + completion])
    logits = reference(ids).logits[0].float()  # [len, vocab]
    for i, token in enumerate(completion):
        row = logits[len(prompt_ids) - 1 + i]
        best = row.max().item()
        assert row[token].item() >= best - atol, (
            f"token {i} ({token}) has logit {row[token].item():.6f}, argmax {row.argmax().item()} has {best:.6f}"
        )


# A bf16 engine's token passes if the reference's logit for it is within this fraction of the
# row's logit range of the maximum (bf16 rounding moves near-ties; a wrong token is far off).
BF16_TOLERANCE = 0.02


@torch.no_grad()
def assert_bf16_greedy_matches(reference, prompt_ids: list[int], completion: list[int]) -> None:
    """Every generated token is an argmax of the reference's logits within BF16_TOLERANCE; an empty
    completion fails (nothing was checked)."""
    assert completion, "empty completion"
    device = next(reference.parameters()).device
    logits = reference(torch.tensor([prompt_ids + completion], device=device)).logits[0].float()
    for i, tok in enumerate(completion):
        row = logits[len(prompt_ids) - 1 + i]
        tol = BF16_TOLERANCE * (row.max() - row.min()).item()
        assert row[tok] >= row.max() - tol, f"position {i}: token {tok} logit {row[tok]:.4f} vs max {row.max():.4f}"


# GPU engines of the tests get a KV cache sized for what the tests run, not 90% of the card, and
# decode graphs up to the largest batch a test decodes (48: 6 graph sizes), not 512 (35 sizes).
GPU_KV_TOKENS = 16384  # the largest workload: 48 prompts of < 200 tokens + 32 generated
GPU_MAX_NUM_SEQS = 48
# The GPU engines' longest sequence (gpu_generate; served_len caps it by the checkpoint's positions).
GPU_MAX_MODEL_LEN = 2048
# Token budget per step (prefill / mixed graphs are captured up to it): above every prompt there.
GPU_MAX_STEP_TOKENS = 1024
# The GPU tests' Qwen3: Qwen3-0.6B's attention geometry (16 q heads, 8 kv heads, head_dim 128) at a small width.
GPU_SHAPE = TinyShape(hidden_size=256, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=512, max_position_embeddings=4096)


def served_len(path: str, at_most: int) -> int:
    """`at_most`, or the checkpoint's max_position_embeddings where that is smaller (a larger
    max_model_len is refused)."""
    with open(os.path.join(path, "config.json")) as f:
        return min(at_most, json.load(f)["max_position_embeddings"])


def gpu_generate(path: str, batches, params, **kwargs):
    """(token ids of each batch's prompts, facts about the engine) from one bf16 CUDA engine that
    runs the batches one after the other; test-sized KV cache and graph sets unless kwargs say
    otherwise."""
    from nanovllm import LLM

    kw = {"kvcache_block_size": 16, "max_model_len": served_len(path, GPU_MAX_MODEL_LEN), "dtype": "bfloat16",
          "max_num_seqs": GPU_MAX_NUM_SEQS, "max_num_batched_tokens": GPU_MAX_STEP_TOKENS, **kwargs}
    kw.setdefault("num_kvcache_blocks", GPU_KV_TOKENS // kw["kvcache_block_size"])
    llm = LLM(path, **kw)
    try:
        outs = [complete_tokens(llm, ps, params) for ps in batches]
        facts = {"backend": llm.model_runner.backend.name, "graphs": llm.model_runner.graphs is not None,
                 "dtype": next(llm.model_runner.model.parameters()).dtype,
                 "prefill_graphs": llm.model_runner.varlen_graphs is not None,
                 "preemptions": llm.scheduler.num_preemptions,
                 "prefix_hits": llm.block_manager.num_prefix_hit_blocks}
        return outs, facts
    finally:
        llm.exit()


def check_gpu_regimes(path: str, reference, ps, params, regimes: dict[str, dict], **common) -> None:
    """Each scheduling regime (gpu_generate keywords by name) gives the reference's bf16 greedy
    tokens; the "preempt" regime must preempt and the "prefix-cache" one must hit the cache."""
    for name, kw in regimes.items():
        (outs,), facts = gpu_generate(path, [ps], params, **common, **kw)
        if name == "preempt":
            assert facts["preemptions"] > 0
        if name == "prefix-cache":
            assert facts["prefix_hits"] > 0
        for p, o in zip(ps, outs):
            assert_bf16_greedy_matches(reference, p, o)


def whole_text(tokenizer, ids: list[int], **decode_options) -> str:
    """The text of completion tokens `ids`: the decode of its longest prefix that does not end inside
    a character (tokens that do add no text, as in vLLM's incremental text)."""
    return next(text for j in range(len(ids), -1, -1)
                if not (text := tokenizer.decode(ids[:j], **decode_options)).endswith("\ufffd"))
