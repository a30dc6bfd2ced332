"""What generate returns: vLLM's RequestOutput / CompletionOutput / Logprob (ranks against a full sort
of transformers' logprobs, decoded tokens), read also as nano-vllm's dicts; stop reasons, stop
strings kept in the text, special tokens, detokenize=False."""

from __future__ import annotations

import pytest
import torch

import nanovllm
import nanovllm.outputs
from checkpoints import (
    build_checkpoint, checkpoint_fixture, cpu_llm, cpu_llm_fixture, load_reference, make_prompts, whole_text,
)
from nanovllm import CompletionOutput, Logprob, RequestOutput, SamplingParams

# fp32 engine against fp32 transformers: different kernels and summation order
LOGPROB_ATOL = 2e-3


ckpt = checkpoint_fixture("outputs", seed=6)
llm = cpu_llm_fixture(kvcache_block_size=16, max_model_len=256)


@torch.no_grad()
def ref_logprobs(ckpt_reference, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64: row i is log P(next token | ids[: i + 1]) from transformers."""
    return torch.log_softmax(ckpt_reference(torch.tensor([ids])).logits[0].double(), dim=-1)


def rank_bounds(row: torch.Tensor, token: int) -> tuple[int, int]:
    """The ranks `token` may have in a full descending sort of `row` within LOGPROB_ATOL: from the
    count of entries surely above it to the count of entries that may tie or beat it."""
    desc = row.sort(descending=True).values
    own = row[token].item()
    return int((desc > own + LOGPROB_ATOL).sum()) + 1, int((desc >= own - LOGPROB_ATOL).sum())


def test_classes_are_exported_under_vllms_names():
    assert nanovllm.RequestOutput is nanovllm.outputs.RequestOutput is RequestOutput
    assert nanovllm.CompletionOutput is nanovllm.outputs.CompletionOutput is CompletionOutput
    assert nanovllm.Logprob is nanovllm.outputs.Logprob is Logprob


def test_request_outputs_built_positionally_take_vllms_parameter_order():
    """vLLM's RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
    metrics, lora_request, encoder_prompt, encoder_prompt_token_ids, num_cached_tokens): a caller's
    positional num_cached_tokens landed in encoder_prompt_token_ids (and None in num_cached_tokens)."""
    completion = CompletionOutput(0, "a", [5], None, None, "length")
    out = RequestOutput("7", "p", [1, 2], None, [completion], True, None, None, None, None, 16)
    assert (out.num_cached_tokens, out.encoder_prompt, out.encoder_prompt_token_ids) == (16, None, None)
    assert (out.request_id, out.prompt_token_ids, out.outputs, out.finished) == ("7", [1, 2], [completion], True)


def test_objects_and_their_dict_view(llm):
    prompt = make_prompts(1, 1, 15, 16)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    [out] = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt is None
    assert out.prompt_token_ids == prompt and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    [c] = out.outputs
    assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
    assert (c.finish_reason, c.stop_reason, len(c.token_ids), len(c.logprobs)) == ("length", None, 6, 6)
    assert all(isinstance(lp, Logprob) for entry in c.logprobs for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    # nano-vllm's dict view of the same object: today's keys, float logprobs
    assert set(out) == {"text", "token_ids", "finish_reason", "logprobs", "cumulative_logprob", "prompt_logprobs"}
    assert (out["text"], out["token_ids"], out["finish_reason"]) == (c.text, c.token_ids, "length")
    assert out["logprobs"] == [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs]
    assert out["prompt_logprobs"][0] is None and out["prompt_logprobs"][1] == {
        t: lp.logprob for t, lp in out.prompt_logprobs[1].items()}
    assert out["cumulative_logprob"] == c.cumulative_logprob and out.get("outputs") is None and "outputs" not in out
    assert dict(out) == {k: out[k] for k in out}
    # text prompts keep their text
    [text_out] = llm.generate(["the quick brown fox"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert text_out.prompt == "the quick brown fox" and set(text_out) == {"text", "token_ids", "finish_reason"}


def test_n_samples_are_completion_outputs_in_the_dict_view_too(llm):
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, n=3)
    [out] = llm.generate(["the lazy dog"], sp, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out["outputs"] is out.outputs and all(o["token_ids"] == c.token_ids for o, c in zip(out["outputs"], out.outputs))
    assert out["token_ids"] == out.outputs[0].token_ids and out.token_ids == out.outputs[0].token_ids


def test_logprob_ranks_are_places_in_a_full_vocabulary_sort(ckpt, llm):
    reference = load_reference(ckpt)
    prompts = make_prompts(2, 2, 20, 30)
    # sampled at temperature 1.5: tokens other than the argmax, ranks above 1
    sp = SamplingParams(temperature=1.5, seed=9, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tok = llm.tokenizer
    ranks_seen = set()
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        rows = ref_logprobs(reference, prompt + c.token_ids)
        scored = [(rows[i - 1], prompt[i], out.prompt_logprobs[i], 2) for i in range(1, len(prompt))]
        scored += [(rows[len(prompt) - 1 + j], t, c.logprobs[j], 3) for j, t in enumerate(c.token_ids)]
        for row, token, entry, k in scored:
            assert next(iter(entry)) == token  # the scored token first
            low, high = rank_bounds(row, token)
            assert low <= entry[token].rank <= high, (token, entry[token], low, high)
            ranks_seen.add(entry[token].rank)
            for t, lp in entry.items():
                assert abs(lp.logprob - row[t].item()) < LOGPROB_ATOL
                assert lp.decoded_token == tok.decode([t])
            # the k most likely are listed at their places 1..k (where no near-tie blurs the place)
            for place, t in enumerate(row.topk(k).indices.tolist(), start=1):
                if rank_bounds(row, t) == (place, place):
                    assert entry[t].rank == place
    assert max(ranks_seen) > 1 and 1 in ranks_seen


def test_detokenize_false_gives_ids_only(llm):
    prompt = make_prompts(3, 1, 10, 11)[0]
    on = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=0)
    off = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=0, detokenize=False)
    a, b = llm.generate([prompt, prompt], [on, off], use_tqdm=False)
    assert b.outputs[0].text == "" and a.outputs[0].text != ""
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert all(lp.decoded_token is None for e in b.outputs[0].logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in b.prompt_logprobs[1:] for lp in e.values())
    assert all(lp.decoded_token is not None for e in a.outputs[0].logprobs for lp in e.values())


def test_stop_reasons_and_stop_strings_in_the_text(llm):
    prompt = "the quick brown"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    cut = text.find(stop)
    plain, kept, by_id = llm.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=["zzzz", stop]),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[ids[4]]),
    ], use_tqdm=False)
    assert (plain.outputs[0].text, plain.outputs[0].stop_reason) == (text[:cut], stop)
    assert (kept.outputs[0].text, kept.outputs[0].stop_reason) == (text[:cut + len(stop)], stop)
    first = ids.index(ids[4])
    assert (by_id.outputs[0].token_ids, by_id.outputs[0].stop_reason) == (ids[:first + 1], ids[4])
    assert (free.outputs[0].finish_reason, free.outputs[0].stop_reason) == ("length", None)
    # EOS: "stop" without a stop reason
    [eos] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, logit_bias={0: 100.0}), use_tqdm=False)
    assert (eos.outputs[0].token_ids, eos.outputs[0].finish_reason, eos.outputs[0].stop_reason) == ([0], "stop", None)


def test_the_stop_token_stays_out_of_the_text(llm):
    """vLLM's rule: the token that stopped a request (EOS or a stop_token_id) is the last of its
    token_ids but not in its text, special or not, unless include_stop_str_in_output."""
    prompt = "the quick brown"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    tok = llm.tokenizer
    # a stop token that adds text (the first of its id), from the fifth token on
    first = next(k for k in range(4, len(ids))
                 if ids.index(ids[k]) == k and whole_text(tok, ids[: k + 1]) != whole_text(tok, ids[:k]))
    stop_id = ids[first]
    eos_bias = {0: 100.0}  # EOS (<|endoftext|>, special) right after the first token
    by_id, by_id_kept, eos_raw, eos_kept = llm.generate([prompt] * 4, [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=1, logit_bias=eos_bias, skip_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=1, logit_bias=eos_bias, skip_special_tokens=False,
                       include_stop_str_in_output=True),
    ], use_tqdm=False)
    assert by_id.outputs[0].token_ids == by_id_kept.outputs[0].token_ids == ids[:first + 1]
    assert by_id.outputs[0].text == whole_text(tok, ids[:first])
    assert by_id_kept.outputs[0].text == whole_text(tok, ids[:first + 1]) != by_id.outputs[0].text
    assert eos_raw.outputs[0].token_ids[-1] == 0 and len(eos_raw.outputs[0].token_ids) == 2
    assert eos_raw.outputs[0].text == whole_text(tok, eos_raw.outputs[0].token_ids[:1], skip_special_tokens=False)
    assert eos_kept.outputs[0].text.endswith("<|endoftext|>")


def test_special_tokens_in_the_text_on_request(llm):
    """EOS (<|endoftext|>, a special token) generated past ignore_eos: skipped from the text by
    default, kept with skip_special_tokens=False."""
    sp = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={0: 100.0})
    skipped, kept = llm.generate(["the dog"] * 2, [SamplingParams(**sp), SamplingParams(**sp, skip_special_tokens=False)],
                                 use_tqdm=False)
    assert skipped.outputs[0].token_ids == kept.outputs[0].token_ids == [0, 0, 0]
    assert skipped.outputs[0].text == "" and kept.outputs[0].text == "<|endoftext|>" * 3


def test_stop_strings_count_only_past_min_tokens(llm):
    """vLLM's rule: a stop string ending inside the first min_tokens tokens' text does not stop the
    request, and the text is cut at the first one ending past it; also beside a longer stop string
    (whose reach back keeps the held occurrence in the matcher's tail)."""
    prompt = "the quick brown"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    ids, text = free.outputs[0].token_ids, free.outputs[0].text
    tok = llm.tokenizer
    stop = max((c for c in set(text) if c.strip()), key=text.count)  # a character the text repeats
    min_tokens = next(n for n in range(1, len(ids)) if stop in tok.decode(ids[:n]))  # it appears by then
    after = len(tok.decode(ids[:min_tokens]))
    cut = text.find(stop, after)
    assert cut >= 0, "the test needs a later occurrence"
    n = next(n for n in range(min_tokens + 1, len(ids) + 1) if tok.decode(ids[:n]).find(stop, after) >= 0)
    never = "\x01" * 20
    early, held, beside_long = llm.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=min_tokens),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, never], min_tokens=min_tokens)],
        use_tqdm=False)
    assert len(early.outputs[0].token_ids) <= min_tokens and early.outputs[0].text == text[: text.find(stop)]
    for out in (held.outputs[0], beside_long.outputs[0]):
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (ids[:n], text[:cut], "stop", stop)


def test_flat_prompt_logprobs_read_as_the_list_of_dicts():
    """FlatLogprobs: entry 0 None, one dict per scored prompt token (scored token first, then the k
    most likely at places 1..k, the scored token once), indexing, slices, equality with the list it
    stands for, the float view, and entries of the wrong width refused."""
    flat = nanovllm.outputs.FlatLogprobs(2, none_first=True)
    # position 1 scores token 7 (rank 3) with top 2 = 4, 5; position 2 scores 9, itself the most likely
    flat.add_rows([7, 4, 5, 9, 9, 2], [-2.5, -0.5, -1.0, -0.25, -0.25, -2.0], [3, 1, 2, 1, 1, 2])
    expected = [None,
                {7: Logprob(-2.5, 3), 4: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)},
                {9: Logprob(-0.25, 1), 2: Logprob(-2.0, 2)}]
    assert len(flat) == 3 and list(flat) == expected and flat == expected and expected == flat
    assert list(flat[2]) == [9, 2] and flat[-1] == expected[2] and flat[1:] == expected[1:]
    assert flat != expected[:2] and flat != [None]
    with pytest.raises(IndexError):
        flat[3]
    assert flat.floats() == [None, {7: -2.5, 4: -0.5, 5: -1.0}, {9: -0.25, 2: -2.0}]
    flat.decoded_tokens = ["a", "b", "c", "d", "d", "e"]
    assert [lp.decoded_token for lp in flat[1].values()] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="3 items each"):
        flat.add_rows([1, 2], [-1.0, -2.0], [1, 2])
    empty = nanovllm.outputs.FlatLogprobs(0, none_first=True)
    assert empty == [None] and len(empty) == 1 and empty[0] is None


def test_flat_sample_logprobs_append_copy_and_decoded_tokens():
    """A completion's FlatLogprobs (no leading None): entries appended a sampled token at a time
    (the sampled token first, then the k most likely at places 1..k; a sampled token among them
    takes its place once), a copy that later appends leave alone, decoded tokens set for fewer
    items than it holds (a stream's entries appended after its last fill read None), and entries
    of the wrong width refused."""
    flat = nanovllm.outputs.FlatLogprobs(2, none_first=False)
    assert flat == [] and len(flat) == 0 and flat.floats() == []
    flat.add_row(7, -2.5, 3, [4, 5], [-0.5, -1.0])
    snapshot = flat.copy()
    flat.add_row(9, -0.25, 1, [9, 2], [-0.25, -2.0])
    expected = [{7: Logprob(-2.5, 3), 4: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)},
                {9: Logprob(-0.25, 1), 2: Logprob(-2.0, 2)}]
    assert len(flat) == 2 and flat == expected and flat[-1] == expected[1] and flat[1:] == expected[1:]
    assert snapshot == expected[:1] and len(snapshot) == 1
    assert snapshot + flat == expected[:1] + expected and [None] + snapshot == [None] + expected[:1]
    assert flat.floats() == [{7: -2.5, 4: -0.5, 5: -1.0}, {9: -0.25, 2: -2.0}]
    with pytest.raises(IndexError):
        flat[2]
    flat.decoded_tokens = ["a", "b", "c"]  # the first entry's items only
    assert [lp.decoded_token for lp in flat[0].values()] == ["a", "b", "c"]
    assert [lp.decoded_token for lp in flat[1].values()] == [None, None]
    with pytest.raises(ValueError, match="2 most likely"):
        flat.add_row(1, -1.0, 1, [2], [-2.0])
    assert len(flat) == 2


def test_flat_logprobs_take_the_lists_edits():
    """Client code edits a completion's logprobs as vLLM's list (open-instruct's tool loop extends one
    turn's with the next's and with placeholder entries): append / extend / insert / item and slice
    assignment / del / pop / += act as on the list it stands for (a TypeError or a wrong-width
    refusal before), copies and pickles keep the edits, and the float view reads the entries given."""
    import pickle
    from types import SimpleNamespace

    flat = nanovllm.outputs.FlatLogprobs(1, none_first=False)
    flat.add_row(7, -2.5, 3, [4], [-0.5])
    flat.add_row(9, -0.25, 1, [9], [-0.25])
    entries = list(flat)
    other = nanovllm.outputs.FlatLogprobs(0, none_first=True)
    other.add_rows([5], [-1.5], [2])
    filler = {8: SimpleNamespace(logprob=0.0)}
    flat.extend(other)
    flat.append(filler)
    expected = entries + list(other) + [filler]
    assert len(flat) == 5 and flat == expected and list(flat) == expected and flat[-1] is filler
    assert flat.floats() == [{7: -2.5, 4: -0.5}, {9: -0.25}, None, {5: -1.5}, {8: 0.0}]
    snapshot = flat.copy()
    assert pickle.loads(pickle.dumps(flat)) == expected
    assert flat.pop() is filler and flat.pop(2) is None and len(flat) == 3
    flat.insert(0, None)
    flat[1] = {1: Logprob(-1.0, 1)}
    del flat[2]
    flat[1:2] = [{2: Logprob(-2.0, 2)}, {3: Logprob(-3.0, 3)}]
    flat += [filler]
    assert flat == [None, {2: Logprob(-2.0, 2)}, {3: Logprob(-3.0, 3)}, {5: Logprob(-1.5, 2)}, filler]
    assert snapshot == expected  # a copy keeps its own entries
    with pytest.raises(IndexError):
        flat[5] = None


def test_a_completions_logprobs_extend_as_vllms_list(llm):
    """The output objects generate returns take a client's list edits (a multi-turn loop gluing its
    turns' logprobs together), and their dict view follows the edited entries."""
    from types import SimpleNamespace

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    first, second = (out.outputs[0] for out in llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False))
    glued = list(first.logprobs) + list(second.logprobs) + [{4: SimpleNamespace(logprob=0.0)}]
    first.token_ids.extend(second.token_ids + [4])
    first.logprobs.extend(second.logprobs)
    first.logprobs.append({4: SimpleNamespace(logprob=0.0)})
    assert list(first.logprobs) == glued and len(first.logprobs) == len(first.token_ids) == 7
    assert first["logprobs"][-1] == {4: 0.0} and len(first["logprobs"]) == 7
    assert [entry[t].logprob for entry, t in zip(first.logprobs, first.token_ids)][-1] == 0.0


def test_a_checkpoints_other_eos_ids_stop_as_stop_token_ids(tmp_path):
    """vLLM's rule for a checkpoint with several EOS ids (Qwen: <|im_end|> for the tokenizer,
    <|endoftext|> beside it in generation_config.json): the tokenizer's ends a request with
    stop_reason None, the others as stop_token_ids do (stop_reason the id); ignore_eos passes them
    all; the caller's SamplingParams stay as given."""
    path = build_checkpoint(str(tmp_path / "two_eos"), eos_token_id=[0, 7])
    llm = cpu_llm(path, kvcache_block_size=16, max_model_len=64)
    try:
        assert llm.tokenizer.eos_token_id == 0 and llm.eos_token_ids == {0, 7}
        params = [SamplingParams(temperature=0, max_tokens=4, logit_bias={t: 100.0}, ignore_eos=ignore)
                  for t, ignore in ((7, False), (0, False), (7, True))]
        other, primary, ignored = llm.generate(["the dog"] * 3, params, use_tqdm=False)
        assert (other.outputs[0].token_ids, other.outputs[0].finish_reason, other.outputs[0].stop_reason) == (
            [7], "stop", 7)
        assert (primary.outputs[0].token_ids, primary.outputs[0].finish_reason, primary.outputs[0].stop_reason) == (
            [0], "stop", None)
        assert ignored.outputs[0].token_ids == [7] * 4 and ignored.outputs[0].finish_reason == "length"
        assert params[0].stop_token_ids == []
    finally:
        llm.exit()


def test_generate_gives_vllms_string_request_ids(llm):
    """vLLM's LLM.generate / chat name each request str(a counter): RequestOutput.request_id is a str
    (it was the engine's int id); the step API's ids stay the ints add_request returns."""
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first, second = llm.generate(["the quick", "the lazy"], sp, use_tqdm=False)
    [third] = llm.generate(["the dog"], sp, use_tqdm=False)
    ids = [o.request_id for o in (first, second, third)]
    assert all(isinstance(i, str) for i in ids), ids
    assert int(ids[0]) < int(ids[1]) < int(ids[2])
    assert "request_id='" in repr(first)
    request_id = llm.add_request("the fox", sp)
    finished = []
    while not llm.is_finished():
        finished += llm.step().finished
    assert [o.request_id for o in finished] == [request_id] and isinstance(request_id, int)
