"""config.json's quantization_config and LLM(quantization=...) read into a QuantConfig (quantization/config.py).

`resolve_quantization(LLM(quantization=...), config.json's quantization_config)` reads one of

    Qwen / DeepSeek fine-grained FP8   quant_method "fp8": e4m3 weights, `weight_scale_inv` per
                                       [128, 128] block (weight_block_size) or, without a block
                                       size, `weight_scale` per tensor; activation_scheme
                                       "dynamic" (or "static": per-tensor `input_scale`);
                                       modules_to_not_convert stay full precision
    compressed-tensors FP8             quant_method "compressed-tensors", format "float-quantized"
                                       (or "naive-quantized", older releases' name; the group's
                                       own format, where it has one, over the top-level one):
                                       config groups (their targets: quantization/config.py), each of 8-bit float
                                       weights with `weight_scale` per tensor, per output channel
                                       or per [128, 128] block; activations dynamic (per token, group or
                                       tensor: quantized per token, or per 1 x 128 group beside block
                                       weights) or static per tensor (`input_scale`); `ignore` stays
                                       full precision;
                                       no config group (a calibrated FP8 KV cache alone):
                                       full-precision weights; online transforms
                                       (transform_config) and sparse storage are refused
    Meta's FBGEMM FP8                  quant_method "fbgemm_fp8" (meta-llama/*-FP8 releases):
                                       `weight_scale` [out, 1] per output channel, activations
                                       dynamic per token with each row's amax taken at most
                                       activation_scale_ub (an outlier token saturates);
                                       modules_to_not_convert stay full precision; MoE experts
                                       are refused (quantization/config.expert_quant)
    NVIDIA ModelOpt FP8                quant_method "modelopt" (nvidia/*-FP8 releases), in config.json
                                       or, without a quantization_config there, in hf_quant_config.json
                                       beside it (`checkpoint_quantization`); quant_algo "FP8":
                                       `weight_scale` per tensor, static per-tensor `input_scale`;
                                       "FP8_PER_CHANNEL_PER_TOKEN": `weight_scale` [out] per channel,
                                       dynamic per-token activations; "FP8_PB_WO": `weight_scale`
                                       [out/128, 1, in/128, 1] per block, run as vLLM runs it (dynamic
                                       1 x 128 activation groups); exclude_modules (ignore) stay
                                       full precision, matched as vLLM matches them (whole names and
                                       wildcards); kv_cache_quant_algo "FP8": the checkpoint's
                                       k_proj.k_scale / v_proj.v_scale serve an FP8 cache
    online FP8                         LLM(quantization="fp8") on a full-precision checkpoint:
                                       weights quantized at load, one scale per output channel
                                       (amax / 448), activations dynamic per token

into a QuantConfig; any other quant_method, quant_algo or quantization value is a ValueError naming
it (`quantization_method` names the pair as vLLM's ModelConfig.quantization does).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re

from nanovllm.kernels.checks import FP8_BLOCK, check_amax_ub
from nanovllm.quantization.config import (
    BLOCK, CHANNEL, ONLINE, REGEX_PREFIX, SCALE, SCALE_INV, TENSOR, Fp8Format, QuantConfig, QuantGroup,
)

# The values LLM(quantization=...) takes.
QUANTIZATION_CHOICES = (None, "fp8", "compressed-tensors", "fbgemm_fp8", "modelopt")
# Of those, the names of a checkpoint's own format (no online form): they must match its quant_method.
CHECKPOINT_FORMATS = ("compressed-tensors", "fbgemm_fp8", "modelopt")
# quant_method values of config.json's quantization_config that load.
SUPPORTED_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8", "modelopt")
# compressed-tensors' activation strategy of one scale per row and 1 x group_size columns.
GROUP = "group"
# The compressed-tensors formats that hold FP8 weights as they are (older releases write the second).
FP8_FORMATS = ("float-quantized", "naive-quantized")
# ModelOpt (NVIDIA's *-FP8 releases, e.g. nvidia/Llama-3.1-8B-Instruct-FP8) writes its quantization to
# this file beside config.json, which then has no quantization_config: read as full precision, the
# checkpoint's FP8 tensors were refused one at a time as unknown weights.
MODELOPT_FILE = "hf_quant_config.json"
# The producer name ModelOpt writes into a quantization_config (`producer.name`), without quant_method.
MODELOPT = "modelopt"
# ModelOpt's FP8 quant_algo values that load, and their formats.
MODELOPT_FORMATS = {"FP8": Fp8Format(TENSOR, SCALE, True, False),
                    "FP8_PER_CHANNEL_PER_TOKEN": Fp8Format(CHANNEL, SCALE, False, False),
                    "FP8_PB_WO": Fp8Format(BLOCK, SCALE, False, False)}
# ModelOpt's one KV-cache quantization an FP8 cache takes (per-layer k / v scales).
MODELOPT_KV = "FP8"
# Characters that make a ModelOpt exclude_modules entry a wildcard (fnmatch's), not a module name.
WILDCARD_CHARS = "*?["


def _field(cfg: dict, key: str, allowed: tuple, default: object, source: str) -> object:
    value = cfg.get(key, default)
    if value not in allowed:
        raise ValueError(f"{source}: {key}={value!r} is not supported (supported: {', '.join(map(repr, allowed))})")
    return value


def _module_names(cfg: dict, key: str, source: str) -> tuple[str, ...]:
    entries = cfg.get(key) or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ValueError(f"{source}: {key} must be a list of module names, got {entries!r}")
    for entry in entries:
        if entry.startswith(REGEX_PREFIX):
            try:
                re.compile(entry[len(REGEX_PREFIX):])
            except re.error as e:
                raise ValueError(f"{source}: {key} entry {entry!r} is not a regular expression: {e}") from e
    return tuple(entries)


def _block_size(value: object, key: str, source: str) -> None:
    if not isinstance(value, (list, tuple)) or list(value) != [FP8_BLOCK, FP8_BLOCK]:
        raise ValueError(f"{source}: {key}={value!r} is not supported (only [{FP8_BLOCK}, {FP8_BLOCK}])")


def _fp8_method(cfg: dict, source: str) -> QuantConfig:
    """quant_method "fp8" (Qwen's and DeepSeek's FP8 checkpoints, vLLM's Fp8Config)."""
    _field(cfg, "fmt", ("e4m3",), "e4m3", source)
    static = _field(cfg, "activation_scheme", ("dynamic", "static"), "dynamic", source) == "static"
    block = cfg.get("weight_block_size")
    if block is not None:
        _block_size(block, "weight_block_size", source)
        if static:
            raise ValueError(f"{source}: activation_scheme='static' with weight_block_size is not supported")
    fmt = Fp8Format(BLOCK if block is not None else TENSOR, SCALE_INV if block is not None else SCALE, static, False)
    skip = _module_names(cfg, "modules_to_not_convert", source) + _module_names(cfg, "ignored_layers", source)
    return QuantConfig((QuantGroup(fmt),), skip)


def _fbgemm_fp8(cfg: dict, source: str) -> QuantConfig:
    """quant_method "fbgemm_fp8" (Meta's FP8 releases, vLLM's FBGEMMFp8Config): both keys required, as vLLM
    reads them."""
    for key in ("activation_scale_ub", "modules_to_not_convert"):
        if key not in cfg:
            raise ValueError(f"{source}: a fbgemm_fp8 quantization_config needs {key}")
    check_amax_ub(f"{source}: activation_scale_ub", cfg["activation_scale_ub"])
    fmt = Fp8Format(CHANNEL, SCALE, False, False, float(cfg["activation_scale_ub"]))
    return QuantConfig((QuantGroup(fmt),), _module_names(cfg, "modules_to_not_convert", source))


def _modelopt(cfg: dict, source: str) -> QuantConfig:
    """NVIDIA ModelOpt FP8 (vLLM's ModelOptFp8Config): hf_quant_config.json's nesting ({"producer": ...,
    "quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}) or config.json's flat
    spelling (quant_method "modelopt", quant_algo, kv_cache_scheme, ignore)."""
    nested = cfg.get("quantization")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"{source}: quantization must be an object, got {nested!r}")
        algo, kv = nested.get("quant_algo"), nested.get("kv_cache_quant_algo")
        skip_key, where = "exclude_modules", nested
    else:
        algo, kv, skip_key, where = cfg.get("quant_algo"), None, "ignore", cfg  # kv_cache_scheme: utils/kv_scales.py
    if not isinstance(algo, str) or algo.upper() not in MODELOPT_FORMATS:
        raise ValueError(f"{source}: ModelOpt quant_algo={algo!r} is not supported (supported: "
                         f"{', '.join(map(repr, MODELOPT_FORMATS))})")
    if kv is not None and (not isinstance(kv, str) or kv.upper() != MODELOPT_KV):
        raise ValueError(f"{source}: ModelOpt kv_cache_quant_algo={kv!r} is not supported (supported: None, "
                         f"{MODELOPT_KV!r})")
    skip = tuple(REGEX_PREFIX + fnmatch.translate(e) if any(c in e for c in WILDCARD_CHARS) else e
                 for e in _module_names(where, skip_key, source))
    return QuantConfig((QuantGroup(MODELOPT_FORMATS[algo.upper()]),), skip)


def _compressed_tensors(cfg: dict, source: str) -> QuantConfig:
    """quant_method "compressed-tensors" with FP8 weights (RedHat's / llm-compressor's FP8)."""
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: config_groups must map group names to quantization schemes, got {groups!r}")
    return QuantConfig(tuple(_compressed_tensors_group(cfg, source, name, group) for name, group in groups.items()),
                       _module_names(cfg, "ignore", source))


def _compressed_tensors_group(cfg: dict, source: str, name: str, group: object) -> QuantGroup:
    """Config group `name` of compressed-tensors config `cfg`."""
    where = f"{source}: config_groups.{name}"
    if not isinstance(group, dict):  # e.g. {"FP8_DYNAMIC": ["Linear"]}: a preset's name and its targets
        raise ValueError(f"{where} must be a quantization scheme (targets, weights, input_activations), got "
                         f"{group!r}")
    if group.get("format") is not None:  # the group's own format stands over the top-level one (vLLM)
        _field(group, "format", FP8_FORMATS, None, where)
    else:
        _field(cfg, "format", FP8_FORMATS, None, source)
    targets = _module_names(group, "targets", where)
    if not targets:
        raise ValueError(f"{where}: targets={group.get('targets')!r} names no module to quantize")
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    for key, value in (("num_bits", 8), ("type", "float"), ("symmetric", True), ("dynamic", False)):
        _field(weights, key, (value,), value, f"{where}.weights")
    scales = _field(weights, "strategy", (TENSOR, CHANNEL, BLOCK), None, f"{where}.weights")
    if scales == BLOCK:
        _block_size(weights.get("block_structure"), "block_structure", f"{where}.weights")
    if not isinstance(acts, dict):
        raise ValueError(f"{where}: weight-only FP8 (no input_activations) is not supported")
    for key, value in (("num_bits", 8), ("type", "float")):
        _field(acts, key, (value,), value, f"{where}.input_activations")
    strategy = _field(acts, "strategy", ("token", GROUP, TENSOR), None, f"{where}.input_activations")
    dynamic = acts.get("dynamic")
    if not isinstance(dynamic, bool) or (not dynamic and strategy != TENSOR):
        raise ValueError(f"{where}.input_activations: strategy {strategy!r} with dynamic={dynamic!r} is not "
                         f"supported (dynamic per token, group or tensor; static per tensor)")
    if not dynamic and scales == BLOCK:
        raise ValueError(f"{where}: static activations with block weights are not supported")
    if strategy == GROUP:  # llm-compressor's FP8_BLOCK: the 1 x 128 groups block weights take anyway
        if scales != BLOCK or acts.get("group_size") != FP8_BLOCK:
            raise ValueError(f"{where}.input_activations: strategy 'group' is supported with block weights and "
                             f"group_size {FP8_BLOCK} only, got weights {scales!r}, group_size "
                             f"{acts.get('group_size')!r}")
    return QuantGroup(Fp8Format(scales, SCALE, not dynamic, False), targets)


def _no_transforms_or_sparse_storage(cfg: dict, source: str) -> None:
    """A ValueError naming what a compressed-tensors config holds beyond quantization that the
    tensors cannot be read without: online transforms (`transform_config`: rotations applied around
    the layers at run time) and sparsity compressed on disk (`sparsity_config` in a format other
    than "dense", e.g. "sparse-24-bitmask"). Empty ones, as compressed-tensors writes them, pass."""
    transform = cfg.get("transform_config")
    if transform and (not isinstance(transform, dict) or transform.get("config_groups", transform)):
        raise ValueError(f"{source}: transform_config={transform!r} (online transforms) is not supported")
    sparsity = cfg.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format") != "dense"):
        fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        raise ValueError(f"{source}: sparsity_config format={fmt!r} is not supported (only 'dense': weights "
                         f"stored whole)")


def checkpoint_method(checkpoint: dict) -> object:
    """config.json's quant_method as vLLM reads it: any case, and compressed_tensors (compressed-tensors'
    own older spelling) for compressed-tensors."""
    method = checkpoint.get("quant_method")
    producer = checkpoint.get("producer")
    if method is None and isinstance(producer, dict) and producer.get("name") == MODELOPT:
        return MODELOPT  # ModelOpt's own spelling, without quant_method (vLLM names it so)
    return method.lower().replace("compressed_tensors", "compressed-tensors") if isinstance(method, str) else method


def calibrated_fp8_kv(checkpoint: dict | None) -> bool:
    """Whether a ModelOpt checkpoint calibrated an FP8 KV cache (kv_cache_quant_algo "FP8", or config.json's
    flat kv_cache_scheme of static 8-bit floats): kv_cache_dtype="auto" then means that cache, as vLLM
    resolves it (utils/torch_utils.resolve_kv_cache_dtype_string); other checkpoints' "auto" is 16-bit."""
    if not isinstance(checkpoint, dict) or checkpoint_method(checkpoint) != MODELOPT:
        return False
    nested = checkpoint.get("quantization")
    if isinstance(nested, dict):
        kv = nested.get("kv_cache_quant_algo")
        return isinstance(kv, str) and kv.upper() == MODELOPT_KV
    scheme = checkpoint.get("kv_cache_scheme")
    return (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
            and scheme.get("dynamic") is False)


def checkpoint_quantization(model_dir: str, config_json: dict | None) -> tuple[dict | None, str]:
    """The checkpoint's quantization config and the file it is read from: config.json's
    quantization_config (`config_json`), else ModelOpt's hf_quant_config.json beside it (NVIDIA's
    FP8 releases write theirs there; vLLM reads both); (None, config.json) for neither."""
    config_path, path = os.path.join(model_dir, "config.json"), os.path.join(model_dir, MODELOPT_FILE)
    if config_json is not None or not os.path.isfile(path):
        return config_json, config_path
    try:
        with open(path) as f:
            return json.load(f), path
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file: {e}") from e


def quantization_method(quantization: str | None, checkpoint: dict | None) -> str | None:
    """vLLM's ModelConfig.quantization of a pair resolve_quantization took: the checkpoint's method
    where config.json has a quantization_config ("fp8", "compressed-tensors": what loads), else
    LLM(quantization=...) (None: full precision)."""
    return quantization if checkpoint is None else checkpoint_method(checkpoint)


def resolve_quantization(quantization: object, checkpoint: object, source: str) -> QuantConfig | None:
    """The QuantConfig of LLM(quantization=...) and config.json's quantization_config (None:
    full precision). A checkpoint that is FP8 already loads as it is, also under "fp8"."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    if checkpoint is None:
        if quantization in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization={quantization!r} names a checkpoint's own format, but {source} has "
                             "no quantization_config")
        return QuantConfig((QuantGroup(ONLINE),), ()) if quantization == "fp8" else None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{source}: quantization_config must be an object, got {checkpoint!r}")
    method = checkpoint_method(checkpoint)
    if quantization in CHECKPOINT_FORMATS and method != quantization:  # it names the checkpoint's own (vLLM)
        raise ValueError(f"quantization={quantization!r} does not match {source}'s quantization_config "
                         f"quant_method={method!r}")
    if method == "fp8":
        return _fp8_method(checkpoint, source)
    if method == "fbgemm_fp8":
        return _fbgemm_fp8(checkpoint, source)
    if method == MODELOPT:
        return _modelopt(checkpoint, source)
    if method == "compressed-tensors":
        _no_transforms_or_sparse_storage(checkpoint, source)
        if not checkpoint.get("config_groups"):
            # No weight scheme, so full-precision weights (vLLM's reading too): a calibrated FP8 KV cache alone
            # (utils/kv_scales.py reads it), which llm-compressor writes as config_groups {} (format "dense").
            return QuantConfig((QuantGroup(ONLINE),), ()) if quantization == "fp8" else None
        return _compressed_tensors(checkpoint, source)
    raise ValueError(f"{source}: quantization_config quant_method={method!r} is not supported "
                     f"(supported: {', '.join(map(repr, SUPPORTED_METHODS))}, FP8 weights)")
