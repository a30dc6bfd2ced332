"""An FP8 KV cache's per-layer scales from the checkpoint, when it has them.

compressed-tensors checkpoints (llm-compressor's; vLLM reads the same) declare the cache's
quantization in config.json, `quantization_config.kv_cache_scheme` (e.g. {"num_bits": 8,
"type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true}; quant_method "fp8" checkpoints write
"static"), and hold one scalar per layer:

    model.layers.N.self_attn.k_scale, model.layers.N.self_attn.v_scale
    (older FP8 checkpoints: model.layers.N.self_attn.k_proj.output_scale, v_proj.output_scale; the
    oldest, AutoFP8's first FP8-KV releases: one model.layers.N.self_attn.kv_scale for both, which
    vLLM reads as k_scale = v_scale = kv_scale; the other spellings vLLM's maybe_remap_kv_scale_name
    maps: ModelOpt's self_attn.k_proj.k_scale / v_proj.v_scale, self_attn.qkv_proj.k_scale / v_scale;
    and vLLM's own parameter names self_attn.attn.k_scale / v_scale, which vLLM leaves unread)

with our meaning: read value = fp8 * scale. Checkpoints calibrated for FP8 attention also hold the
query's and the softmax output's scales (self_attn.q_scale / prob_scale, quant_method "fp8" ones
self_attn.q_proj.output_scale / prob_output_scale), which vLLM takes for its FP8 attention backends
only; attention here runs in the compute dtype, so nothing reads them. The weight loader skips all of
these names whatever the cache (models/decoder.py's `ignored_checkpoint_name` asks
`is_attention_scale_name`); an FP8 cache's
scales (engine/kv_cache.KvScales) are read with `load_kv_scales`. Only the safetensors headers are scanned for
the names; only the scale tensors are read (a PyTorch pickle is loaded memory-mapped).
"""

from __future__ import annotations

import math
import re

from nanovllm.utils.checkpoint_files import checkpoint_files, open_checkpoint

# A layer's K / V scale under each spelling (the module docstring's); group "kv": the cache(s) it scales.
_SCALE_NAME = re.compile(r"^model\.layers\.(?P<layer>\d+)\.self_attn\.(?:(?:attn\.)?(?P<kv>kv|[kv])_scale"
                         r"|(?P<proj>[kv])_proj\.(?:output|(?P=proj))_scale|qkv_proj\.(?P<qkv>[kv])_scale)$")
# The query's and the softmax output's scales (FP8 attention's): skipped, never read.
_UNUSED_SCALE_NAME = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:(?:attn\.)?(?:q|prob)_scale"
                                r"|q_proj\.output_scale|prob_output_scale)$")
# The one kv_cache_scheme the cache can take its scales from: 8-bit floats (e4m3), one scale per tensor.
_FP8_SCHEME = {"num_bits": 8, "type": "float"}
# The scheme's strategy the cache takes: one scale per layer ("attn_head", one per KV head, is not).
_TENSOR_STRATEGY = "tensor"
# kv_cache_scheme spelled as a name: "static" (the checkpoint holds the scales) or "dynamic" (it does not).
_SCHEME_NAMES = ("static", "dynamic")


def is_attention_scale_name(name: str) -> bool:
    """A KV-cache scale (read by an FP8 cache) or a query / softmax scale (never read): the module docstring's."""
    return _SCALE_NAME.match(name) is not None or _UNUSED_SCALE_NAME.match(name) is not None


def load_kv_scales(path: str, num_layers: int, quantization_config: dict | None) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale) from the checkpoint in `path` (its config.json's
    `quantization_config`: Config.checkpoint_quantization); None when it has none (and declares no static
    kv_cache_scheme): the engine then computes them from the data. ValueError names a
    kv_cache_scheme other than 8-bit float, symmetric, per tensor, scales missing for some layers, or a scale
    that is not one positive finite number."""
    scheme = (quantization_config or {}).get("kv_cache_scheme")
    if isinstance(scheme, dict):
        if any(scheme.get(k) != v for k, v in _FP8_SCHEME.items()):
            raise ValueError(f"checkpoint {path!r}: kv_cache_scheme {scheme!r} is not an FP8 (8-bit float) cache; "
                             f"kv_cache_dtype='fp8' takes scales from {_FP8_SCHEME} schemes only")
        strategy = scheme.get("strategy", _TENSOR_STRATEGY)
        if strategy != _TENSOR_STRATEGY:
            raise ValueError(f"checkpoint {path!r}: kv_cache_scheme strategy {strategy!r} is not supported (only "
                             f"{_TENSOR_STRATEGY!r}: kv_cache_dtype='fp8' takes one k_scale / v_scale a layer)")
        if not scheme.get("symmetric", True):
            raise ValueError(f"checkpoint {path!r}: kv_cache_scheme symmetric={scheme['symmetric']!r} (a zero point "
                             "besides each scale) is not supported: kv_cache_dtype='fp8' takes symmetric scales only")
        static = not scheme.get("dynamic", False)
    elif scheme in _SCHEME_NAMES:  # quant_method "fp8" checkpoints (AMD's, AutoFP8's) name it
        static = scheme == "static"
    elif scheme is None:
        static = False
    else:
        raise ValueError(f"checkpoint {path!r}: kv_cache_scheme {scheme!r} is not a compressed-tensors scheme "
                         f"(a dict) nor one of {_SCHEME_NAMES}")
    found: dict[tuple[int, str], float] = {}
    for file in checkpoint_files(path):
        with open_checkpoint(file) as f:
            for name in f.keys():
                m = _SCALE_NAME.match(name)
                if m is None:
                    continue
                t = f.get_tensor(name)
                value = float(t.float().reshape(-1)[0]) if t.numel() == 1 else math.nan
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"checkpoint {path!r}: {name} must be one positive finite number, "
                                     f"got shape {tuple(t.shape)} {t.flatten()[:4].tolist()}")
                for kv in m.group("kv") or m.group("proj") or m.group("qkv"):  # "kv": one scale for both
                    found[(int(m.group("layer")), kv)] = value
    if not found:
        if static:
            raise ValueError(f"checkpoint {path!r} declares kv_cache_scheme {scheme!r} but holds no "
                             "model.layers.N.self_attn.k_scale / v_scale tensors")
        return None
    missing = [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(num_layers) for kv in "kv"
               if (i, kv) not in found]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"checkpoint {path!r} has some KV-cache scales but not all (a layer's k_scale and "
                         f"v_scale, or one kv_scale for both): missing {shown}")
    return [(found[(i, "k")], found[(i, "v")]) for i in range(num_layers)]
