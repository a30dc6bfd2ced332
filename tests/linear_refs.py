"""References shared by the linear-kernel tests (test_gemv.py, test_skinny_gemm.py): inputs, the
float64 error measure and the bound against the unfused torch path."""

import torch

DTYPES = [torch.float32, torch.bfloat16]
# Relative (Frobenius) error vs the float64 reference: the output's own rounding dominates.
REF_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def randn(shape, gen, dtype, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(dtype)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "output has NaN"
    return ((out.double() - ref).norm() / ref.norm()).item()


def near_torch(out, ref):
    """Within a few output ulp of the torch path (the float32 sums run in another order)."""
    tol = 1e-5 if out.dtype == torch.float32 else 4 * torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())
