"""FP8 weights on CPU: checkpoints in the published layouts (tests/fp8_checkpoints.py writes them
from transformers' own models), online FP8, update_weights into an FP8 engine (a static-scale one
too, and the scales it refuses), and every setting refused. A float32 CPU engine dequantizes FP8 weights at load and keeps activations in
full precision, so its greedy tokens are transformers' argmaxes on the dequantized weights and
its logprobs that model's, to float32 rounding; the undequantized weights' logprobs are far off
(so a wrong scale cannot pass)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil

import pytest
import torch

from checkpoints import (
    LlamaShape, MoeShape, TinyShape, assert_greedy_matches_reference, cpu_llm, lazy_checkpoints_fixture, load_reference,
    make_prompts, rewrite_config,
)
from fp8_checkpoints import (
    FP8, LAYOUTS, checkpoint_state, quantize_blocks, quantize_channels, quantize_state, spread, write_fp8, write_state,
)
from nanovllm import SamplingParams
from nanovllm.quantization.checkpoint_config import calibrated_fp8_kv, resolve_quantization
from nanovllm.quantization.config import SCALE, TENSOR, Fp8Format, LinearQuant, QuantConfig, QuantGroup
from nanovllm.quantization.fp8 import Fp8Weights
from nanovllm.quantization.loading import QuantizedTensors

# Qwen3 with widths that are not multiples of 128: hidden 192 (1.5 blocks: K of qkv / gate_up,
# rows of o / down), intermediate 320 (2.5 blocks), q 256 and k / v 128 rows (whole blocks).
PARTIAL = TinyShape(hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=320, tie_word_embeddings=False)
LLAMA = LlamaShape(hidden_size=160, intermediate_size=288, tie_word_embeddings=False)
MOE = MoeShape(hidden_size=192, moe_intermediate_size=160, intermediate_size=320, mlp_only_layers=(0,))
SHAPES = {"qwen3": PARTIAL, "llama": LLAMA, "moe": MOE}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
# Engine vs reference logprobs (float32, the same weights): summation order only.
SAME_MODEL_TOL = 2e-3
# The undequantized (spread, full-precision) weights must be at least this far off somewhere.
OTHER_MODEL_GAP = 5e-2
# (family, layout, modules kept in full precision): every layout, a skip list of each kind.
CASES = [
    ("qwen3", "qwen-block", ("model.layers.1.self_attn.o_proj",)),
    ("qwen3", "qwen-tensor", ()),
    ("llama", "ct-channel", ("lm_head", r"re:.*layers\.0\.mlp\.down_proj")),
    ("llama", "ct-tensor", ("lm_head",)),
    ("qwen3", "ct-block", (r"re:.*layers\.1\.self_attn\.o_proj",)),
    ("moe", "qwen-block", ("mlp.gate",)),
    # RedHat's Qwen3-MoE FP8-dynamic releases: per-channel experts, the routers ignored by regex
    ("moe", "ct-channel", ("lm_head", "re:.*mlp.gate$")),
    # Meta's Llama-3.1-*-FP8: whole module names kept (the first and last layers' down_proj, lm_head)
    ("llama", "fbgemm", ("lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj")),
    # NVIDIA's ModelOpt releases: hf_quant_config.json, a wildcard keeping a layer's MLP; the flat config.json form
    ("qwen3", "modelopt", ("lm_head", "model.layers.1.mlp*")),
    ("llama", "modelopt-channel", ("lm_head",)),
    ("moe", "modelopt", ("lm_head", "*.mlp.gate")),  # per-tensor experts (their static input scales unused)
    ("qwen3", "modelopt-block", ("lm_head",)),  # FP8_PB_WO: [out/128, 1, in/128, 1] scales, partial blocks
    ("moe", "modelopt-block", ("lm_head", "*.mlp.gate")),
]


# (family, seed) -> a full-precision checkpoint of it, built on first use.
full_precision = lazy_checkpoints_fixture(SHAPES)


def run(path: str, prompts, **kwargs):
    """The outputs of a float32 CPU engine (16-token blocks)."""
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=256, **kwargs)
    try:
        return llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.exit()


@torch.no_grad()
def logprob_gap(reference, prompt: list[int], out: dict) -> float:
    """The largest |engine logprob - reference log_softmax| over the generated tokens."""
    tokens = out["token_ids"]
    logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    ref = torch.log_softmax(logits, dim=-1)
    return max(abs(entry[t] - ref[i, t].item()) for i, (t, entry) in enumerate(zip(tokens, out["logprobs"])))


def check_against(reference, prompts, outs, other=None) -> None:
    """Tokens are the reference's argmaxes and logprobs its own; `other`'s logprobs are far off."""
    for p, o in zip(prompts, outs):
        assert_greedy_matches_reference(reference, p, o["token_ids"])
        assert logprob_gap(reference, p, o) < SAME_MODEL_TOL
    if other is not None:
        assert max(logprob_gap(other, p, o) for p, o in zip(prompts, outs)) > OTHER_MODEL_GAP


@pytest.mark.parametrize("family,layout,skip", CASES, ids=[f"{f}-{layout}" for f, layout, _ in CASES])
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(full_precision, tmp_path, family, layout, skip):
    src = full_precision(family)
    write_fp8(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), layout, skip)
    write_state(src, str(tmp_path / "spread"), spread(checkpoint_state(src), 0))
    prompts = make_prompts(1, 4, 20, 60)
    outs = run(str(tmp_path / "fp8"), prompts)
    check_against(load_reference(str(tmp_path / "ref")), prompts, outs, load_reference(str(tmp_path / "spread")))


def test_naive_quantized_is_float_quantized_by_its_older_name(full_precision, tmp_path):
    """compressed-tensors' format "naive-quantized" (neuralmagic's Llama-3.1 FP8 releases) holds
    the tensors "float-quantized" does: the same engine."""
    path = str(tmp_path / "fp8")
    write_fp8(full_precision("llama"), path, str(tmp_path / "ref"), "ct-tensor", ("lm_head",))
    prompts = make_prompts(3, 3, 20, 40)
    float_quantized = [o.outputs[0].token_ids for o in run(path, prompts)]
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["format"] = "naive-quantized"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert [o.outputs[0].token_ids for o in run(path, prompts)] == float_quantized
    check_against(load_reference(str(tmp_path / "ref")), prompts, run(path, prompts))


def test_dynamic_per_tensor_activations_load(full_precision, tmp_path):
    """compressed-tensors input_activations {"strategy": "tensor", "dynamic": true} beside FP8
    weights: vLLM takes any dynamic activation strategy there (static ones per tensor only); the
    weights are the checkpoint's either way, so transformers on the dequantized weights is the
    reference. It was refused as needing dynamic=False."""
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8(full_precision("llama"), path, ref, "ct-channel", ("lm_head",))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True, "symmetric": True}
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = acts
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    config = resolve_quantization(None, cfg["quantization_config"], "c")
    assert not config.format_of("model.layers.0.mlp.up_proj").static_input  # no input_scale tensors: dynamic
    prompts = make_prompts(4, 3, 20, 40)
    check_against(load_reference(ref), prompts, run(path, prompts))


def test_config_group_targets_name_the_quantized_modules(full_precision, tmp_path):
    """A compressed-tensors group's targets as vLLM matches them: "Linear" (every linear layer), a
    module's name, or a "re:" regex matched from the name's start; a module no target names stays in
    full precision, as one ignore lists. Here the attention projections (a regex) and one MLP
    projection (by name) are FP8, the other MLP projections full precision. Such configs were
    refused (only ['Linear'])."""
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8(full_precision("llama"), path, ref, "ct-channel",
              ("lm_head", r"re:.*layers\.1\.mlp\.", r"re:.*layers\.0\.mlp\.(gate|up)_proj"))
    state = checkpoint_state(path)
    assert state["model.layers.0.mlp.down_proj.weight"].dtype == state["model.layers.1.self_attn.k_proj.weight"].dtype \
        == torch.float8_e4m3fn != state["model.layers.1.mlp.down_proj.weight"].dtype
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    quant = cfg["quantization_config"]
    quant["ignore"] = []
    quant["config_groups"]["group_0"]["targets"] = [r"re:.*self_attn\.[qkvo]_proj$", "model.layers.0.mlp.down_proj"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    config = resolve_quantization(None, quant, "c")
    assert [config.format_of(n) is None for n in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj",
                                         "model.layers.1.mlp.down_proj", "model.layers.0.mlp.up_proj",
                                         "lm_head")] == [False, False, True, True, True]
    prompts = make_prompts(5, 3, 20, 40)
    check_against(load_reference(ref), prompts, run(path, prompts))


def test_config_groups_each_quantize_the_modules_they_target(full_precision, tmp_path):
    """Several compressed-tensors config groups, as vLLM reads them: a module takes the first group
    with a target naming it (whole name or regex), else the first targeting "Linear". Here the
    attention projections are per-channel FP8 (a regex group listed after the "Linear" one, which
    it stands over for them) and the MLP projections [128, 128]-block FP8. Such configs were
    refused (exactly one group). A packed layer whose parts would take different formats is
    refused naming them."""
    src = full_precision("qwen3")
    attn, attn_ref = quantize_state(spread(checkpoint_state(src), 0), "ct-channel", (r"re:.*\.mlp\.",))
    both, both_ref = quantize_state(attn, "ct-block", (r"re:.*\.self_attn\.",))
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_state(src, ref, {**attn_ref, **{n: t for n, t in both_ref.items() if ".mlp." in n}})
    group = {name: LAYOUTS[name]["config_groups"]["group_0"] for name in ("ct-channel", "ct-block")}
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": group["ct-block"],
                               "group_1": {**group["ct-channel"], "targets": [r"re:.*self_attn\.[qkvo]_proj$"]}}}
    write_state(src, path, both, quant)
    config = resolve_quantization(None, quant, "c")
    assert [config.format_of(f"model.layers.1.{m}").scales for m in ("self_attn.k_proj", "mlp.up_proj")] == \
        ["channel", "block"]
    prompts = make_prompts(6, 3, 20, 40)
    check_against(load_reference(ref), prompts, run(path, prompts))
    quant["config_groups"]["group_1"]["targets"] = [r"re:.*q_proj$"]
    qkv = tuple(f"model.layers.0.self_attn.{m}_proj" for m in "qkv")
    with pytest.raises(ValueError, match=r"packed into one layer, but the quantization config gives them different "
                                         r"formats"):
        resolve_quantization(None, quant, "c").format_for(qkv)


def test_online_fp8_matches_a_reference_quantized_by_hand(full_precision, tmp_path):
    """LLM(quantization="fp8") on a full-precision checkpoint: every projection quantized per
    output channel (amax / 448) at load, as quantize_channels does here."""
    src = full_precision("qwen3")
    state = checkpoint_state(src)
    by_hand = {}
    for name, t in state.items():
        is_projection = name.endswith("_proj.weight")
        by_hand[name] = (lambda q, s: q.float() * s)(*quantize_channels(t)) if is_projection else t
    write_state(src, str(tmp_path / "ref"), by_hand)
    prompts = make_prompts(2, 4, 20, 60)
    outs = run(src, prompts, quantization="fp8")
    check_against(load_reference(str(tmp_path / "ref")), prompts, outs, load_reference(src))


@pytest.mark.parametrize("family", ["qwen3", "moe"])
def test_update_weights_quantizes_like_a_fresh_fp8_engine(full_precision, tmp_path, family):
    """update_weights (full precision, transformers' state dict: fused experts for the MoE) into
    a block-FP8 engine equals an engine loaded from those weights quantized by hand."""
    write_fp8(full_precision(family), str(tmp_path / "a"), str(tmp_path / "ref_a"), "qwen-block")
    other = full_precision(family, seed=1)
    new_state = load_reference(other).state_dict()
    fp8_b, _ = quantize_state(checkpoint_state(other), "qwen-block")
    write_state(other, str(tmp_path / "b"), fp8_b, LAYOUTS["qwen-block"])
    prompts = make_prompts(3, 3, 20, 50)
    expected = run(str(tmp_path / "b"), prompts)
    llm = cpu_llm(str(tmp_path / "a"), kvcache_block_size=16, max_model_len=256)
    try:
        before = llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.update_weights(new_state.items())
        after = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.exit()
    assert [o["token_ids"] for o in before] != [o["token_ids"] for o in expected]
    assert [(o["token_ids"], o["logprobs"]) for o in after] == [(o["token_ids"], o["logprobs"]) for o in expected]


def test_update_weights_refuses_fp8_tensors_and_scales(full_precision, tmp_path):
    write_fp8(full_precision("qwen3"), str(tmp_path / "a"), str(tmp_path / "ref"), "qwen-block")
    fp8 = checkpoint_state(str(tmp_path / "a"))
    name = "model.layers.0.mlp.up_proj"
    llm = cpu_llm(str(tmp_path / "a"), kvcache_block_size=16, max_model_len=256)
    try:
        before = llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=f"{name}.weight'.*full-precision.*float8"):
            llm.update_weights([(f"{name}.weight", fp8[f"{name}.weight"])])
        e5m2 = fp8[f"{name}.weight"].float().to(torch.float8_e5m2)  # an FP8 variant the engine does not hold
        with pytest.raises(ValueError, match=f"{name}.weight'.*full-precision.*float8_e5m2"):
            llm.update_weights([(f"{name}.weight", e5m2)])
        with pytest.raises(ValueError, match=f"{name}.weight_scale_inv'.*full-precision weights only"):
            llm.update_weights([(f"{name}.weight_scale_inv", fp8[f"{name}.weight_scale_inv"])])
        assert llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False) == before
    finally:
        llm.exit()


def test_update_weights_into_a_static_scale_engine(full_precision, tmp_path):
    """A compressed-tensors checkpoint with static activation scales (ct-tensor: per-tensor weight
    scales, `input_scale`): update_weights takes full-precision weights into it, quantized per
    output channel (the engine's own scales; CPU: dequantized, activations full precision), so it
    serves transformers' model on those weights quantized by hand. Input scales given with them are
    refused naming the layer and the real reason (here: the layer uses none; on CUDA: the checkpoint's
    calibration stays, test_static_input_scale_refusal_names_the_layer), where they were refused as
    "their scales are computed here", which no input scale is; nothing changes."""
    fp8_dir = str(tmp_path / "fp8")
    write_fp8(full_precision("llama"), fp8_dir, str(tmp_path / "ref"), "ct-tensor", ("lm_head",))
    other = full_precision("llama", seed=1)
    by_hand = checkpoint_state(other)
    for name in [n for n in by_hand if n.endswith("_proj.weight")]:
        q, s = quantize_channels(by_hand[name])
        by_hand[name] = q.float() * s
    write_state(other, str(tmp_path / "by_hand"), by_hand)
    input_scales = [(n, t) for n, t in checkpoint_state(fp8_dir).items() if n.endswith(".input_scale")]
    assert input_scales
    prompts = make_prompts(7, 3, 20, 50)
    # no prefix cache: the second run computes the same rows in the same steps as the first, so its
    # logprobs are bit-identical on any CPU (a cached prefix changes a CPU GEMM's row count and its rounding)
    llm = cpu_llm(fp8_dir, kvcache_block_size=16, max_model_len=256, enable_prefix_caching=False)
    try:
        llm.update_weights(load_reference(other).state_dict().items())
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        name, scale = input_scales[0]
        layer = name.removesuffix(".input_scale")
        with pytest.raises(ValueError, match=re.escape(f"{name!r}: layer {layer!r} uses no input_scale on this engine")
                           + r".*full-precision weights only, so leave the input scales out"):
            llm.update_weights([(name, scale)])
        assert llm.generate(prompts, GREEDY, use_tqdm=False) == outs
    finally:
        llm.exit()
    check_against(load_reference(str(tmp_path / "by_hand")), prompts, outs, load_reference(str(tmp_path / "ref")))


def test_static_input_scale_refusal_names_the_layer():
    """What update_weights makes of a layer that holds FP8 with a static input scale (CUDA): a
    full-precision weight is quantized with per-channel scales of its own; the layer's input_scale
    is the checkpoint's calibration, kept, so one given is refused saying so (it was refused as
    "their scales are computed here"); a weight scale is refused as computed here."""
    static = LinearQuant(Fp8Format(TENSOR, SCALE, static_input=True, online=False), held=True)
    convert = QuantizedTensors(lambda name: static, update=True, check_fits=lambda name, tensor: None)
    layer = "model.layers.0.self_attn.q_proj"
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    (q_name, q), (s_name, s) = convert(f"{layer}.weight", weight)
    assert (q_name, q.dtype, s_name, tuple(s.shape)) == (f"{layer}.weight", torch.float8_e4m3fn, f"{layer}.weight_scale", (8, 1))
    # e4m3 rounds to nearest: within 2**-4 of a normal value (3 mantissa bits), within half the subnormal
    # step (2**-10, in units of the row's scale) of a value below 2**-6 (an unseeded draw met one once)
    torch.testing.assert_close(q.float() * s, weight, rtol=2**-4, atol=s.max().item() * 2**-10)
    with pytest.raises(ValueError, match=re.escape(
            f"'{layer}.input_scale': layer {layer!r} quantizes its inputs with the checkpoint's static input_scale "
            "(calibration), which update_weights keeps as loaded: it takes full-precision weights only")):
        convert(f"{layer}.input_scale", torch.tensor([0.5]))
    with pytest.raises(ValueError, match=re.escape(f"'{layer}.weight_scale': update_weights takes full-precision "
                                                   f"weights only: the weight scale of layer {layer!r} is computed here")):
        convert(f"{layer}.weight_scale", torch.tensor([0.5]))


def test_update_weights_names_a_misshapen_weight_before_quantizing_it(full_precision):
    """A weight with no columns ([N, 0]) among good ones, into an online-FP8 engine (per-channel
    scales): one ValueError naming its shape, as an unquantized engine gives, and nothing loaded.
    It was quantized first, whose per-row amax raised a bare IndexError."""
    state = load_reference(full_precision("moe")).state_dict()
    llm = cpu_llm(full_precision("moe"), kvcache_block_size=16, max_model_len=256, quantization="fp8")
    try:
        before = llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False)
        good = [(n, torch.zeros_like(t)) for n, t in state.items() if "layers.1.self_attn" in n]
        misshapen = [("model.layers.0.self_attn.q_proj.weight", MOE.num_attention_heads * MOE.head_dim),
                     ("model.layers.0.mlp.down_proj.weight", MOE.hidden_size),
                     ("model.layers.1.mlp.experts.2.up_proj.weight", MOE.moe_intermediate_size)]
        for name, rows in misshapen:
            with pytest.raises(ValueError, match=re.escape(f"weight {name!r}: ") + r".*expected shape .*"
                               + re.escape(f"({rows}, 0)")):
                llm.update_weights([*good, (name, torch.ones(rows, 0))])
        assert llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False) == before
    finally:
        llm.exit()


def test_compression_config_is_read_as_quantization_config(full_precision, tmp_path):
    """Older compressed-tensors checkpoints name the key compression_config; vLLM reads it when
    quantization_config is absent, and so do we (the same tokens as the current spelling)."""
    path = _fp8_dir(full_precision, tmp_path, "ct-channel")
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    with open(os.path.join(old, "config.json")) as f:
        cfg = json.load(f)
    cfg["compression_config"] = cfg.pop("quantization_config")
    with open(os.path.join(old, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompts = make_prompts(6, 2, 10, 30)
    assert [o["token_ids"] for o in run(old, prompts)] == [o["token_ids"] for o in run(path, prompts)]


def test_update_weights_refuses_fused_experts_of_the_wrong_count(full_precision):
    """A fused expert tensor with too few (or too many) experts is refused whole, naming it, as an
    unquantized engine refuses it, before any expert changes (it filled the first experts)."""
    state = load_reference(full_precision("moe")).state_dict()
    prefix = "model.layers.1.mlp.experts"
    gate_up, down = state[f"{prefix}.gate_up_proj"], state[f"{prefix}.down_proj"]
    llm = cpu_llm(full_precision("moe"), kvcache_block_size=16, max_model_len=256, quantization="fp8")
    try:
        before = llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False)
        for name, tensor in ((f"{prefix}.gate_up_proj", gate_up[:-1]), (f"{prefix}.down_proj", down[:-3]),
                             (f"{prefix}.gate_up_proj", torch.cat([gate_up, gate_up[:1]]))):
            with pytest.raises(ValueError, match=re.escape(f"weight {name!r}: experts ") + ".*expected shape"):
                llm.update_weights([(name, torch.ones_like(tensor))])
        assert llm.generate(make_prompts(4, 2, 10, 20), GREEDY, use_tqdm=False) == before
    finally:
        llm.exit()


@pytest.mark.parametrize("family,layout,tp", [("qwen3", "qwen-block", 2), ("qwen3", "ct-tensor", 4),
                                               ("moe", "qwen-block", 4), ("llama", "fbgemm", 2)])
def test_fp8_engine_tensor_parallel_matches_one_rank(full_precision, tmp_path, family, layout, tp):
    """Each rank takes its slice with the right scales. Rank slices off block boundaries: intermediate
    320 over 2 / 4 ranks is 160 / 80 rows (rank boundaries inside 128-row blocks of gate / up, and of
    down's columns), the experts' 160 over 4 ranks 40; at tp=4 the 2 KV heads are replicated (k / v
    rows taken twice); ct-tensor's q / k / v and gate / up carry per-tensor scales of their own (and
    static input scales); fbgemm's [out, 1] channel scales go with their rows. Tokens are one rank's and
    transformers' argmaxes on the dequantized weights."""
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    write_fp8(full_precision(family), path, ref, layout)
    prompts = make_prompts(5, 3, 20, 50)
    one = run(path, prompts)
    many = run(path, prompts, tensor_parallel_size=tp)
    assert [o["token_ids"] for o in one] == [o["token_ids"] for o in many]
    check_against(load_reference(ref), prompts, many)


# ---- refusals ----

def _fp8_dir(full_precision, tmp_path, layout="qwen-block", skip=()):
    path = str(tmp_path / "fp8")
    write_fp8(full_precision("qwen3"), path, str(tmp_path / "ref"), layout, skip)
    return path


@pytest.mark.parametrize("config,message", [
    ({"quant_method": "gptq", "bits": 4},
     "quant_method='gptq' is not supported.*'fp8', 'compressed-tensors', 'fbgemm_fp8', 'modelopt'"),
    ({**LAYOUTS["qwen-block"], "weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\] is not supported"),
    ({**LAYOUTS["qwen-block"], "fmt": "e5m2"}, "fmt='e5m2' is not supported"),
    ({**LAYOUTS["qwen-block"], "activation_scheme": "static"}, "static' with weight_block_size"),
    ({**LAYOUTS["ct-channel"], "format": "pack-quantized"}, "format='pack-quantized' is not supported"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {**LAYOUTS["ct-channel"]["config_groups"]["group_0"],
                                                       "input_activations": None}}}, "weight-only FP8"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {
        **LAYOUTS["ct-channel"]["config_groups"]["group_0"],
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "num_bits=4"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"a": {}, "b": {}}}, "config_groups.a: targets=None names no module"),
    ({**LAYOUTS["ct-channel"], "config_groups": [LAYOUTS["ct-channel"]["config_groups"]["group_0"]]},
     "config_groups must map group names to quantization schemes"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {  # group activations beside channel weights
        **LAYOUTS["ct-channel"]["config_groups"]["group_0"],
        "input_activations": LAYOUTS["ct-block"]["config_groups"]["group_0"]["input_activations"]}}},
     "strategy 'group' is supported with block weights and group_size 128 only, got weights 'channel'"),
    ({**LAYOUTS["ct-block"], "config_groups": {"g": {
        **LAYOUTS["ct-block"]["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64, "dynamic": True}}}},
     "group_size 64"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {  # static activations are per tensor only
        **LAYOUTS["ct-channel"]["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}}}},
     "strategy 'token' with dynamic=False is not supported"),
    ({**LAYOUTS["ct-block"], "config_groups": {"g": {
        **LAYOUTS["ct-block"]["config_groups"]["group_0"],
        "input_activations": LAYOUTS["ct-tensor"]["config_groups"]["group_0"]["input_activations"]}}},
     "static activations with block weights"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {**LAYOUTS["ct-channel"]["config_groups"]["group_0"],
                                                       "targets": []}}}, r"targets=\[\] names no module"),
    ({**LAYOUTS["ct-channel"], "config_groups": {"g": {**LAYOUTS["ct-channel"]["config_groups"]["group_0"],
                                                       "targets": ["re:[bad"]}}}, "targets entry 're:\\[bad'"),
    ({**LAYOUTS["ct-block"], "ignore": ["lm_head", "re:(unclosed"]},
     r"config.json: ignore entry 're:\(unclosed' is not a regular expression"),
    ({**LAYOUTS["qwen-block"], "modules_to_not_convert": ["re:*"]}, "modules_to_not_convert entry 're:\\*'"),
    # a preset's name mapped to its targets (compressed-tensors' shorthand): it crashed on the list
    ({**LAYOUTS["ct-channel"], "config_groups": {"FP8_DYNAMIC": ["Linear"]}},
     r"config_groups.FP8_DYNAMIC must be a quantization scheme .* got \['Linear'\]"),
    # online rotations and bitmask-compressed sparse weights were accepted, then read as plain weights
    ({**LAYOUTS["ct-channel"], "transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "input"}]}}}}, "transform_config=.*hadamard.* is not supported"),
    ({**LAYOUTS["ct-channel"], "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
                                                   "targets": ["Linear"]}},
     "sparsity_config format='sparse-24-bitmask' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {"num_bits": 8, "type": "float"},
      "transform_config": {"config_groups": {"r": {"type": "random-hadamard"}}}}, "transform_config="),
    # fbgemm_fp8: both keys, as vLLM reads them; the bound a positive finite number
    ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": []}, "fbgemm_fp8 quantization_config needs "
                                                                    "activation_scale_ub"),
    (LAYOUTS["fbgemm"], "fbgemm_fp8 quantization_config needs modules_to_not_convert"),
    *[({**LAYOUTS["fbgemm"], "modules_to_not_convert": [], "activation_scale_ub": bad},
       "config.json: activation_scale_ub must be a positive finite number") for bad in (0, -5.0, "1200", None)],
    ({**LAYOUTS["fbgemm"], "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
])
def test_unsupported_quantization_configs_are_refused_naming_them(config, message):
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, config, "config.json")


@pytest.mark.parametrize("layout,spelling", [("ct-channel", "compressed_tensors"), ("ct-block", "Compressed-Tensors"),
                                              ("qwen-block", "FP8")])
def test_quant_method_is_read_as_vllm_reads_it(layout, spelling):
    """vLLM lowercases quant_method and reads compressed_tensors (compressed-tensors' own older
    spelling) as compressed-tensors: the same config, not a refusal."""
    config = {**LAYOUTS[layout], "quant_method": spelling}
    assert resolve_quantization(None, config, "c") == resolve_quantization(None, LAYOUTS[layout], "c")
    if layout.startswith("ct-"):
        assert resolve_quantization("compressed-tensors", config, "c") == resolve_quantization(None, config, "c")


def test_a_group_format_stands_over_the_top_level_one():
    """compressed-tensors writes each group's format beside the top-level one, which reads
    "mixed-precision" where groups differ (or is left out); vLLM takes the group's where it has one.
    Such configs were refused for the top-level value; a group format that is not FP8 is refused
    naming the group."""
    group = LAYOUTS["ct-channel"]["config_groups"]["group_0"]
    plain = resolve_quantization(None, LAYOUTS["ct-channel"], "c")
    for top in ("mixed-precision", None):
        config = {**LAYOUTS["ct-channel"], "format": top,
                  "config_groups": {"group_0": {**group, "format": "float-quantized"}}}
        assert resolve_quantization(None, config, "c") == plain
    config = {**LAYOUTS["ct-channel"], "config_groups": {"group_0": {**group, "format": "pack-quantized"}}}
    with pytest.raises(ValueError, match="config_groups.group_0: format='pack-quantized' is not supported"):
        resolve_quantization(None, config, "c")


def test_empty_transform_and_dense_sparsity_configs_load_as_they_are():
    """compressed-tensors writes transform_config {} and sparsity_config {} without them; sparse
    weights stored "dense" are plain weights: the config of the layout alone."""
    for extra in ({"transform_config": {}, "sparsity_config": {}}, {"transform_config": {"config_groups": {}}},
                  {"sparsity_config": {"format": "dense", "sparsity_structure": "2:4", "targets": ["Linear"]}}):
        for layout in ("ct-channel", "ct-block"):
            config = {**LAYOUTS[layout], **extra}
            assert resolve_quantization(None, config, "c") == resolve_quantization(None, LAYOUTS[layout], "c")


def test_model_config_names_the_quantization_method(full_precision, tmp_path):
    """vLLM's llm.llm_engine.model_config.quantization: the checkpoint's quant_method as vLLM reads it
    ("FP8" is "fp8", compressed_tensors is "compressed-tensors"), else LLM(quantization=...): "fp8"
    online, None for full precision."""
    src = full_precision("qwen3")
    fp8 = str(tmp_path / "fp8")
    write_fp8(src, fp8, str(tmp_path / "ref"), "qwen-tensor")
    with open(os.path.join(fp8, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["quant_method"] = "FP8"
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(cfg, f)
    ct = str(tmp_path / "ct")  # no config group: full-precision weights (a calibrated FP8 KV cache's layout)
    write_state(src, ct, checkpoint_state(src), {"quant_method": "compressed_tensors", "config_groups": {}})
    for path, kwargs, name in [(src, {}, None), (src, {"quantization": "fp8"}, "fp8"), (fp8, {}, "fp8"),
                               (fp8, {"quantization": "fp8"}, "fp8"), (ct, {}, "compressed-tensors"),
                               (ct, {"quantization": "compressed-tensors"}, "compressed-tensors")]:
        llm = cpu_llm(path, kvcache_block_size=16, max_model_len=64, **kwargs)
        try:
            assert llm.llm_engine.model_config.quantization == name, (path, kwargs)
        finally:
            llm.exit()


def test_bad_quantization_settings_are_refused_at_llm(full_precision, tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'fp8', 'compressed-tensors', "
                                         r"'fbgemm_fp8', 'modelopt'\), got 'int8'"):
        cpu_llm(full_precision("qwen3"), quantization="int8")
    # vLLM's name of a compressed-tensors checkpoint's own format: only on such a checkpoint
    with pytest.raises(ValueError, match="quantization='compressed-tensors' names a checkpoint's own format"):
        cpu_llm(full_precision("qwen3"), quantization="compressed-tensors")
    ct = QuantConfig((QuantGroup(Fp8Format("channel", "weight_scale", False, False)),), ())
    assert resolve_quantization("compressed-tensors", LAYOUTS["ct-channel"], "config.json") == \
        resolve_quantization(None, LAYOUTS["ct-channel"], "config.json") == ct
    with pytest.raises(ValueError, match="does not match config.json's quantization_config quant_method='fp8'"):
        resolve_quantization("compressed-tensors", LAYOUTS["qwen-block"], "config.json")
    path = str(tmp_path / "gptq")
    write_state(full_precision("qwen3"), path, checkpoint_state(full_precision("qwen3")),
                {"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method='awq' is not supported"):
        cpu_llm(path)


def test_modelopt_checkpoints_load_as_vllm_reads_them(full_precision, tmp_path):
    """NVIDIA's ModelOpt FP8 releases (nvidia/Llama-3.1-8B-Instruct-FP8) keep their quantization in
    hf_quant_config.json beside a config.json without quantization_config (newer ones in config.json:
    quant_method "modelopt", or producer "modelopt" without it), with weight_scale, input_scale and
    self_attn.k_proj.k_scale / v_proj.v_scale tensors. They were refused; they load as vLLM's
    ModelOptFp8Config reads them (the engines' tokens: test_fp8_checkpoint_matches_transformers_*),
    vLLM's name "modelopt" in model_config.quantization, a calibrated FP8 cache under kv_cache_dtype "auto"
    (as vLLM resolves it) with the checkpoint's KV scales, "bfloat16" keeping a 16-bit one, and every
    other quant_algo or KV algorithm refused naming it."""
    path = str(tmp_path / "modelopt")
    write_fp8(full_precision("qwen3"), path, str(tmp_path / "ref"), "modelopt", ("lm_head",))
    kv = {f"model.layers.{i}.self_attn.{p}_proj.{p}_scale": torch.tensor(0.05 + 0.01 * i)
          for i in range(2) for p in "kv"}
    write_state(path, path, {**checkpoint_state(path), **kv})
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        hf_quant = json.load(f)
    hf_quant["quantization"]["kv_cache_quant_algo"] = "FP8"
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump(hf_quant, f)
    tensor = QuantConfig((QuantGroup(Fp8Format("tensor", "weight_scale", True, False)),), ("lm_head",))
    assert resolve_quantization(None, hf_quant, "h") == resolve_quantization("modelopt", hf_quant, "h") == tensor
    outs = {}
    # kv_cache_dtype "auto" is the calibrated FP8 cache, as vLLM resolves it; "bfloat16" a 16-bit one
    for kwargs in ({}, {"quantization": "modelopt"}, {"kv_cache_dtype": "fp8"},
                   {"kv_cache_dtype": "bfloat16", "dtype": "bfloat16"}):
        llm = cpu_llm(path, kvcache_block_size=16, max_model_len=64, **kwargs)
        try:
            assert llm.llm_engine.model_config.quantization == "modelopt"
            fp8 = kwargs.get("kv_cache_dtype") != "bfloat16"
            assert llm.model_runner.kv_cache.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
            if fp8:  # the checkpoint's k_proj.k_scale / v_proj.v_scale, not computed ones
                scales = [s.item() for pair in llm.model_runner.kv_scales.layers for s in pair]
                assert scales == pytest.approx([0.05, 0.05, 0.06, 0.06])
            outs[str(kwargs)] = llm.generate(make_prompts(2, 2, 10, 20), GREEDY, use_tqdm=False)
        finally:
            llm.exit()
    assert ([o["token_ids"] for o in outs["{}"]] == [o["token_ids"] for o in outs["{'quantization': 'modelopt'}"]]
            == [o["token_ids"] for o in outs["{'kv_cache_dtype': 'fp8'}"]])
    assert not calibrated_fp8_kv({**hf_quant, "quantization": {"quant_algo": "FP8"}})  # no KV algorithm: 16-bit
    assert calibrated_fp8_kv({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "dynamic": False}}) and not calibrated_fp8_kv(LAYOUTS["qwen-block"])
    # config.json's flat form; vLLM names it "modelopt" whether producer or quant_method says so
    flat = {"quant_method": "modelopt", "quant_algo": "fp8", "ignore": ["lm_head", "*.mlp.down_proj"]}
    wild = QuantConfig((QuantGroup(Fp8Format("tensor", "weight_scale", True, False)),),
                       ("lm_head", "re:" + fnmatch.translate("*.mlp.down_proj")))
    assert resolve_quantization(None, flat, "c") == wild
    assert wild.skipped("model.layers.3.mlp.down_proj") and not wild.skipped("model.layers.3.mlp.up_proj")
    assert resolve_quantization(None, LAYOUTS["modelopt-block"], "c").groups[0].fmt.scales == "block"
    for bad, message in [({**flat, "quant_algo": "NVFP4"}, "ModelOpt quant_algo='NVFP4' is not supported"),
                         ({**flat, "quant_algo": None}, "ModelOpt quant_algo=None is not supported"),
                         ({**hf_quant, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}},
                          "ModelOpt kv_cache_quant_algo='NVFP4' is not supported"),
                         ({**hf_quant, "quantization": "FP8"}, "quantization must be an object"),
                         ({**flat, "ignore": "lm_head"}, "ignore must be a list of module names")]:
        with pytest.raises(ValueError, match=message):
            resolve_quantization(None, bad, "c")
    with pytest.raises(ValueError, match="quantization='modelopt' does not match c's quantization_config "
                                         "quant_method='fp8'"):
        resolve_quantization("modelopt", LAYOUTS["qwen-block"], "c")
    block = str(tmp_path / "block")  # FP8_PB_WO's scales are [out/128, 1, in/128, 1]; another 4-D shape is refused
    write_fp8(full_precision("qwen3"), block, str(tmp_path / "block_ref"), "modelopt-block", ("lm_head",))
    state = checkpoint_state(block)
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    state[name] = state[name].reshape(state[name].shape[0], 1, 1, -1)
    write_state(block, block, state)
    with pytest.raises(ValueError, match=re.escape(name) + r": a 4-D block scale must be \[out_blocks, 1, in_blocks, "
                                         r"1\], got \(2, 1, 1, 2\)"):
        cpu_llm(block)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=re.escape(os.path.join(path, "hf_quant_config.json")) + ": not a readable"):
        cpu_llm(path)


def test_float8_weights_into_a_full_precision_model_are_refused(full_precision, tmp_path):
    """FP8 tensors where config.json declares no quantization (none at all: no parameter is
    quantized) are refused naming the first, as a quantized engine refuses one for a module it keeps
    in full precision; they were copied into the full-precision parameters as they were, scale-less
    values, and loaded without a word when no scale tensor followed them."""
    path = _fp8_dir(full_precision, tmp_path)
    state = {n: t for n, t in checkpoint_state(path).items() if not n.endswith(".weight_scale_inv")}
    write_state(path, path, state)
    rewrite_config(path, quantization_config=None)
    with pytest.raises(ValueError, match=re.escape("weight 'model.layers.0.mlp.down_proj.weight' is float8, but its "
                                                   "module is full precision here")):
        cpu_llm(path)


def test_missing_scale_or_weight_is_named(full_precision, tmp_path):
    """By its checkpoint name, alone: the half of a weight / scale pair that came is not listed."""
    path = _fp8_dir(full_precision, tmp_path)
    state = checkpoint_state(path)
    scale = state.pop("model.layers.1.self_attn.k_proj.weight_scale_inv")
    write_state(path, path, state)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.1\.self_attn\.k_proj\.weight_scale_inv$"):
        cpu_llm(path)
    state["model.layers.1.self_attn.k_proj.weight_scale_inv"] = scale
    del state["model.layers.0.mlp.up_proj.weight"]
    write_state(path, path, state)
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.0\.mlp\.up_proj\.weight$"):
        cpu_llm(path)


@pytest.mark.parametrize("layout,scale,message", [
    # PARTIAL's down_proj is [192, 320]: a block grid of ceil(192/128) x ceil(320/128) = 2 x 3
    ("qwen-block", "weight_scale_inv", r"wrong shape \(3, 2\) \(expected \(2, 3\)\)"),
    ("ct-channel", "weight_scale", r"wrong shape \(1, 192\) \(expected \(192, 1\) or \(192,\)\)"),
    ("ct-tensor", "weight_scale", r"wrong shape \(1, 1\) \(expected \(1,\) or \(\)\)"),
])
def test_a_misshapen_scale_is_named_with_the_shape_expected(full_precision, tmp_path, layout, scale, message):
    path = _fp8_dir(full_precision, tmp_path, layout)
    state = checkpoint_state(path)
    name = f"model.layers.0.mlp.down_proj.{scale}"
    state[name] = state[name].reshape(-1, 1).t().contiguous() if layout != "qwen-block" else state[name].t().contiguous()
    write_state(path, path, state)
    with pytest.raises(ValueError, match=re.escape(name) + ": .*" + message):
        cpu_llm(path)


def test_checkpoint_disagreeing_with_its_config_is_refused(full_precision, tmp_path):
    path = _fp8_dir(full_precision, tmp_path, skip=("model.layers.0.mlp.down_proj",))
    state = checkpoint_state(path)
    # a float8 weight where the config keeps the module in full precision
    fp8_down = quantize_state({"model.layers.0.mlp.down_proj.weight": state["model.layers.0.mlp.down_proj.weight"]},
                              "qwen-block")[0]
    write_state(path, path, {**state, **fp8_down})
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight' is float8.*config keeps it so"):
        cpu_llm(path)
    # an FP8 lm_head (a compressed-tensors config whose ignore leaves it out): refused as never quantized
    # here, not as one the config keeps in full precision
    lm_head, lm_head_scale = quantize_blocks(state["lm_head.weight"])
    write_state(path, path, {**state, "lm_head.weight": lm_head, "lm_head.weight_scale_inv": lm_head_scale})
    with pytest.raises(ValueError, match="'lm_head.weight' is float8.*never quantized .*lm_head"):
        cpu_llm(path)
    # a full-precision weight where the config makes the module FP8
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(PARTIAL.intermediate_size, PARTIAL.hidden_size)
    del state["model.layers.1.mlp.up_proj.weight_scale_inv"]
    write_state(path, path, state)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight' is torch.float32.*modules_to_not_convert"):
        cpu_llm(path)


def test_packed_parts_must_agree(full_precision, tmp_path):
    path = _fp8_dir(full_precision, tmp_path, skip=("model.layers.0.self_attn.q_proj",))
    with pytest.raises(ValueError, match="packed into one layer.*q_proj"):
        cpu_llm(path)


@pytest.mark.parametrize("entry,module,skipped", [
    ("lm_head", "lm_head", True),
    ("mlp.gate", "model.layers.3.mlp.gate", True),
    ("mlp.gate", "model.layers.3.mlp.gate_proj", False),
    ("model.layers.1", "model.layers.1.self_attn.o_proj", True),
    ("model.layers.1", "model.layers.11.self_attn.o_proj", False),
    (r"re:.*\.down_proj$", "model.layers.0.mlp.down_proj", True),
    (r"re:.*\.down_proj$", "model.layers.0.mlp.up_proj", False),
])
def test_skip_entries_match_whole_name_components_or_regexes(entry, module, skipped):
    config = resolve_quantization(None, {**LAYOUTS["qwen-block"], "modules_to_not_convert": [entry]}, "c")
    assert config.skipped(module) is skipped


@pytest.mark.parametrize("layout,parts,k,held", [
    ("qwen-block", [2048, 512, 512], 1024, True),  # Qwen3-0.6B's qkv
    ("qwen-block", [320, 320], 512, False),  # partial blocks: the parts' grids would not stack
    ("qwen-block", [512], 256, False),  # K / 128 not a multiple of 4
    ("qwen-block", [384, 256], 512, False),  # N / 128 not a multiple of 4
    ("ct-channel", [320, 320], 192, True),
    ("ct-tensor", [300], 192, False),  # rows not a multiple of 16 (torch._scaled_mm)
])
def test_which_layers_keep_fp8_on_cuda(layout, parts, k, held):
    """Held FP8 where the CUDA kernels take the shapes with bf16 compute; dequantized elsewhere."""
    from nanovllm.quantization.config import linear_quant, quantization

    previous = torch.get_default_dtype()
    try:
        with quantization(resolve_quantization(None, LAYOUTS[layout], "c")):
            torch.set_default_dtype(torch.bfloat16)
            cuda = linear_quant(("model.layers.0.mlp.down_proj",), parts, k, torch.device("cuda"))
            cpu = linear_quant(("model.layers.0.mlp.down_proj",), parts, k, torch.device("cpu"))
            torch.set_default_dtype(torch.float32)
            fp32 = linear_quant(("model.layers.0.mlp.down_proj",), parts, k, torch.device("cuda"))
    finally:
        torch.set_default_dtype(previous)
    assert cuda.held is held and not cpu.held and not fp32.held
    assert cuda.fmt == cpu.fmt == fp32.fmt


def test_fbgemm_fp8_config_is_per_channel_with_its_amax_bound(full_precision, tmp_path):
    """Meta's fbgemm_fp8 (vLLM's FBGEMMFp8Config): per-channel weight scales, dynamic per-token
    activations whose amax is bounded by activation_scale_ub (held layers quantize with it:
    Fp8Weights.row_quant), modules_to_not_convert kept; LLM(quantization="fbgemm_fp8") names the
    checkpoint's own format, as quantization="compressed-tensors" does; MoE experts are refused
    naming the bound (the MoE kernels take none)."""
    config = {**LAYOUTS["fbgemm"], "activation_scale_ub": 1200, "modules_to_not_convert": ["lm_head"]}
    expected = QuantConfig((QuantGroup(Fp8Format("channel", "weight_scale", False, False, 1200.0)),), ("lm_head",))
    assert resolve_quantization(None, config, "c") == resolve_quantization("fbgemm_fp8", config, "c") == \
        resolve_quantization("fp8", config, "c") == expected
    assert Fp8Weights(torch.ones(2, 2, dtype=FP8), torch.ones(2), None, 1200.0).row_quant().amax_ub == 1200.0
    with pytest.raises(ValueError, match="quantization='fbgemm_fp8' names a checkpoint's own format"):
        cpu_llm(full_precision("qwen3"), quantization="fbgemm_fp8")
    with pytest.raises(ValueError, match="quantization='fbgemm_fp8' does not match c's quantization_config "
                                         "quant_method='compressed-tensors'"):
        resolve_quantization("fbgemm_fp8", LAYOUTS["ct-channel"], "c")
    path = str(tmp_path / "dense")
    write_fp8(full_precision("llama"), path, str(tmp_path / "ref"), "fbgemm", ("lm_head",))
    for kwargs in ({}, {"quantization": "fbgemm_fp8"}):
        llm = cpu_llm(path, kvcache_block_size=16, max_model_len=64, **kwargs)
        try:
            assert llm.llm_engine.model_config.quantization == "fbgemm_fp8"
        finally:
            llm.exit()
    path = str(tmp_path / "moe")
    write_fp8(full_precision("moe"), path, str(tmp_path / "ref"), "fbgemm", ("mlp.gate",))
    with pytest.raises(ValueError, match="fbgemm_fp8 MoE experts are not supported .*activation_scale_ub"):
        cpu_llm(path)
