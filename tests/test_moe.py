"""Qwen3-MoE on CPU against transformers' Qwen3MoeForCausalLM: greedy tokens (router
renormalisation on and off, dense layers by mlp_only_layers and by decoder_sparse_step, top-8 of
16), scheduling regimes, tensor parallelism; both checkpoint spellings of the experts; the layer
against transformers' sparse block; the MoE config section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoints import (
    MoeShape, assert_greedy_matches_reference, build_moe_checkpoint, check_greedy_tokens, check_scheduling_regimes,
    cpu_llm, generate_tokens, lazy_checkpoints_fixture, load_reference, make_prompts, rewrite_checkpoint_tensors, rewrite_config,
)
from nanovllm import SamplingParams
from nanovllm.moe.checkpoint_names import expert_checkpoint_name, map_expert_name
from nanovllm.moe.layer import MoeExperts, SparseMoeBlock, experts_native, route
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.registry import build_model
from nanovllm.utils.loader import checkpoint_tensors, load_model, update_weights
from nanovllm.utils.distributed import TensorParallel, tensor_parallel

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CHECKPOINTS = {
    "renormalised": MoeShape(),
    "not-renormalised": MoeShape(norm_topk_prob=False),
    "dense-layer-1": MoeShape(mlp_only_layers=(1,)),  # layer 0 sparse, layer 1 dense
    "top8-of-16": MoeShape(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=16),
    "sparse-step-2": MoeShape(decoder_sparse_step=2, num_hidden_layers=3),  # only layer 1 sparse
}
# Both MLP kinds in one model: the checkpoint of the slower engine tests.
MIXED = "dense-layer-1"


checkpoints = lazy_checkpoints_fixture(CHECKPOINTS)


def run(path, prompts, **kwargs):
    return generate_tokens(path, prompts, GREEDY, **kwargs)


def cpu_model(path: str, load: bool = True):
    model = build_model(ModelConfig.from_pretrained(path))
    if load:
        load_model(model, path)
    return model


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_transformers(checkpoints, name):
    check_greedy_tokens(checkpoints(name), make_prompts(0, 4, 60, 140), GREEDY)


def test_layers_are_sparse_where_transformers_says(checkpoints):
    for name in ("dense-layer-1", "sparse-step-2", "renormalised"):
        ours = cpu_model(checkpoints(name), load=False)
        theirs = load_reference(checkpoints(name))
        for mine, hf in zip(ours.model.layers, theirs.model.layers):
            assert isinstance(mine.mlp, SparseMoeBlock) == hasattr(hf.mlp, "experts"), name


def test_identical_under_every_scheduling_regime(checkpoints):
    shared = list(range(100, 148))  # 3 full blocks of 16 for the prefix cache
    prompts = [shared + p for p in make_prompts(1, 3, 40, 90)] + make_prompts(2, 3, 60, 120)
    # 13 blocks of 16 tokens: the longest request (133 + 16 tokens) fits, all six together do not.
    check_scheduling_regimes(checkpoints(MIXED), prompts, GREEDY, preempt_blocks=13)


def test_tp2_matches_tp1(checkpoints):
    prompts = make_prompts(3, 4, 20, 100)
    single, _ = run(checkpoints(MIXED), prompts)
    tp2, _ = run(checkpoints(MIXED), prompts, tensor_parallel_size=2)
    assert tp2 == single


def test_expert_shards_sum_to_the_whole_layer(checkpoints):
    """Two ranks' experts (halves of the intermediate dimension, filled from either checkpoint
    spelling) sum to one rank's output; that is what the all-reduce adds up."""
    path = checkpoints("top8-of-16")
    shape = CHECKPOINTS["top8-of-16"]
    per_expert = dict(checkpoint_tensors(path))
    fused = load_reference(path).state_dict()
    prefix = "model.layers.0.mlp.experts"

    def experts(rank: int, size: int, tensors: dict) -> MoeExperts:
        with tensor_parallel(TensorParallel(rank, size)):
            layer = MoeExperts(shape.num_experts, shape.hidden_size, shape.moe_intermediate_size)
        params = {"w13": layer.w13, "w2": layer.w2}
        for name, tensor in tensors.items():
            if name.startswith(prefix + "."):
                param_name, shard_id = map_expert_name(name)
                destination, source = layer.weight_slice(params[param_name.rsplit(".", 1)[1]], tensor, shard_id)
                destination.copy_(source)
        return layer

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, shape.hidden_size, generator=g)
    weights, ids = route(torch.randn(40, shape.num_experts, generator=g), shape.num_experts_per_tok, True)
    whole = experts(0, 1, per_expert)(hidden, weights, ids)
    for tensors in (per_expert, fused):
        halves = [experts(rank, 2, tensors) for rank in (0, 1)]
        assert halves[0].w13.shape == (16, 16, 64) and halves[0].w2.shape == (16, 64, 8)
        torch.testing.assert_close(halves[0](hidden, weights, ids) + halves[1](hidden, weights, ids), whole)
    with pytest.raises(ValueError, match="rank must be below tensor_parallel_size 2"):
        TensorParallel(2, 2)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_transformers_sparse_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=12, num_experts_per_tok=3,
                            norm_topk_prob=norm_topk_prob)
    theirs = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(32, 12, 3, 24, norm_topk_prob)
    ours.gate.weight.data.copy_(theirs.gate.weight)
    ours.experts.w13.data.copy_(theirs.experts.gate_up_proj)
    ours.experts.w2.data.copy_(theirs.experts.down_proj)
    hidden = torch.randn(50, 32)
    with torch.no_grad():
        expected = theirs(hidden[None])[0]
    torch.testing.assert_close(ours(hidden), expected, rtol=1e-5, atol=1e-5)
    weights, _ = route(ours.gate(hidden), 3, norm_topk_prob)
    assert weights.dtype == torch.float32
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    else:
        assert (weights.sum(-1) < 1).all()


def test_native_experts_skip_experts_nobody_picked():
    """experts_native is the MoE sum, token by token in float64, over the picked experts only: an
    expert no token picked contributes nothing, even with non-finite weights."""
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(4, 2 * 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    w13[2] = float("nan")
    hidden = torch.randn(5, 16, generator=g)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 1], [1, 0]])
    weights = torch.rand(5, 2, generator=g)
    out = experts_native(hidden, w13, w2, weights, ids)
    want = torch.zeros(5, 16, dtype=torch.float64)
    for t in range(5):
        for k in range(2):
            e = ids[t, k].item()
            gate, up = (w13[e].double() @ hidden[t].double()).chunk(2)
            want[t] += weights[t, k].item() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_both_checkpoint_spellings_give_identical_tokens(checkpoints, tmp_path):
    """save_pretrained writes one tensor per expert (as published); transformers' in-memory state
    dict (and so a checkpoint written from it) has them fused in 3-D tensors. Both load."""
    path = checkpoints(MIXED)
    names = {name for name, _ in checkpoint_tensors(path)}
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert not any(name.endswith("gate_up_proj") for name in names)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in Path(path).iterdir():
        if not f.name.endswith(".safetensors"):
            (fused_dir / f.name).write_bytes(f.read_bytes())
    state = load_reference(path).state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 64, 64)
    rewrite_checkpoint_tensors(str(fused_dir), state)
    prompts = make_prompts(5, 3, 30, 80)
    assert run(str(fused_dir), prompts)[0] == run(path, prompts)[0]


def test_use_sliding_window_slides_every_layer_as_transformers_does(tmp_path):
    """transformers' Qwen3-MoE has no max_window_layers: with use_sliding_window every layer slides.
    The published configs write one (48 of 48 layers in Qwen3-30B-A3B's), which read as Qwen3's left
    every layer full, so a max_model_len past the window was served unmasked (other tokens than
    transformers'); now the window bounds max_model_len, within which the tokens are transformers'."""
    path = build_moe_checkpoint(str(tmp_path / "window"), MoeShape())
    rewrite_config(path, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    reference = load_reference(path)
    assert [layer.self_attn.sliding_window for layer in reference.model.layers] == [32, 32]
    with pytest.raises(ValueError, match=r"max_model_len=64 exceeds the model's attention window \(sliding_window=32"):
        cpu_llm(path, max_model_len=64)
    prompts = make_prompts(6, 3, 8, 16)  # + 16 tokens: within the window
    for prompt, out in zip(prompts, run(path, prompts, max_model_len=32)[0]):
        assert_greedy_matches_reference(reference, prompt, out)


def test_update_weights_takes_transformers_fused_state_dict(checkpoints, tmp_path):
    """A transformers model's state_dict (fused experts) swaps in its weights: the model then holds
    exactly what loading that model's per-expert checkpoint gives."""
    other = build_moe_checkpoint(str(tmp_path / "other"), CHECKPOINTS[MIXED], seed=1)
    model = cpu_model(checkpoints(MIXED))
    update_weights(model, load_reference(other).state_dict().items())
    expected = cpu_model(other)
    for (name, mine), (_, theirs) in zip(model.named_parameters(), expected.named_parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)


def test_expert_parameter_shards_name_their_checkpoint_tensors():
    """The inverse the loader's missing-tensor error uses, for every stacked expert parameter."""
    for name in ("model.layers.3.mlp.experts.17.up_proj.weight", "model.layers.3.mlp.experts.2.down_proj.weight",
                 "model.layers.3.mlp.experts.17.gate_proj.weight_scale_inv",
                 "model.layers.0.mlp.experts.1.down_proj.weight_scale"):
        assert expert_checkpoint_name(*map_expert_name(name)) == name
    assert expert_checkpoint_name("model.layers.3.mlp.experts.w13", "gate_up_proj") is None  # a fused tensor's


def test_missing_or_misshapen_expert_tensor_is_named(checkpoints, tmp_path):
    tensors = dict(checkpoint_tensors(checkpoints(MIXED)))
    model = cpu_model(checkpoints(MIXED), load=False)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.0.mlp.experts.5.down_proj.weight"}
    rewrite_checkpoint_tensors(str(tmp_path), missing)
    named = r"missing tensor\(s\): model\.layers\.0\.mlp\.experts\.5\.down_proj\.weight$"
    with pytest.raises(ValueError, match=named):
        load_model(model, str(tmp_path))
    bad = {**tensors, "model.layers.0.mlp.experts.3.gate_proj.weight": torch.zeros(31, 64)}
    named = r"'model\.layers\.0\.mlp\.experts\.3\.gate_proj\.weight'.*expected shape \(32, 64\)"
    with pytest.raises(ValueError, match=named):
        update_weights(model, bad.items())
    with pytest.raises(ValueError, match=r"unknown weight 'model\.layers\.0\.mlp\.experts\.8\.up_proj\.weight'"):
        update_weights(model, [("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match=r"experts gate_up_proj: expected shape \(8, 64, 64\)"):
        update_weights(model, [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 32, 64))])
    with pytest.raises(ValueError, match="unknown weight 'model.layers.1.mlp.experts.0.up_proj.weight'"):
        update_weights(model, [("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(32, 64))])  # dense layer


def test_dummy_weights_run(checkpoints):
    outs, _ = run(checkpoints(MIXED), make_prompts(6, 2, 10, 30), load_format="dummy")
    assert [len(o) for o in outs] == [GREEDY.max_tokens] * 2


# A config-only Qwen3-MoE (random weights), deep enough for a random prompt's tokens to coincide in its late layers
# unless the dummy weights keep them apart (utils/loader.DUMMY_ATTENTION_OUT_SCALE).
SPREAD_CONFIG = dict(num_hidden_layers=12, num_experts=32, num_experts_per_tok=4, hidden_size=256, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=128, intermediate_size=512,
                     vocab_size=4096, bos_token_id=1, eos_token_id=2)
SPREAD_PROMPT_TOKENS = 512
# Uniform routing of 512 tokens, top 4 of 32 (64 an expert on average): the busiest expert takes ~17% (15-19% here).
# With the dummy attention outputs at full scale it took 29% in the first layer, 62-87% in the next four and 75-100%
# in the rest; from the third layer on, 11-21 of the 32 experts were hit at all.
SPREAD_MAX_BUSIEST = 0.25


def test_dummy_weights_route_a_prompt_across_the_experts(tmp_path):
    """A random-weight engine (benchmarks' load_format="dummy") spreads one prompt's tokens over the
    experts in every layer, as a trained router does, instead of sending them all to one expert."""
    config = {**A3B, **SPREAD_CONFIG}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = cpu_llm(str(tmp_path), load_format="dummy", enforce_eager=True, max_model_len=1024)
    blocks = [m for m in llm.model_runner.model.modules() if isinstance(m, SparseMoeBlock)]
    picks: list[tuple[int, torch.Tensor]] = []  # (layer, expert ids [T, K]) of every router call
    for i, block in enumerate(blocks):
        def record(module, args, logits, i=i, k=block.top_k):  # logits [T, E]
            picks.append((i, logits.topk(k, -1).indices))
        block.gate.register_forward_hook(record)
    prompt = torch.randint(3, config["vocab_size"], (SPREAD_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
    llm.generate([prompt.tolist()], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.exit()
    prefill = [(i, ids) for i, ids in picks if ids.shape[0] == SPREAD_PROMPT_TOKENS]
    assert [i for i, _ in prefill] == list(range(config["num_hidden_layers"]))
    for i, ids in prefill:
        counts = torch.bincount(ids.flatten(), minlength=config["num_experts"])
        busiest = counts.max().item() / SPREAD_PROMPT_TOKENS
        assert (counts > 0).all() and busiest <= SPREAD_MAX_BUSIEST, (i, busiest, (counts > 0).sum().item())


# ----- config.json's MoE section -----
A3B = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())


def test_published_30b_a3b_config_reads():
    cfg = ModelConfig.from_dict(A3B)
    assert cfg.architecture == "Qwen3MoeForCausalLM"
    moe = cfg.moe
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.decoder_sparse_step == 1 and moe.mlp_only_layers == ()
    assert cfg.sparse_layers() == tuple(range(48))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size) == (32, 4, 128, 2048)
    # transformers 5 writes the expert count as num_local_experts
    renamed = {k: v for k, v in A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert ModelConfig.from_dict(renamed) == cfg
    # a dense architecture ignores MoE keys
    assert ModelConfig.from_dict({**A3B, "architectures": ["Qwen3ForCausalLM"]}).moe is None


@pytest.mark.parametrize("change,message", [
    ({"num_experts_per_tok": 129}, r"num_experts_per_tok must be in \[1, num_experts=128\], got 129"),
    ({"num_experts": 0}, "num_experts must be a positive int, got 0"),
    ({"moe_intermediate_size": None}, "missing required key 'moe_intermediate_size'"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive int, got 0"),
    # a null or fractional count: int() raised a TypeError naming no key, or cut 2.5 experts a token to 2
    ({"num_experts_per_tok": "null"}, r"^config.json: num_experts_per_tok must be a positive int, got None$"),
    ({"num_experts_per_tok": 2.5}, r"^config.json: num_experts_per_tok must be a positive int, got 2.5$"),
    ({"moe_intermediate_size": "null"}, r"^config.json: moe_intermediate_size must be a positive int, got None$"),
    ({"num_experts": True}, r"^config.json: num_experts must be a positive int, got True$"),
    ({"mlp_only_layers": [3, 48]}, r"mlp_only_layers must list layer indices in \[0, 48\), got \[3, 48\]"),
    # a falsy non-list (false, 0, ""): `or []` read it as no dense layer, where transformers and vLLM fail on it
    ({"mlp_only_layers": False}, r"mlp_only_layers must list layer indices in \[0, 48\), got False"),
    ({"mlp_only_layers": 0}, r"mlp_only_layers must list layer indices in \[0, 48\), got 0"),
])
def test_moe_config_refusals_name_the_value(change, message):
    raw = {k: None if v == "null" else v for k, v in {**A3B, **change}.items() if v is not None}  # "null": a JSON null
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_tensor_parallel_checks_the_widths_in_use():
    ModelConfig.from_dict(A3B).check_tensor_parallel(4)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide moe_intermediate_size=770"):
        ModelConfig.from_dict({**A3B, "moe_intermediate_size": 770}).check_tensor_parallel(4)
    # intermediate_size is the dense MLP's width: checked only where some layer is dense
    ModelConfig.from_dict({**A3B, "intermediate_size": 6146}).check_tensor_parallel(4)
    with pytest.raises(ValueError, match="does not divide intermediate_size=6146"):
        ModelConfig.from_dict({**A3B, "intermediate_size": 6146, "mlp_only_layers": [0]}).check_tensor_parallel(4)


def test_refused_config_is_refused_at_llm(tmp_path):
    path = build_moe_checkpoint(str(tmp_path / "bad"), MoeShape())
    rewrite_config(path, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        run(path, [[1, 2, 3]])
