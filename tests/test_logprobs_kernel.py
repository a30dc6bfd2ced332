"""The Triton logprobs kernel (sampling/logprobs_kernel.py) against a float64 log_softmax: under the CPU
interpreter on small shapes, compiled on CUDA at serving size."""

from __future__ import annotations

import pytest
import torch

from nanovllm.sampling.logprobs_kernel import LogprobsWorkspace, chunk_columns, row_logprobs

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# float32 normaliser and logits against float64: a few ulps of values of order ten.
ATOL = 1e-4


def reference(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(1, tokens[:, None]).squeeze(1), lp


def ranked(logits: torch.Tensor, k: int):
    """(float64 log_softmax [B, V], each row's k best ids [B, k]: by descending logit, the lower id
    first among equal ones (a stable descending sort of the exact logits))."""
    x = logits.double()
    return torch.log_softmax(x, dim=-1), torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]


def sorted_ranks(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B] int64: each token's rank from a full descending sort of its row (exact float64 values):
    the count of entries >= its logit, found by binary search in the sorted row (vLLM's rank: ties
    share the worse place)."""
    desc = torch.sort(logits.double(), dim=1, descending=True).values  # [B, V]
    own = logits.double().gather(1, tokens[:, None])  # [B, 1]
    return torch.searchsorted(-desc, -own, right=True).squeeze(1)


def check_exact(logits: torch.Tensor, tokens: torch.Tensor, k: int, **kw) -> None:
    """row_logprobs on every row: the chosen logprobs and top logprobs within ATOL of float64, the
    top ids exactly the reference's (ties to the lower id), the ranks exactly a full sort's."""
    chosen, ranks, top_ids, top_lps = row_logprobs(logits, tokens, k, **kw)
    lp, want_ids = ranked(logits.cpu(), k)
    assert torch.equal(ranks.cpu(), sorted_ranks(logits.cpu(), tokens.cpu()))
    assert torch.allclose(chosen.cpu().double(), lp.gather(1, tokens.cpu()[:, None]).squeeze(1), atol=ATOL)
    assert torch.equal(top_ids.cpu(), want_ids), (top_ids.cpu(), want_ids)
    assert torch.allclose(top_lps.cpu().double(), lp.gather(1, want_ids), atol=ATOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_matches_float64_log_softmax(device, dtype, k):
    rows, vocab, block = (5, 3 * 256 - 17, 256) if device == "cpu" else (256, 151_936, None)
    # drawn, and the float64 reference computed, on the device under test (39M values on CUDA)
    g = torch.Generator(device=device).manual_seed(k)
    logits = (4 * torch.randn(rows, vocab, generator=g, device=device)).to(dtype)
    logits[1, 100:110] = logits[1].max()  # ties at the top: the lower ids rank first within a chunk
    tokens = torch.randint(0, vocab, (rows,), generator=g, device=device)
    tokens[0] = logits[0].argmax()
    kw = {"block": block} if block else {}
    chosen, ranks, top_ids, top_lps = row_logprobs(logits, tokens, k, **kw)
    want, lp = reference(logits, tokens, k)
    assert chosen.dtype == top_lps.dtype == torch.float32 and top_ids.dtype == ranks.dtype == torch.int64
    assert torch.equal(ranks.cpu(), sorted_ranks(logits.cpu(), tokens.cpu()))
    assert ranks[0].item() == int((logits[0] == logits[0].max()).sum())  # row 0's argmax: 1 unless tied
    assert top_ids.shape == top_lps.shape == (rows, k)
    assert torch.allclose(chosen.double(), want, atol=ATOL)
    if k:
        top_lps = top_lps.double()
        # each listed token's logprob is its own, in descending order, and no better token is left out
        assert torch.allclose(top_lps, lp.gather(1, top_ids), atol=ATOL)
        assert (top_lps[:, :-1] >= top_lps[:, 1:] - ATOL).all()
        kth = lp.topk(k, dim=1).values[:, -1:]
        assert torch.allclose(top_lps[:, -1:], kth, atol=ATOL)
        assert all(len(set(r)) == k for r in top_ids.tolist())  # distinct ids


@pytest.mark.parametrize("device", DEVICES)
def test_row_strides_and_empty_batches(device):
    vocab, block = (300, 128) if device == "cpu" else (151_936, None)
    kw = {"block": block} if block else {}
    wide = torch.randn(3, vocab + 64).to(device)
    logits = wide[:, :vocab]  # rows of a wider buffer (the LM head's padded vocabulary)
    tokens = torch.tensor([0, 5, vocab - 1], device=device)
    chosen, ranks, top_ids, _ = row_logprobs(logits, tokens, 3, **kw)
    want, lp = reference(logits.cpu(), tokens.cpu(), 3)
    assert torch.allclose(chosen.cpu().double(), want, atol=ATOL)
    assert (top_ids.cpu() < vocab).all()
    assert torch.equal(ranks.cpu(), sorted_ranks(logits.cpu(), tokens.cpu()))  # padding columns never count
    none = row_logprobs(logits[:0], tokens[:0], 2, **kw)
    assert [tuple(t.shape) for t in none] == [(0,), (0,), (0, 2), (0, 2)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_subset_of_rows_is_scored_in_place(device):
    """`rows` picks the scored rows of logits and tokens (the sampler's asking rows), in their order."""
    from nanovllm.sampling.row_logprobs import token_logprobs

    vocab, block = (300, 128) if device == "cpu" else (151_936, None)
    kw = {"block": block} if block else {}
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g).to(device)
    tokens = torch.randint(0, vocab, (6,), generator=g).to(device)
    rows = torch.tensor([4, 1, 5], device=device)
    chosen, ranks, top_ids, top_lps = row_logprobs(logits, tokens, 4, rows, **kw)
    want, lp = reference(logits.cpu()[rows.cpu()], tokens.cpu()[rows.cpu()], 4)
    assert torch.allclose(chosen.cpu().double(), want, atol=ATOL)
    assert torch.allclose(top_lps.cpu().double(), lp.topk(4, dim=1).values, atol=ATOL)
    assert torch.equal(ranks.cpu(), sorted_ranks(logits.cpu()[rows.cpu()], tokens.cpu()[rows.cpu()]))
    twin = token_logprobs(logits.cpu(), tokens.cpu(), 4, rows.cpu())  # the CPU path's same contract
    assert torch.equal(twin.top_ids, top_ids.cpu()) and torch.allclose(twin.chosen, chosen.cpu(), atol=ATOL)
    assert torch.equal(twin.ranks, ranks.cpu())


def test_bad_arguments_name_the_problem():
    logits = torch.randn(2, 50)
    tokens = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="k must be an int"):
        row_logprobs(logits, tokens, 1.0)
    with pytest.raises(ValueError, match="k must be in"):
        row_logprobs(logits, tokens, 51)
    with pytest.raises(TypeError, match="token_ids"):
        row_logprobs(logits, tokens.int(), 1)
    with pytest.raises(TypeError, match="logits dtype"):
        row_logprobs(logits.double(), tokens, 1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        row_logprobs(logits.t(), tokens, 1)
    with pytest.raises(TypeError, match="rows must be"):
        row_logprobs(logits, tokens, 1, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="block must be a power of two, got 48"):
        row_logprobs(logits, tokens, 1, block=48)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_rank_the_lower_id_first_across_groups_and_chunks(device):
    """Equal logits in one group, in different groups of a chunk and in different chunks (block 256:
    8 groups of 32 columns a chunk): the k best are the lowest ids among the ties, as a stable sort."""
    vocab, block = 3 * 256 - 40, 256
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=g)
    logits[0] = 0.25  # all equal: ids 0..k-1
    logits[1, [700, 600, 300, 299, 40, 5, 260]] = 9.0  # one tie over three chunks, five groups
    logits[2, 513:520] = 9.0  # seven ties in one group of the last chunk ...
    logits[2, [511, 100]] = 9.0  # ... behind two in earlier chunks
    logits[3, 256:288] = 7.0  # a whole group tied, one more in the next group and the previous chunk
    logits[3, [288, 255]] = 7.0
    logits[4, 40:45] = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0])  # the top 5 in 5 adjacent columns of one group
    logits[5, ::2] = 1.0  # half the row tied below a runner-up in every chunk
    logits[5, 1::64] = 2.0
    tokens = torch.tensor([0, 5, 513, 700, 41, 3])
    for k in (1, 5, 9, 20):
        check_exact(logits.to(device), tokens.to(device), k, block=block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,block,k", [(300, 128, 5), (7, 16, 7), (70, 32, 20), (33, 32, 5), (515, 64, 64),
                                           (1000, 512, 5)])
def test_few_distinct_values_ragged_chunks_and_single_group_blocks(device, dtype, vocab, block, k):
    """Small integer logits (ties everywhere), vocabularies that leave a last chunk with fewer than k
    columns (7: one chunk, 33: one column in the last), blocks of one group (16, 32) or two (64)."""
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randint(-3, 4, (4, vocab), generator=g).to(dtype)
    logits[3] = torch.randn(vocab, generator=g).to(dtype)
    tokens = torch.randint(0, vocab, (4,), generator=g)
    check_exact(logits.to(device), tokens.to(device), k, block=block)
    check_exact(logits.to(device), tokens.to(device), 0, block=block)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True], ids=["fresh", "workspace"])
def test_calls_in_a_row_on_different_inputs(device, shared):
    """A second call (other shapes, other values, other rows) is not affected by the first, whether
    each call takes fresh scratch or all share one LogprobsWorkspace (grown by the larger calls,
    its counters back at 0 after each call)."""
    g = torch.Generator().manual_seed(11)
    first = torch.randn(4, 500, generator=g)
    second = 3 * torch.randn(6, 400, generator=g)
    t1, t2 = torch.randint(0, 500, (4,), generator=g), torch.randint(0, 400, (6,), generator=g)
    ws = LogprobsWorkspace() if shared else None
    for _ in range(2):
        check_exact(first.to(device), t1.to(device), 5, block=128, workspace=ws)
        check_exact(second.to(device), t2.to(device), 3, block=128, workspace=ws)
        check_exact(second.to(device), t2.to(device), 3, block=64, workspace=ws)
        check_exact(first.to(device), t1.to(device), 1, block=64, workspace=ws)
    rows = torch.tensor([5, 0, 2])
    chosen, _, top_ids, _ = row_logprobs(second.to(device), t2.to(device), 3, rows.to(device), block=128, workspace=ws)
    lp, want_ids = ranked(second[rows], 3)
    assert torch.allclose(chosen.cpu().double(), lp.gather(1, t2[rows][:, None]).squeeze(1), atol=ATOL)
    assert torch.equal(top_ids.cpu(), want_ids)
    if shared:
        assert ws.counters.numel() == 6 and not bool(ws.counters.any())


@pytest.mark.parametrize("device", DEVICES)
def test_a_chunk_of_minus_infinity_adds_nothing(device):
    """Masked logits (-inf) over a whole chunk: the row's logprobs are those of its finite part."""
    vocab, block = 600, 128
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab, generator=g)
    logits[0, 128:256] = float("-inf")
    logits[1, 512:] = float("-inf")  # the last (ragged) chunk
    logits[2, :-3] = float("-inf")  # three finite logits, all in the last chunk
    tokens = torch.tensor([3, 500, vocab - 1])
    check_exact(logits.to(device), tokens.to(device), 3, block=block)


@pytest.mark.gpu
def test_many_chunks_combine_under_contention():
    """CUDA: thousands of programs per row arrive at a row's counter concurrently (block 64 at a
    151,936 vocabulary: 2374 chunks), over many rows and calls: the last one to arrive sees them all."""
    g = torch.Generator(device="cuda").manual_seed(4)
    for call in range(3):
        logits = (2 * torch.randn(64, 151_936, generator=g, device="cuda")).to(torch.bfloat16)
        logits[:, 1000 * call: 1000 * call + 40] = logits.max()  # ties in one chunk's neighbours
        tokens = torch.randint(0, 151_936, (64,), generator=g, device="cuda")
        for block in (64, 1024):
            check_exact(logits, tokens, 5, block=block)


@pytest.mark.interpreter
@pytest.mark.parametrize("k", [0, 8, 20])
def test_default_columns_by_k_are_exact(k):
    """The default chunk width (chunk_columns: 4,096 / 8,192 / 16,384 columns at k = 0 / 8 / 20) over a
    vocabulary of 20,000, so each width leaves a ragged last chunk: exact against float64."""
    assert [chunk_columns(j) for j in (0, 5, 6, 10, 11, 20)] == [4096, 4096, 8192, 8192, 16384, 16384]
    g = torch.Generator().manual_seed(20 + k)
    logits = 4 * torch.randn(2, 20_000, generator=g)
    logits[1, 19_990:] = logits[1].max()  # ties at the top in the last, ragged chunk
    tokens = torch.tensor([int(logits[0].argmax()), 7])
    check_exact(logits, tokens, k)
