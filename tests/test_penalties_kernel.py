"""The Triton penalties kernel (sampling/penalties_kernel.py) against a float64 reference of vLLM's
penalties: under the CPU interpreter on small shapes, compiled on CUDA at serving size; and the
PyTorch path (sampling/penalties.py) against the same reference on CPU."""

from __future__ import annotations

import pytest
import torch

from nanovllm.sampling.penalties import OUTPUT_STEP, PROMPT_MARK, penalize_rows as torch_penalize_rows

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
           pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]
# float32 against float64: a division and two products of values of order ten
ATOL = 1e-5


def reference(x: torch.Tensor, rows: list[int], counts: torch.Tensor, slots: list[int], rep, freq, pres):
    """float64, token by token: repetition on prompt or output tokens, then frequency and presence."""
    out = x.double().clone()
    for p, (r, s) in enumerate(zip(rows, slots)):
        for t in range(x.shape[1]):
            c = int(counts[s, t])
            generated = c // OUTPUT_STEP
            if c > 0:
                out[r, t] = out[r, t] / rep[p] if out[r, t] > 0 else out[r, t] * rep[p]
            out[r, t] -= freq[p] * generated + (pres[p] if generated > 0 else 0.0)
    return out


def case(vocab: int, batch: int, slots: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = 4 * torch.randn(batch, vocab, generator=g)
    x[:, :3] = torch.tensor([0.0, -0.0, 5.0])  # zeros and a positive: divided / multiplied alike
    counts = torch.zeros(slots, vocab, dtype=torch.int32)
    hit = torch.rand(slots, vocab, generator=g) < 0.3
    counts[hit] = PROMPT_MARK
    counts += OUTPUT_STEP * torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
    rows = torch.randperm(batch, generator=g)[: batch // 2 + 1].tolist()
    picks = torch.randperm(slots, generator=g)[: len(rows)].tolist()
    rep = (0.5 + 1.5 * torch.rand(len(rows), generator=g)).tolist()
    freq = (4 * torch.rand(len(rows), generator=g) - 2).tolist()
    pres = (4 * torch.rand(len(rows), generator=g) - 2).tolist()
    return x, rows, counts, picks, rep, freq, pres


def run(penalize, device, x, rows, counts, slots, rep, freq, pres, **kw):
    got = x.to(device).clone()
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    as_float = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    penalize(got, as_long(rows), counts.to(device), as_long(slots), as_float(rep), as_float(freq), as_float(pres), **kw)
    return got.cpu()


def run_from_source(penalize, device, x, rows, counts, slots, rep, freq, pres, **kw):
    """The penalized rows written into a zero float32 tensor from `x` in bfloat16 (the model's logits,
    copied and penalized in one pass); returns (output, the bfloat16 source's values)."""
    source = x.to(torch.bfloat16)
    got = torch.zeros(x.shape, device=device)
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    as_float = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
    penalize(got, as_long(rows), counts.to(device), as_long(slots), as_float(rep), as_float(freq), as_float(pres),
             source=source.to(device), **kw)
    return got.cpu(), source.float()


def check_from_source(penalize, device, args, **kw):
    got, source = run_from_source(penalize, device, *args, **kw)
    rows = args[1]
    torch.testing.assert_close(got[rows].double(), reference(source, *args[1:])[rows], rtol=ATOL, atol=ATOL)
    untouched = [r for r in range(got.shape[0]) if r not in rows]
    assert not got[untouched].any()  # rows not penalized are not written


def test_torch_path_matches_the_reference():
    args = case(vocab=300, batch=6, slots=5, seed=1)
    torch.testing.assert_close(run(torch_penalize_rows, "cpu", *args).double(), reference(*args), rtol=ATOL, atol=ATOL)
    check_from_source(torch_penalize_rows, "cpu", args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab,block", [(300, 128), (64, 64), (1000, 256)])
def test_kernel_matches_the_reference(device, vocab, block):
    from nanovllm.sampling.penalties_kernel import penalize_rows

    args = case(vocab=vocab, batch=5, slots=7, seed=vocab)
    got = run(penalize_rows, device, *args, block=block)
    torch.testing.assert_close(got.double(), reference(*args), rtol=ATOL, atol=ATOL)
    untouched = [r for r in range(5) if r not in args[1]]
    assert torch.equal(got[untouched], args[0][untouched])
    check_from_source(penalize_rows, device, args, block=block)


@pytest.mark.gpu
def test_kernel_at_serving_size_matches_the_pytorch_path():
    from nanovllm.sampling.penalties_kernel import penalize_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, batch = 151_936, 256
    x = 4 * torch.randn(batch, vocab, generator=g, device="cuda")
    counts = torch.randint(0, 7, (300, vocab), generator=g, device="cuda", dtype=torch.int32)
    rows = torch.randperm(batch, generator=g, device="cuda")[:200]
    slots = torch.randperm(300, generator=g, device="cuda")[:200]
    rep, freq, pres = (1 + torch.rand(200, generator=g, device="cuda") for _ in range(3))
    want, got = x.clone(), x.clone()
    torch_penalize_rows(want, rows, counts, slots, rep, freq, pres)
    penalize_rows(got, rows, counts, slots, rep, freq, pres)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    source = x.to(torch.bfloat16)  # every row from the model's logits: the copy and the penalties in one pass
    rows, slots = torch.randperm(batch, generator=g, device="cuda"), torch.randperm(300, generator=g, device="cuda")[:batch]
    rep, freq, pres = (1 + torch.rand(batch, generator=g, device="cuda") for _ in range(3))
    want, got = torch.zeros_like(x), torch.zeros_like(x)
    torch_penalize_rows(want, rows, counts, slots, rep, freq, pres, source=source)
    penalize_rows(got, rows, counts, slots, rep, freq, pres, source=source)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_the_problem():
    from nanovllm.sampling.penalties_kernel import penalize_rows

    x, rows, counts, slots = torch.zeros(2, 8), torch.tensor([0]), torch.zeros(3, 8, dtype=torch.int32), torch.tensor([1])
    f = torch.ones(1)
    with pytest.raises(ValueError, match="x must be a 2-D float32"):
        penalize_rows(x.double(), rows, counts, slots, f, f, f)
    with pytest.raises(ValueError, match=r"counts must be \[slots, 8\] int32"):
        penalize_rows(x, rows, counts.long(), slots, f, f, f)
    with pytest.raises(ValueError, match=r"source must be a float tensor of x's shape \(2, 8\)"):
        penalize_rows(x, rows, counts, slots, f, f, f, source=torch.zeros(2, 9))
    with pytest.raises(ValueError, match="block must be a power of two, got 48"):
        penalize_rows(x, rows, counts, slots, f, f, f, block=48)
