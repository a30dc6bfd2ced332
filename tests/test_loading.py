"""Loading a model directory as users' checkpoints come: load formats, tokenizer directories,
tensors in several files, unreadable files."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    LlamaShape, TinyShape, assert_greedy_matches_reference, build_checkpoint, checkpoint_fixture, cpu_llm,
    generate_tokens, load_reference, make_prompts,
)
from nanovllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

ckpt = checkpoint_fixture("loading")
llama = checkpoint_fixture("llama", LlamaShape())


def test_load_format_safetensors_reads_the_checkpoint(ckpt):
    """vLLM's load_format="safetensors" (the checkpoint's *.safetensors files, as "auto" reads them here)
    loads the checkpoint; a format nanovllm cannot read (vLLM's "pt": *.pt files) is refused naming it."""
    prompts = make_prompts(0, 2, 5, 20)
    assert generate_tokens(ckpt, prompts, GREEDY, load_format="safetensors")[0] == generate_tokens(ckpt, prompts, GREEDY)[0]
    with pytest.raises(ValueError, match="load_format must be one of .*got 'pt'"):
        cpu_llm(ckpt, load_format="pt")


def test_load_format_safetensors_refuses_a_directory_of_bin_weights(ckpt, tmp_path):
    """load_format="safetensors" reads *.safetensors files only, as vLLM's does: a directory holding
    PyTorch .bin weights alone is refused at LLM(...) naming the directory and the format (it read the
    .bin files, as "auto" does); "auto" still reads them."""
    prompts = make_prompts(2, 2, 5, 20)
    bins = tmp_path / "bin-only"
    shutil.copytree(ckpt, bins)
    torch.save(load_file(str(bins / "model.safetensors")), str(bins / "pytorch_model.bin"))
    (bins / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=re.escape(f"load_format='safetensors' but model directory {str(bins)!r} "
                                                   "has no *.safetensors files (it holds PyTorch .bin weights: pytorch_model.bin)")):
        cpu_llm(str(bins), load_format="safetensors")
    assert generate_tokens(str(bins), prompts, GREEDY)[0] == generate_tokens(ckpt, prompts, GREEDY)[0]
    (bins / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"has no \*\.safetensors files \(it holds no weights files\)"):
        cpu_llm(str(bins), load_format="safetensors")


def test_tokenizer_directory_without_a_tokenizer_is_refused(ckpt, tmp_path):
    """LLM(tokenizer=...) reads the tokenizer from another directory (the model's may have none); one that
    holds no tokenizer is refused naming it (it loaded no tokenizer silently: text prompts then failed
    blaming the model directory), unless skip_tokenizer_init=True asks for none."""
    bare = tmp_path / "weights-only"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    llm = cpu_llm(str(bare), tokenizer=ckpt)
    assert llm.generate(["the quick brown fox"], GREEDY, use_tqdm=False)[0].outputs[0].text
    llm.exit()
    with pytest.raises(ValueError, match=f"tokenizer directory {str(bare)!r} holds no tokenizer"):
        cpu_llm(ckpt, tokenizer=str(bare))
    llm = cpu_llm(ckpt, tokenizer=str(bare), skip_tokenizer_init=True)
    assert llm.tokenizer is None
    llm.exit()


def _shards(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_a_tensor_in_two_files_is_refused_naming_both(ckpt, tmp_path):
    """A tensor held by two of the files read (a stale copy in another shard than the index names, or a
    stray *.safetensors beside an unsharded checkpoint) is refused naming it and both files: whichever
    file came last was served, here zeros."""
    sharded = build_checkpoint(str(tmp_path / "sharded"), TinyShape(), max_shard_size="100KB")
    first, *_, last = _shards(sharded)
    stale = load_file(os.path.join(sharded, last))
    name, tensor = next(iter(load_file(os.path.join(sharded, first)).items()))
    stale[name] = torch.zeros_like(tensor)
    save_file(stale, os.path.join(sharded, last), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor {name!r} is in two files: {first} and {last}"):
        cpu_llm(sharded)

    single = tmp_path / "single"
    shutil.copytree(ckpt, single)
    save_file({"model.norm.weight": torch.zeros(TinyShape().hidden_size)}, str(single / "model-old.safetensors"))
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is in two files: model-old.safetensors and "
                                         "model.safetensors"):
        cpu_llm(str(single))


# What a clone without git-lfs leaves in place of each weights file.
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize 1066688\n".format("0" * 64)


def test_an_unreadable_weights_file_is_named(ckpt, tmp_path):
    """A *.safetensors file that is not one (a git-lfs pointer of a clone without git-lfs, a download cut
    short) is refused naming the file (safetensors' own error named none: "Error while deserializing
    header: ..."), which in a sharded checkpoint is the one to fetch again."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    whole = weights.read_bytes()
    named = re.escape(f"checkpoint file {str(weights)!r} is not a readable safetensors file")
    for broken in (LFS_POINTER.encode(), whole[: len(whole) // 2]):
        weights.write_bytes(broken)
        with pytest.raises(ValueError, match=named):
            cpu_llm(str(bad))


@pytest.mark.parametrize("file,text,why", [
    ("tokenizer.json", LFS_POINTER, r"tokenizer.json is a git-lfs pointer"),
    ("tokenizer.json", '{"version": "1.0", "trunc', "JSONDecodeError: Unterminated string"),
    ("tokenizer.json", '{"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": 5}}', "invalid type"),
    ("tokenizer_config.json", "{", "Expecting property name"),
], ids=["lfs-pointer", "cut-short", "not-a-tokenizer", "config-cut-short"])
def test_an_unreadable_tokenizer_is_named(ckpt, tmp_path, file, text, why):
    """A tokenizer the model directory ships but transformers cannot load (tokenizer.json a git-lfs pointer
    of a clone without git-lfs, a download cut short, not a tokenizer) is refused at LLM(...) naming the
    directory and the reason; transformers' own errors named neither ("Expecting value: line 1 column 1
    (char 0)", a JSONDecodeError; tokenizers' bare Exception "invalid type: integer `5`")."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / file).write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"the tokenizer in {str(bad)!r} could not be loaded") + f".*{why}"):
        cpu_llm(str(bad))
    llm = cpu_llm(str(bad), skip_tokenizer_init=True)  # no tokenizer asked for: none read
    assert llm.tokenizer is None
    llm.exit()


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
@pytest.mark.parametrize("text", ['{"architectures": ', '["Qwen3ForCausalLM"]'], ids=["cut-short", "a-list"])
def test_a_json_file_that_is_not_a_json_object_is_named(tmp_path, file, text):
    """config.json or the shards' index cut short, or holding something other than an object, is refused
    naming the file (json's own error, or an AttributeError of dict code, named none)."""
    path = build_checkpoint(str(tmp_path / "ckpt"), TinyShape(), max_shard_size="100KB")
    with open(os.path.join(path, file), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=re.escape(f"{os.path.join(path, file)} is not a JSON object")):
        cpu_llm(path)


def test_pytorch_bin_weights_are_read_as_vllm_reads_them(ckpt, tmp_path):
    """Weights only in PyTorch's pickle format (pytorch_model.bin, or shards a pytorch_model.bin.index.json
    lists) give the tokens of the same weights in safetensors; beside *.safetensors files a .bin copy is
    not read (here zeros: the served tokens are the safetensors ones); a directory with neither, or a
    pickle holding code or not a dict of tensors, is refused naming it."""
    prompts = make_prompts(1, 2, 5, 20)
    expected = generate_tokens(ckpt, prompts, GREEDY)[0]
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    both = tmp_path / "both"
    shutil.copytree(ckpt, both)
    torch.save({name: torch.zeros_like(t) for name, t in weights.items()}, str(both / "pytorch_model.bin"))
    assert generate_tokens(str(both), prompts, GREEDY)[0] == expected

    single = tmp_path / "single"
    shutil.copytree(ckpt, single)
    (single / "model.safetensors").unlink()
    torch.save(weights, str(single / "pytorch_model.bin"))
    assert generate_tokens(str(single), prompts, GREEDY)[0] == expected

    sharded = tmp_path / "sharded"
    shutil.copytree(single, sharded)
    (sharded / "pytorch_model.bin").unlink()
    names = sorted(weights)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, held in halves.items():
        torch.save({n: weights[n] for n in held}, str(sharded / file))
    torch.save({n: torch.zeros_like(weights[n]) for n in names}, str(sharded / "pytorch_model.bin"))  # stale: not listed
    index = {"weight_map": {n: file for file, held in halves.items() for n in held}}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert generate_tokens(str(sharded), prompts, GREEDY)[0] == expected

    (single / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"has no weights: no \*\.safetensors nor pytorch_model\*\.bin files"):
        cpu_llm(str(single))
    torch.save({"model.embed_tokens.weight": [1, 2]}, str(single / "pytorch_model.bin"))
    with pytest.raises(ValueError, match="pytorch_model.bin' does not hold a dict of tensor names to tensors"):
        cpu_llm(str(single))
    torch.save({"model.embed_tokens.weight": torch.zeros(2), "code": GREEDY}, str(single / "pytorch_model.bin"))
    with pytest.raises(ValueError, match="pytorch_model.bin' is not a readable PyTorch weights file"):
        cpu_llm(str(single))


def test_rope_tables_saved_in_the_checkpoint_are_skipped(llama, tmp_path):
    """RoPE's cos / sin tables that ColossalAI-trained Llama checkpoints hold (`rotary_emb.cos_cached`,
    `sin_cached`: computed here, as vLLM skips them) load as the checkpoint without them; they were
    refused as unknown weights."""
    prompts = make_prompts(2, 2, 5, 20)
    expected = generate_tokens(llama, prompts, GREEDY)[0]
    with_tables = tmp_path / "colossal"
    shutil.copytree(llama, with_tables)
    weights = load_file(str(with_tables / "model.safetensors"))
    for i in range(LlamaShape().num_hidden_layers):
        for table in ("cos_cached", "sin_cached"):
            weights[f"model.layers.{i}.self_attn.rotary_emb.{table}"] = torch.randn(1, 1, 64, 32)
    save_file(weights, str(with_tables / "model.safetensors"), metadata={"format": "pt"})
    assert generate_tokens(str(with_tables), prompts, GREEDY)[0] == expected


def test_a_hub_id_or_missing_path_is_refused_saying_nothing_is_downloaded(ckpt, tmp_path, monkeypatch):
    """vLLM takes a Hugging Face model id (it downloads it); nanovllm reads local directories only. A model
    or tokenizer that names no directory is refused saying so: a hub id with how to download it, a path
    that does not exist or is a file as such (all three read "is not a directory", which told a vLLM user
    passing "Qwen/Qwen3-0.6B" nothing of why)."""
    monkeypatch.chdir(tmp_path)  # no such directory here, whatever the hub id
    hub_id = "nanovllm-test-org/Tiny-Model-0.6B"
    for keyword, kwargs in (("model", {}), ("tokenizer", {"tokenizer": hub_id})):
        with pytest.raises(ValueError, match=re.escape(f"{keyword} {hub_id!r} is not a local directory (nanovllm "
                                                       "reads checkpoints from local directories and downloads "
                                                       "nothing)") + f".*huggingface-cli download {hub_id}"):
            cpu_llm(hub_id if keyword == "model" else ckpt, **kwargs)
    missing = str(tmp_path / "no-such-dir")
    with pytest.raises(ValueError, match=re.escape(f"model path {missing!r} does not exist")):
        cpu_llm(missing)
    config = os.path.join(ckpt, "config.json")
    with pytest.raises(ValueError, match=re.escape(f"model path {config!r} is a file, not a directory")):
        cpu_llm(config)


@pytest.mark.parametrize("stored", ["float64", "float8_e4m3fn"])
def test_a_config_dtype_other_than_16_or_32_bit_float_is_served(ckpt, tmp_path, stored):
    """config.json's dtype names the dtype the weights were saved in, any of torch's floating-point ones
    (transformers writes float64 for a float64 model; FP8 checkpoints may write float8_e4m3fn); vLLM serves
    such a checkpoint (dtype="auto" on CUDA in its platform's 16-bit dtype, bfloat16 here). It was refused
    ("unsupported dtype"), even with dtype="float32" asked for. The tokens are transformers' greedy ones;
    a dtype name that is no floating-point one is still refused naming it."""
    prompts = make_prompts(4, 2, 5, 20)
    path = tmp_path / stored
    shutil.copytree(ckpt, path)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = stored
    (path / "config.json").write_text(json.dumps(config))
    reference = load_reference(ckpt)
    for dtype in ("auto", "float32"):
        outs, _ = generate_tokens(str(path), prompts, GREEDY, dtype=dtype)
        for prompt, out in zip(prompts, outs):
            assert_greedy_matches_reference(reference, prompt, out)
    config["dtype"] = "int8"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"{path / 'config.json'}: unsupported dtype 'int8'")):
        cpu_llm(str(path), dtype="float32")


@pytest.mark.parametrize("stored_key,override_key", [("dtype", "torch_dtype"), ("torch_dtype", "dtype")])
def test_an_hf_overrides_dtype_replaces_either_spelling(ckpt, tmp_path, stored_key, override_key):
    """config.json spells the weights' dtype `dtype` (transformers 5) or `torch_dtype` (4): an
    hf_overrides entry in either spelling is the dtype read, as transformers' config (which aliases the
    two) gives vLLM; before, a `dtype` key in the file won over an overriding `torch_dtype`."""
    from nanovllm.models.model_config import ModelConfig

    with open(os.path.join(ckpt, "config.json")) as f:
        raw = json.load(f)
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    raw[stored_key] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(str(tmp_path)).torch_dtype == torch.bfloat16
    assert ModelConfig.from_pretrained(str(tmp_path), {override_key: "float16"}).torch_dtype == torch.float16
    assert ModelConfig.from_pretrained(str(tmp_path), {override_key: torch.float16}).torch_dtype == torch.float16
