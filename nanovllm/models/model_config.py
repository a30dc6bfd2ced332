"""The model shape read from a checkpoint's config.json, in both spellings on the hub.

Published checkpoints write `rope_theta`, `rope_scaling` (the scaling keys, or null) and
`torch_dtype` at top level; transformers 5 writes `rope_parameters` (rope_theta and the scaling
keys in one dict) and `dtype`. Both are read, to the same ModelConfig. The architecture must be
one of MODEL_MODULES (models/registry.py builds it); RoPE must be plain, or scaled as
layers/rope_scaling.py serves it (llama3, linear, yarn).

A mixture-of-experts architecture (MOE_ARCHITECTURES) also carries `moe`, its router
and expert shape. Its expert count is `num_experts` in published configs and
`num_local_experts` in transformers 5's (its attribute map renames it on save); both are read.

Why not transformers' AutoConfig (tried with transformers 5.24 on benchmarks/configs/*): it reads
both spellings to one (rope_parameters, dtype, num_experts), which would remove ~12 lines here, but
it fills a key the file lacks with its family's default (a Qwen3-MoE config.json without
vocab_size or moe_intermediate_size reads as 151,936 and 768), where this parser names the missing
key; it needs `model_type` (the raw dicts tests and benchmarks pass have none) and transformers >= 5
(4.x keeps rope_theta / rope_scaling apart, and pyproject allows 4.56); and it takes 0.80 ms
against 0.02 ms for Llama 3.1 8B's config.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field

import torch

from nanovllm.layers.rope_scaling import RopeScaling, parse_rope_scaling
from nanovllm.utils.checkpoint_files import read_json_object

# architecture name (= class name) -> module defining it
MODEL_MODULES = {
    "Qwen3ForCausalLM": "nanovllm.models.qwen3",
    "LlamaForCausalLM": "nanovllm.models.llama",
    "MistralForCausalLM": "nanovllm.models.llama",
    "Qwen2ForCausalLM": "nanovllm.models.qwen2",
    "Qwen3MoeForCausalLM": "nanovllm.models.qwen3_moe",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_MODULES)
# Architectures whose config.json carries a mixture-of-experts section (ModelConfig.moe).
MOE_ARCHITECTURES = frozenset({"Qwen3MoeForCausalLM"})


def resolve_architecture(architectures: object, source: str) -> str:
    """The first of config.json's `architectures` that is supported; ValueError naming them and
    listing the supported ones otherwise (`source` names the file in the message)."""
    names = architectures if isinstance(architectures, list) else []
    for name in names:
        if name in MODEL_MODULES:
            return name
    raise ValueError(
        f"{source}: unsupported architecture {architectures!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


# The dtype names LLM(dtype=...) accepts -> torch dtypes (config.json's may name any floating-point one: from_dict).
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The weights' dtype in config.json, in the order read: transformers 5 writes `dtype`, 4 wrote `torch_dtype`.
_DTYPE_KEYS = ("dtype", "torch_dtype")
# The MLP activation every supported family uses (SwiGLU's gate).
_HIDDEN_ACT = "silu"
# transformers' default theta when a config names none.
_DEFAULT_ROPE_THETA = 10000.0
# max_position_embeddings where a config names none: transformers' default of the family's config
# class (published configs set it), 32768 for the Qwen families.
_DEFAULT_POSITIONS = 32768
_DEFAULT_POSITIONS_OF = {"LlamaForCausalLM": 2048, "MistralForCausalLM": 131072}
# head_dim where a config names none: hidden_size / num_attention_heads, except where the family's
# config class has a default of its own (Qwen3Config's 128, which transformers and vLLM both read).
_DEFAULT_HEAD_DIM_OF = {"Qwen3ForCausalLM": 128}
# The expert count's spellings: published configs, then transformers 5's (attribute_map).
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts")
# The sliding windows of the families whose transformers config class has one (sliding_window, 4096 where
# config.json has no such key): Mistral's attention reads it in every layer; Qwen2's, Qwen3's and Qwen3-MoE's
# only under use_sliding_window (false where absent), Qwen3-MoE's then in every layer (its config class has no
# max_window_layers or layer_types, though the published Qwen3-MoE configs write max_window_layers: 48 of 48
# layers in Qwen3-30B-A3B's), Qwen2's and Qwen3's in the layers layer_types names, else in those from
# max_window_layers (28 where absent) on.
_DEFAULT_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28
_WINDOW_FLAG_FAMILIES = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
_WINDOW_IN_EVERY_LAYER = frozenset({"MistralForCausalLM", "Qwen3MoeForCausalLM"})


@dataclass(frozen=True)
class MoeConfig:
    """Router and expert shape of a mixture-of-experts decoder (Qwen3-MoE's config keys)."""

    num_experts: int
    num_experts_per_tok: int  # top-k experts each token is routed to
    moe_intermediate_size: int  # one expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...]  # ... and i is not listed here (those keep the dense MLP)

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` (0-based) routes to experts; the others run the
        dense MLP of width intermediate_size (transformers' Qwen3MoeDecoderLayer rule)."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int  # config.json's (max_positions: with the scaling's)
    tie_word_embeddings: bool
    attention_bias: bool  # config.json's key (a family may fix its biases regardless: models/qwen2.py)
    mlp_bias: bool
    torch_dtype: torch.dtype  # config.json's: the weights' saved dtype, any floating-point one (float64, float8_e4m3fn)
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None  # None: every layer's MLP is dense
    # Keys more than this many positions back are masked (Mistral's sliding_window; Qwen2's, Qwen3's and
    # Qwen3-MoE's when use_sliding_window: _sliding_window): served only where max_model_len <= it, where
    # it masks nothing (config.Config). None: full attention.
    sliding_window: int | None = None
    # config.json's quantization_config as written (None: none there); Config.checkpoint_quantization takes it,
    # or ModelOpt's hf_quant_config.json beside it (quantization/checkpoint_config.checkpoint_quantization).
    quantization_config: dict | None = field(default=None, compare=False)

    @property
    def max_positions(self) -> int:
        """Positions the model serves: max_position_embeddings, or what its RoPE scaling extends it to
        (vLLM's derived maximum length: layers/rope_scaling.py)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return self.rope_scaling.max_positions(self.max_position_embeddings)

    def sparse_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose MLP routes to experts (none for a dense model)."""
        if self.moe is None:
            return ()
        return tuple(i for i in range(self.num_hidden_layers) if self.moe.is_sparse(i))

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> "ModelConfig":
        """The model directory's config.json, its keys replaced by `overrides` where given (vLLM's
        hf_overrides)."""
        source = os.path.join(path, "config.json") + (f" with hf_overrides {sorted(overrides)}" if overrides else "")
        return cls.from_dict(read_config_json(path, overrides), source=source)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        architecture = resolve_architecture(raw.get("architectures"), source)
        hidden_act = raw.get("hidden_act", _HIDDEN_ACT)
        if hidden_act != _HIDDEN_ACT:
            raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported (only {_HIDDEN_ACT!r})")
        # transformers 5: rope_parameters holds theta and scaling; published: rope_scaling (or null) and
        # rope_theta. Read as transformers 5 reads them: rope_scaling over rope_parameters, the dict's
        # theta over the top-level one (and where neither has one, rope_parameters': an hf_overrides
        # rope_scaling over a transformers-5 save), and for a scaled type a top-level
        # original_max_position_embeddings over the dict's (Phi-3's spelling), else
        # max_position_embeddings where neither sets it.
        parameters = raw.get("rope_parameters") or {}
        for key, value in (("rope_parameters", parameters), ("rope_scaling", raw.get("rope_scaling") or {})):
            if not isinstance(value, dict):
                raise ValueError(f"{source}: {key} must be an object (or null), got {value!r:.200}")
            if any(isinstance(v, dict) for v in value.values()):  # transformers 5's per-layer-type RoPE (Gemma 3's)
                raise ValueError(f"{source}: {key} nested by layer type {sorted(value)} is not supported (one RoPE "
                                 f"for every layer: rope_theta and the scaling keys in one object)")
        rope = dict(raw.get("rope_scaling") or parameters)
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", parameters.get("rope_theta", _DEFAULT_ROPE_THETA)))
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0:
            raise ValueError(f"{source}: rope_theta must be a positive number, got {rope_theta!r}")
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        if "original_max_position_embeddings" in raw:
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        positions = _positive_int(raw, "max_position_embeddings", source,
                                  _DEFAULT_POSITIONS_OF.get(architecture, _DEFAULT_POSITIONS))
        if partial != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {partial!r} is not supported (only 1.0)")
        dtype_name = next((raw[key] for key in _DTYPE_KEYS if raw.get(key)), "bfloat16")
        # a torch.dtype where hf_overrides gives one (transformers' config takes either)
        stored_dtype = (dtype_name if isinstance(dtype_name, torch.dtype)
                        else getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None)
        if not isinstance(stored_dtype, torch.dtype) or not stored_dtype.is_floating_point:
            raise ValueError(f"{source}: unsupported dtype {dtype_name!r} (not a torch floating-point dtype)")
        rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
        if (isinstance(rms_norm_eps, bool) or not isinstance(rms_norm_eps, (int, float))
                or not 0 < rms_norm_eps < math.inf):
            raise ValueError(f"{source}: rms_norm_eps must be a positive finite number, got {rms_norm_eps!r}")
        try:
            heads = _positive_int(raw, "num_attention_heads", source)
            hidden = _positive_int(raw, "hidden_size", source)
            kv_heads = _positive_int(raw, "num_key_value_heads", source, heads)
            if heads % kv_heads:  # each KV head serves a whole group of query heads
                raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                 f"num_key_value_heads={kv_heads}")
            return cls(
                architecture=architecture,
                vocab_size=_positive_int(raw, "vocab_size", source),
                hidden_size=hidden,
                intermediate_size=_positive_int(raw, "intermediate_size", source),
                num_hidden_layers=_positive_int(raw, "num_hidden_layers", source),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=_head_dim(raw, architecture, hidden, heads, source),
                rms_norm_eps=float(rms_norm_eps),
                rope_theta=float(rope_theta),
                rope_scaling=parse_rope_scaling(rope, positions, source),
                max_position_embeddings=positions,
                tie_word_embeddings=_flag(raw, "tie_word_embeddings", source),
                attention_bias=_flag(raw, "attention_bias", source),
                mlp_bias=_flag(raw, "mlp_bias", source),
                torch_dtype=stored_dtype,
                eos_token_ids=_eos_token_ids(raw.get("eos_token_id"), source),
                moe=_moe(raw, source) if architecture in MOE_ARCHITECTURES else None,
                sliding_window=_sliding_window(raw, architecture, source),
                # older compressed-tensors checkpoints spell it compression_config (vLLM reads both)
                quantization_config=raw.get("quantization_config") or raw.get("compression_config"),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError unless `tp` ranks can split heads and the MLPs evenly (the dense
        MLP's width where a layer is dense, each expert's width where one is sparse); KV heads
        fewer than `tp` are replicated (as vLLM does) where `tp` is a multiple of them."""
        if tp == 1:
            return
        splits = [("num_attention_heads", self.num_attention_heads)]
        if self.num_key_value_heads % tp and tp % self.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_key_value_heads="
                             f"{self.num_key_value_heads}, nor is it a multiple of it (to replicate them)")
        sparse = self.sparse_layers()
        if len(sparse) < self.num_hidden_layers:
            splits.append(("intermediate_size", self.intermediate_size))
        if sparse:
            splits.append(("moe_intermediate_size", self.moe.moe_intermediate_size))
        for name, value in splits:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")


def read_config_json(path: str, overrides: dict | None = None) -> dict:
    """Model directory `path`'s config.json as a dict, its keys replaced by (copies of) `overrides`."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {path!r} has no config.json")
    raw = read_json_object(config_path)
    overrides = overrides or {}
    if overrides.keys() & _DTYPE_KEYS:  # one fact in two spellings: an override of either replaces both
        for key in _DTYPE_KEYS:
            raw.pop(key, None)
    raw.update(copy.deepcopy(overrides))  # readers may edit what they are given (transformers does)
    return raw


def _moe(raw: dict, source: str) -> MoeConfig:
    """The MoE section of a mixture-of-experts config.json; a missing key is a KeyError
    (from_dict names it), an inconsistent value a ValueError naming it."""
    count_key = next((k for k in _NUM_EXPERTS_KEYS if raw.get(k) is not None), _NUM_EXPERTS_KEYS[0])
    layers = raw.get("mlp_only_layers")
    layers = [] if layers is None else layers  # transformers' default; a falsy non-list (false, 0) is refused below
    num_layers = int(raw["num_hidden_layers"])
    if not isinstance(layers, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
        raise ValueError(f"{source}: mlp_only_layers must list layer indices in [0, {num_layers}), got {layers!r}")
    norm_topk_prob = _flag(raw, "norm_topk_prob", source)
    num_experts = _positive_int(raw, count_key, source)
    top_k = _positive_int(raw, "num_experts_per_tok", source)
    width = _positive_int(raw, "moe_intermediate_size", source)
    step = _positive_int(raw, "decoder_sparse_step", source, 1)
    try:
        return MoeConfig(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                         norm_topk_prob=norm_topk_prob, decoder_sparse_step=step, mlp_only_layers=tuple(layers))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _sliding_window(raw: dict, architecture: str, source: str) -> int | None:
    """config.json's attention window where some layer uses it, None for full attention everywhere: as
    transformers' config class of `architecture` reads it (_WINDOW_FLAG_FAMILIES, _WINDOW_IN_EVERY_LAYER),
    or, for a family without a window (Llama), by the keys it has: `layer_types` ("sliding_attention")
    where written, else `use_sliding_window` for the layers from `max_window_layers` on, else every
    layer when a window is given."""
    windowed = architecture in _WINDOW_FLAG_FAMILIES or architecture in _WINDOW_IN_EVERY_LAYER
    window = raw.get("sliding_window", _DEFAULT_WINDOW if windowed else None)
    layer_types = raw.get("layer_types")
    if architecture in _WINDOW_FLAG_FAMILIES and not _flag(raw, "use_sliding_window", source):
        sliding = False
    elif architecture in _WINDOW_IN_EVERY_LAYER:
        sliding = True
    elif isinstance(layer_types, list):
        sliding = "sliding_attention" in layer_types
    elif "use_sliding_window" in raw:
        first = raw.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS if windowed else 0)
        if first is not None and (isinstance(first, bool) or not isinstance(first, int) or first < 0):
            raise ValueError(f"{source}: max_window_layers must be an int >= 0 or null, got {first!r}")
        sliding = _flag(raw, "use_sliding_window", source) and (first is None or first < int(raw["num_hidden_layers"]))
    else:
        sliding = True
    if window is None or not sliding:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{source}: sliding_window must be a positive int or null, got {window!r}")
    return window


def _positive_int(raw: dict, key: str, source: str, default: int | None = None) -> int:
    """config.json's `key`, an int >= 1: with a default, that where the key is missing or null; without, the
    key is required (missing: a KeyError, which from_dict names). Any other value a ValueError naming it."""
    value = raw[key] if default is None else raw.get(key)
    if value is None and default is not None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive int, got {value!r}")
    return value


def _flag(raw: dict, key: str, source: str) -> bool:
    """config.json's boolean `key`, false where it is missing or null (every family's default); any
    value but a JSON boolean is a ValueError naming it (bool() read a hand-edited "false" as true)."""
    value = raw.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _eos_token_ids(eos: object, source: str) -> tuple[int, ...]:
    """config.json's eos_token_id (an id, a list of them, or null) as a tuple of ids."""
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ValueError(f"{source}: eos_token_id must be a token id (an int >= 0) or a list of them, got {eos!r}")
    return tuple(ids)


def _head_dim(raw: dict, architecture: str, hidden: int, heads: int, source: str) -> int:
    """config.json's head_dim; where it has none, the family's default (_DEFAULT_HEAD_DIM_OF: Qwen3's
    128) or else hidden_size / num_attention_heads (Llama 3.1). `hidden` and `heads` are >= 1 (_positive_int)."""
    if raw.get("head_dim"):
        return _positive_int(raw, "head_dim", source)
    if "head_dim" not in raw and architecture in _DEFAULT_HEAD_DIM_OF:
        return _DEFAULT_HEAD_DIM_OF[architecture]
    if hidden % heads:
        raise ValueError(f"{source}: no head_dim, and hidden_size={hidden} is not a multiple of "
                         f"num_attention_heads={heads}")
    return hidden // heads
