"""FP8 checkpoints for the tests, written here from full-precision ones in the published layouts,
with quantization written out independently of nanovllm (loops over blocks, rows, tensors).

    qwen-block      quant_method "fp8", weight_block_size [128, 128]: `weight_scale_inv` per block
    qwen-tensor     quant_method "fp8" without a block size: `weight_scale` per tensor
    ct-channel      compressed-tensors, `weight_scale` [out, 1] per channel, dynamic per-token activations
    ct-tensor       compressed-tensors, `weight_scale` [1] per tensor, static `input_scale` [1]
                    (calibrated on the dequantized model: `input_scales`)
    ct-block        compressed-tensors as llm-compressor's FP8_BLOCK preset writes it: `weight_scale` per
                    [128, 128] block, dynamic activations per 1 x 128 group
    fbgemm          quant_method "fbgemm_fp8" (Meta's *-FP8 releases): `weight_scale` [out, 1] per channel,
                    dynamic per-token activations whose amax is bounded by activation_scale_ub
    modelopt        NVIDIA ModelOpt quant_algo "FP8" in hf_quant_config.json (config.json without a
                    quantization_config): `weight_scale` [] per tensor, static `input_scale` [];
                    exclude_modules may hold wildcards ("model.layers.1.mlp*")
    modelopt-channel  ModelOpt "FP8_PER_CHANNEL_PER_TOKEN" in config.json (quant_method "modelopt"):
                    `weight_scale` [out] per channel, dynamic per-token activations
    modelopt-block  ModelOpt "FP8_PB_WO" in config.json: `weight_scale` [out/128, 1, in/128, 1] per block,
                    run with dynamic 1 x 128 activation groups (as vLLM runs it)

`write_fp8(src, dst, ref, layout, skip)` writes the FP8 checkpoint to `dst` and, to `ref`, the
same model with every quantized weight replaced by its dequantized value (fp8 x scale): the
transformers reference. Before quantizing, each projection weight is multiplied by log-normal
row and column factors, so blocks, rows and tensors get scales far apart (a scale applied to
the wrong block changes the logits).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
TINY = 1e-12  # the scale of an all-zero block
# The projections a layout quantizes (the router `mlp.gate`, embeddings, norms, lm_head stay).
PROJECTION = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight")
# Static activation scales: this many times the largest input seen on CALIBRATION_PROMPTS random
# prompts of CALIBRATION_TOKENS tokens (headroom for the tests' other prompts).
INPUT_MARGIN = 2.0
CALIBRATION_PROMPTS, CALIBRATION_TOKENS = 4, 128
# Spread (std of the log) of the row and column factors the projections are multiplied by.
SPREAD = 0.7
# The fbgemm layout's activation_scale_ub (Meta's releases: 1200.0): on the GPU tests' model, the largest
# ~1% of down_proj's input rows (amax up to ~9,800; median ~1,300) pass it, no other projection's.
FBGEMM_AMAX_UB = 5000.0

LAYOUTS = {
    "qwen-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [BLOCK, BLOCK]},
    "qwen-tensor": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"},
    "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
    "ct-tensor": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
    "ct-block": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "dynamic": False, "symmetric": True,
                    "block_structure": [BLOCK, BLOCK]},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": BLOCK,
                              "dynamic": True}}}},
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": FBGEMM_AMAX_UB},
    "modelopt": {"producer": {"name": "modelopt", "version": "0.31.0"},
                 "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}},
    "modelopt-channel": {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
    "modelopt-block": {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"},
}
SCALE_NAMES = {"qwen-block": "weight_scale_inv", "qwen-tensor": "weight_scale", "ct-channel": "weight_scale",
               "ct-tensor": "weight_scale", "ct-block": "weight_scale", "fbgemm": "weight_scale",
               "modelopt": "weight_scale", "modelopt-channel": "weight_scale", "modelopt-block": "weight_scale"}
# Layouts of per-channel scales ([out, 1]; ModelOpt's [out]).
CHANNEL_LAYOUTS = ("ct-channel", "fbgemm", "modelopt-channel")
# Layouts of per-tensor weight scales with static per-tensor input scales.
STATIC_LAYOUTS = ("ct-tensor", "modelopt")
# ModelOpt writes this file beside a config.json without quantization_config.
MODELOPT_FILE = "hf_quant_config.json"
# Layouts of [128, 128] block scales (activations then quantized per 1 x 128 group).
BLOCK_LAYOUTS = ("qwen-block", "ct-block", "modelopt-block")


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scales [ceil(N/128), ceil(K/128)]), block by block."""
    w = w.float()
    n, k = w.shape
    gn, gk = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    q = torch.empty(n, k, dtype=FP8)
    s = torch.empty(gn, gk)
    for i in range(gn):
        for j in range(gk):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s[i, j] = max(block.abs().max().item() / E4M3_MAX, TINY)
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = to_fp8(block / s[i, j])
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = q.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= s[i, j]
    return out


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8, scales [N, 1]), row by row."""
    w = w.float()
    q, s = torch.empty(w.shape, dtype=FP8), torch.empty(w.shape[0], 1)
    for i, row in enumerate(w):
        s[i, 0] = max(row.abs().max().item() / E4M3_MAX, TINY)
        q[i] = to_fp8(row / s[i, 0])
    return q, s


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    s = torch.tensor([max(w.abs().max().item() / E4M3_MAX, TINY)])
    return to_fp8(w / s[0]), s


def quantized(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, its scale in the layout's shape, the dequantized float32 weight)."""
    if layout in BLOCK_LAYOUTS:
        q, s = quantize_blocks(w)
        return q, (s[:, None, :, None] if layout == "modelopt-block" else s), dequantize_blocks(q, s)
    if layout in CHANNEL_LAYOUTS:
        q, s = quantize_channels(w)
        return q, (s.reshape(-1) if layout == "modelopt-channel" else s), q.float() * s
    q, s = quantize_tensor(w)
    return q, (s.reshape(()) if layout in ("qwen-tensor", "modelopt") else s), q.float() * s[0]


def spread(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Each projection weight times log-normal row and column factors (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if PROJECTION.fullmatch(name):
            rows = torch.exp(SPREAD * torch.randn(t.shape[0], 1, generator=gen))
            cols = torch.exp(SPREAD * torch.randn(1, t.shape[1], generator=gen))
            t = t * rows * cols
        out[name] = t
    return out


def skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether a skip entry names `name`'s module: "re:" regexes, ModelOpt's wildcards, else whole dotted names."""
    module = name.rsplit(".", 1)[0]
    return any(re.match(e[3:], module) if e.startswith("re:") else fnmatch.fnmatchcase(module, e)
               if any(c in e for c in "*?[") else f".{e}." in f".{module}." for e in skip)


def _copy_dir(src: str, dst: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if src != dst and not name.endswith(".safetensors") and not name.endswith(".safetensors.index.json"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    if quantization_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = quantization_config
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)


def checkpoint_state(path: str) -> dict[str, torch.Tensor]:
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


def quantize_state(state: dict[str, torch.Tensor], layout: str,
                   skip: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the FP8 checkpoint's tensors, the dequantized full-precision ones; no input scales)."""
    fp8, ref = {}, {}
    for name, t in state.items():
        if not PROJECTION.fullmatch(name) or skipped(name, skip):
            fp8[name] = ref[name] = t
            continue
        q, s, dq = quantized(t, layout)
        module = name.rsplit(".", 1)[0]
        fp8[name], fp8[f"{module}.{SCALE_NAMES[layout]}"], ref[name] = q, s, dq
    return fp8, ref


@torch.no_grad()
def input_scales(ref: str, modules: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """Static activation scales as a calibration would set them: INPUT_MARGIN x the largest |input|
    each module of `modules` sees in transformers' model at `ref` on random prompts, / 448."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    amax = {m: 0.0 for m in modules}
    hooks = [module.register_forward_pre_hook(lambda mod, args, name=name: amax.__setitem__(
        name, max(amax[name], args[0].abs().max().item()))) for name, module in model.named_modules() if name in amax]
    gen = torch.Generator().manual_seed(seed)
    model(torch.randint(1, model.config.vocab_size, (CALIBRATION_PROMPTS, CALIBRATION_TOKENS), generator=gen))
    for hook in hooks:
        hook.remove()
    return {f"{m}.input_scale": torch.tensor([INPUT_MARGIN * a / E4M3_MAX]) for m, a in amax.items()}


def write_fp8(src: str, dst: str, ref: str, layout: str, skip: tuple[str, ...] = (), seed: int = 0) -> None:
    """The FP8 checkpoint of `src` (projections spread first) in `dst`, its dequantized twin in `ref`."""
    fp8, dequantized = quantize_state(spread(checkpoint_state(src), seed), layout, skip)
    _copy_dir(src, ref, dequantized, None)
    if layout in STATIC_LAYOUTS:  # static activation scales (unused on CPU: activations stay full precision)
        scales = input_scales(ref, [n.rsplit(".", 1)[0] for n, t in fp8.items() if t.dtype == FP8])
        fp8.update({n: s.reshape(()) if layout == "modelopt" else s for n, s in scales.items()})
    config = copy.deepcopy(LAYOUTS[layout])
    if layout == "modelopt":  # hf_quant_config.json beside config.json, which gets no quantization_config
        config["quantization"]["exclude_modules"] = list(skip)
        _copy_dir(src, dst, fp8, None)
        with open(os.path.join(dst, MODELOPT_FILE), "w") as f:
            json.dump(config, f)
        return
    key = "ignore" if layout.startswith(("ct-", "modelopt-")) else "modules_to_not_convert"
    _copy_dir(src, dst, fp8, {**config, key: list(skip)})


def write_state(src: str, dst: str, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None) -> None:
    """`src`'s checkpoint directory with `tensors` as its weights (and a quantization_config)."""
    _copy_dir(src, dst, tensors, quantization_config)


# Packed projections share one static input scale in the engine: the largest of their parts'.
PACKED_PARTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 on the grid of `scale` (broadcast against x), back in x's dtype."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).float().mul(scale).to(x.dtype)


def _dynamic_quantize(x: torch.Tensor, group: int | None, amax_ub: float | None = None) -> torch.Tensor:
    """x [..., K] rounded to e4m3 with amax / 448 scales per token (group None) or per `group`
    columns (K a multiple of it), the scales computed in float32; `amax_ub`: amax taken at most this."""
    g = x if group is None else x.unflatten(-1, (-1, group))
    amax = g.float().abs().amax(-1, keepdim=True)
    amax = amax if amax_ub is None else amax.clamp(max=amax_ub)
    scale = (amax.double() / E4M3_MAX).float().clamp(min=TINY)
    q = _fake_quantize(g, scale)
    return q if group is None else q.flatten(-2)


def quantize_activations(model: torch.nn.Module, fp8_dir: str, layout: str) -> list:
    """Forward pre-hooks on `model`'s projections (not lm_head) that round each input to e4m3 as
    the FP8 checkpoint at `fp8_dir` (`layout`) prescribes: per 1 x 128 group (block layouts), per
    token (ct-channel; fbgemm with its amax bound), or with the static input scale (ct-tensor,
    packed parts sharing their largest). Run in float32 on the dequantized weights, this is exactly
    what the FP8 engine computes, without its bf16 roundings. Returns the hook handles."""
    static = {}
    if layout in STATIC_LAYOUTS:
        from safetensors.torch import load_file

        for f in sorted(os.listdir(fp8_dir)):
            if f.endswith(".safetensors"):
                static.update({k[: -len(".input_scale")]: v.float().reshape(())
                               for k, v in load_file(os.path.join(fp8_dir, f)).items() if k.endswith(".input_scale")})

    def static_scale(name: str) -> torch.Tensor:
        base, part = name.rsplit(".", 1)
        parts = next((p for p in PACKED_PARTS if part in p), (part,))
        return max(static[f"{base}.{p}"] for p in parts)

    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not PROJECTION.fullmatch(f"{name}.weight"):
            continue
        if layout in STATIC_LAYOUTS:
            hook = (lambda mod, args, s=static_scale(name): (_fake_quantize(args[0], s.to(args[0].device)),))
        else:
            group = BLOCK if layout in BLOCK_LAYOUTS else None
            ub = LAYOUTS[layout].get("activation_scale_ub")
            hook = (lambda mod, args, g=group, ub=ub: (_dynamic_quantize(args[0], g, ub),))
        hooks.append(module.register_forward_pre_hook(hook))
    return hooks
