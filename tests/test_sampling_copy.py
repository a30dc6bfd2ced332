"""A step's sampling values travel in the step's one host-to-device copy: SamplingPack words
appended to the step's int32 array 16-byte aligned, viewed back as int64 on the device, every part
of them 16-byte aligned whatever the batch, as is every section of a prefill / mixed step's array
(Triton compiles a kernel variant per pointer alignment)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanovllm import SamplingParams
from nanovllm.engine.scheduled_batch import StepKind
from nanovllm.engine.step_inputs import HostCopy, StepInputBuilder, VarlenLayout
from nanovllm.engine.step_plan import StepPlan
from nanovllm.sampling.batch import SamplingBatch, SamplingPack
from nanovllm.utils.host_to_device import to_device, with_words, words_view

PARAMS = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.7, top_k=5, seed=1),
          SamplingParams(top_p=0.9, min_p=0.05, seed=2)]
KEYS = [0, 2**63 - 1, 12345]


@pytest.mark.parametrize("num_ints", [0, 1, 6, 7])
def test_words_ride_after_the_ints_and_read_back_exactly(num_ints):
    ints = np.arange(num_ints, dtype=np.int32) - 3
    words = np.array([2**63 - 1, -1, 0, 1 << 40], dtype=np.int64)
    host, offset = with_words(ints, words)
    assert host.dtype == np.int32 and offset % 4 == 0 and num_ints <= offset < num_ints + 4
    flat = to_device(host, "cpu")
    assert flat[:num_ints].tolist() == ints.tolist()
    assert words_view(flat, offset, len(words)).tolist() == words.tolist()
    alone, end = with_words(ints, None)
    assert alone.tolist() == ints.tolist() and end == num_ints


def test_unpacked_words_are_the_batch_build_makes():
    pack = SamplingPack.of(PARAMS, KEYS, 50)
    assert pack.words.shape[0] <= SamplingPack.max_words(len(PARAMS))
    built = SamplingBatch.build(PARAMS, KEYS, "cpu", 50)
    unpacked = pack.unpack(torch.from_numpy(pack.words.copy()))
    for name in ("temperatures", "keys", "top_ks", "top_ps", "min_ps"):
        assert torch.equal(getattr(built, name), getattr(unpacked, name)), name
    assert torch.equal(built.logprobs.rows, unpacked.logprobs.rows) and built.logprobs.k == unpacked.logprobs.k == 2
    assert (built.all_greedy, built.max_top_k) == (unpacked.all_greedy, unpacked.max_top_k) == (False, 5)
    with pytest.raises(ValueError, match="int64 words"):
        pack.unpack(torch.from_numpy(pack.words[:-1].copy()))


@pytest.mark.parametrize("batch", [3, 4, 5, 6, 9])  # each holds all of PARAMS: every part present
def test_every_unpacked_part_is_16_byte_aligned_at_any_batch_size(batch):
    params = (PARAMS * batch)[:batch]
    pack = SamplingPack.of(params, (KEYS * batch)[:batch], 50)
    assert pack.words.shape[0] <= SamplingPack.max_words(batch)
    # the words as a step's copy leaves them: after an odd number of int32s, in a fresh buffer
    host, offset = with_words(np.arange(7, dtype=np.int32), pack.words)
    flat = torch.from_numpy(host.copy())
    unpacked = pack.unpack(words_view(flat, offset, pack.words.shape[0]))
    built = SamplingBatch.build(params, (KEYS * batch)[:batch], "cpu", 50)
    parts = {"temperatures": unpacked.temperatures, "keys": unpacked.keys, "top_ks": unpacked.top_ks,
             "top_ps": unpacked.top_ps, "min_ps": unpacked.min_ps, "rows": unpacked.logprobs.rows}
    for name, part in parts.items():
        assert (part.data_ptr() - flat.data_ptr()) % 16 == 0, name
        expected = built.logprobs.rows if name == "rows" else getattr(built, name)
        assert torch.equal(part, expected), name


@pytest.mark.parametrize("kind", [StepKind.DECODE, StepKind.PREFILL])
@pytest.mark.parametrize("width", [3, 4])  # odd and even row widths: the words start 16-byte aligned
def test_step_inputs_carry_the_words_without_changing_the_step(kind, width):
    builder = StepInputBuilder(4, torch.device("cpu"), decode_table_width=width)
    lens = [1, 1, 1] if kind is StepKind.DECODE else [5, 3, 2]
    starts = [6, 2, 9] if kind is StepKind.DECODE else [0, 0, 0]
    plan = StepPlan(kind, starts=starts, num_new_tokens=lens, token_ids=list(range(1, sum(lens) + 1)),
                    block_tables=[[0, 1, 2], [3], [4, 5, 6]], sampled=[True] * 3,
                    num_decode=3 if kind is StepKind.DECODE else 0)
    pack = SamplingPack.of(PARAMS, KEYS, 50)
    if kind is StepKind.DECODE:
        plain, carrying = (builder.decode(plan, HostCopy.of(builder.decode_rows(plan, 3), words), None)
                           for words in (None, pack.words))
    else:
        layout = builder.exact_layout(plan)
        plain, carrying = (builder.varlen(plan, builder.varlen_copy(plan, layout, words), None)
                           for words in (None, pack.words))
    assert plain.sampling_words is None and carrying.sampling_words.tolist() == pack.words.tolist()
    assert torch.equal(plain.input_ids, carrying.input_ids) and torch.equal(plain.positions, carrying.positions)
    assert torch.equal(plain.meta.slot_mapping, carrying.meta.slot_mapping)
    assert torch.equal(plain.meta.block_tables, carrying.meta.block_tables)
    assert torch.equal(plain.sample_indices, carrying.sample_indices)


@pytest.mark.parametrize("tokens, seqs, tiles, width", [(1, 1, 2, 3), (7, 3, 5, 16), (33, 5, 0, 1), (64, 8, 9, 7)])
def test_every_varlen_section_starts_16_byte_aligned(tokens, seqs, tiles, width):
    layout = VarlenLayout(tokens, seqs, tiles, width)
    flat = torch.zeros(layout.size, dtype=torch.int32)
    sections = layout.split(flat)
    expected = [tokens, tokens, tokens, seqs + 1, seqs + 1, seqs, 1, tiles, tiles, 1, seqs, seqs * width]
    ends = []
    for section, n in zip(sections, expected):
        assert section.numel() == n
        if n:  # (an empty view's data pointer says nothing)
            offset = section.data_ptr() - flat.data_ptr()
            assert offset % 16 == 0
            ends.append((offset, offset + 4 * n))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # in order, no overlap
    assert ends[-1][1] <= 4 * layout.size
