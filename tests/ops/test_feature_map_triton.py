"""The feature map ``elu + 1`` of the queries and keys in kernels (``ops/common/feature_map.py``, kernels in
``ops/common/triton/feature_map.py``) against ``F.elu(x) + 1`` and its autograd in float64: float32 and 16-bit
inputs, values around zero and far on both sides, inputs of different sizes and strides, no elements; one launch each
way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.common import feature_map as fm
from attnkit.ops.common.triton import feature_map as kernels
from attnkit.ops.common.triton_utils import interpreting
from tests.helpers import assert_close, full_size_ops_outside_kernels, launch_counter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(dtype):
    """``q [2, 700, 3]`` (five blocks, the last partial) and ``k [2, 19, 2, 24]`` (a slice: strided), spread
    over ``[-12, 12]`` with exact zeros and values beyond float16's ``exp`` range on both sides in ``q``."""
    q = 4 * torch.randn(2, 700, 3, device=DEVICE)
    q.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e-8, -1e-8, -30.0, 12.0])
    k = 3 * torch.randn(2, 19, 2, 40, device=DEVICE)[..., 8:32]
    return q.to(dtype).requires_grad_(), k.to(dtype).detach().requires_grad_()


def rounded_tol(dtype):
    """One unit in the last place in RMS for 16-bit results (the kernels round once, to nearest on a GPU; the
    interpreter truncates to bfloat16), float32's own for float32."""
    return 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_elu_plus_one_matches_float64(monkeypatch, dtype):
    forward = launch_counter(monkeypatch, kernels, "elu_plus_one_fwd_kernel")
    backward = launch_counter(monkeypatch, kernels, "elu_plus_one_bwd_kernel")
    q, k = inputs(dtype)
    fq, fk = fm.elu_plus_one(q, k)
    dfq, dfk = torch.randn_like(fq), torch.randn_like(fk).transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk = torch.autograd.grad((fq, fk), (q, k), (dfq, dfk))
    assert forward == backward == [(5, 2)]  # q's 4200 elements in five programs of 1024, k's 1824 in their first two
    for name, x, y, dy, dx in (("q", q, fq, dfq, dq), ("k", k, fk, dfk, dk)):
        x64 = x.detach().double().requires_grad_()
        y64 = F.elu(x64) + 1
        (dx64,) = torch.autograd.grad(y64, x64, dy.double())
        assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == x.shape
        assert_close(f"φ({name})", y, y64, rounded_tol(dtype))
        assert_close(f"d{name}", dx, dx64, rounded_tol(dtype))
        if dtype == torch.float16 or (dtype == torch.bfloat16 and not interpreting()):  # rounded to nearest, once
            exact = (F.elu(x64.detach()) + 1).to(dtype)
            assert (y == exact).double().mean() > 0.99, f"φ({name}): not rounded once"
    assert torch.equal(fq.view(-1)[:4].float(), torch.tensor([1.0, 1.0, 1.0, 1.0], device=DEVICE))
    assert fq.view(-1)[5] == 13.0 and torch.isfinite(fq).all() and torch.isfinite(dq).all()


def test_elu_plus_one_keeps_nan():
    q = torch.tensor([float("nan"), -1.0, 2.0], device=DEVICE)
    fq, fk = fm.elu_plus_one(q, q)
    assert torch.isnan(fq[0]) and torch.isnan(fk[0]) and torch.isfinite(fq[1:]).all()


def test_elu_plus_one_without_elements(monkeypatch):
    """No elements in either: no launch, empty outputs and gradients; one empty and one not: the other's values."""
    launches = launch_counter(monkeypatch, kernels, "elu_plus_one_fwd_kernel")
    q, k = (torch.randn(2, 0, 3, 4, device=DEVICE, requires_grad=True) for _ in range(2))
    fq, fk = fm.elu_plus_one(q, k)
    (fq.sum() + fk.sum()).backward()
    assert fq.shape == q.shape and q.grad.shape == q.shape and launches == []
    k = torch.randn(5, device=DEVICE)
    torch.testing.assert_close(fm.elu_plus_one(q.detach(), k)[1], F.elu(k) + 1)


def test_elu_plus_one_copies_nothing_outside_the_kernels():
    """Contiguous ``[B, T, H, D]`` projections, as the VLA layer hands them: no copy, cast or arithmetic of their
    size outside the two launches."""
    q, k = (torch.randn(2, 40, 2, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dfq, dfk = torch.randn_like(q), torch.randn_like(k)

    def step():
        torch.autograd.grad(fm.elu_plus_one(q, k), (q, k), (dfq, dfk))

    counts = full_size_ops_outside_kernels(step, q.numel())
    assert not counts, counts


def test_elu_plus_one_validation_and_opcheck():
    q = torch.randn(3, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(ValueError, match="k: expected a float tensor"):
        fm.elu_plus_one(q, torch.ones(3, 8, dtype=torch.int64, device=DEVICE))
    k = torch.randn(2, 5, device=DEVICE, dtype=torch.float16, requires_grad=True)
    torch.library.opcheck(fm.elu_plus_one_op, (q, k))
    args = (q.detach(), k.detach(), torch.randn(3, 8, device=DEVICE), torch.randn(2, 5, device=DEVICE))
    torch.library.opcheck(fm.elu_plus_one_bwd_op, args)
