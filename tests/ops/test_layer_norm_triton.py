"""The fused LayerNorm (``ops/common/layer_norm.py``, kernels in ``ops/common/triton/layer_norm.py``) against
``F.layer_norm`` and its autograd in float64: the output in the dtype asked for, ``dx`` in ``x``'s, the weight's
and bias's gradients, for 16-bit and float32 inputs, widths that are not powers of two, blocks of rows that ``M``
does not fill, strided inputs and gradients, no bias, no rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.common import layer_norm as ln
from attnkit.ops.common.triton import layer_norm as kernels
from attnkit.ops.common.triton_utils import interpreting
from tests.helpers import assert_close, full_size_ops_outside_kernels, launch_counter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (M, N): three blocks of 128, 64 and 4 rows, the last partial, over the backward's two programs (interpreter)
SHAPES = [(300, 24), (150, 40), (13, 1000)]
DTYPES = [(F32, F32), (F32, BF16), (F16, F32), (F16, F16), (BF16, F32), (BF16, BF16)]


def reference(x, w, b, dy, eps=1e-5):
    """``F.layer_norm``'s output and the gradients of ``x``, ``w``, ``b`` in float64 from the same values."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = F.layer_norm(x64, (x.shape[-1],), w64, b64, eps)
    leaves = (x64, w64) if b is None else (x64, w64, b64)
    return y64, torch.autograd.grad(y64, leaves, dy.double())


def params(N, bias=True):
    w = (1 + 0.5 * torch.randn(N, device=DEVICE)).requires_grad_()
    return w, torch.randn(N, device=DEVICE).requires_grad_() if bias else None


def run(x, w, b, out_dtype, dy=None):
    y = ln.layer_norm(x, w, b, 1e-5, out_dtype)
    dy = torch.randn(y.shape, device=DEVICE).to(out_dtype) if dy is None else dy
    leaves = (x, w) if b is None else (x, w, b)
    return y, dy, torch.autograd.grad(y, leaves, dy)


def rounded(x64, dtype):
    """``x64`` rounded to ``dtype`` as the kernels round their float32 results: to nearest on a GPU; Triton's
    interpreter truncates float32 to bfloat16."""
    if interpreting() and dtype == BF16:
        return (x64.float().view(torch.int32) & -(1 << 16)).view(F32).to(BF16)
    return x64.to(dtype)


def assert_rounded(name, actual, expected64):
    """``actual`` (16-bit) is ``expected64`` rounded once: within one unit in the last place everywhere, equal to
    the rounded value almost everywhere (float32 statistics move a value across a rounding boundary only near one),
    and within a unit in RMS."""
    eps = torch.finfo(actual.dtype).eps
    scale = expected64.pow(2).mean().sqrt()
    err = (actual.double() - expected64).abs()
    assert (err <= eps * expected64.abs() + 1e-5 * scale).all(), f"{name}: {err.max().item():.3e} off"
    assert (actual == rounded(expected64, actual.dtype)).double().mean() > 0.99, f"{name}: not rounded once"
    assert_close(name, actual, expected64, eps)


@pytest.mark.parametrize("x_dtype, out_dtype", DTYPES, ids=[f"{str(a)[6:]}-to-{str(b)[6:]}" for a, b in DTYPES])
@pytest.mark.parametrize("M, N", SHAPES, ids=[f"M{m}-N{n}" for m, n in SHAPES])
def test_layer_norm_matches_float64(M, N, x_dtype, out_dtype):
    x = (3 + 2 * torch.randn(M, N, device=DEVICE)).to(x_dtype).requires_grad_()  # off zero mean and unit variance
    w, b = params(N)
    y, dy, (dx, dw, db) = run(x, w, b, out_dtype)
    y64, (dx64, dw64, db64) = reference(x, w, b, dy)
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (out_dtype, x_dtype, F32, F32)
    if out_dtype == F32:
        assert_close("y", y, y64, 1e-6)
    else:
        assert_rounded("y", y, y64)
    if x_dtype == F32:
        assert_close("dx", dx, dx64, 1e-5)
    else:
        assert_close("dx", dx, dx64, torch.finfo(x_dtype).eps)
    assert_close("dw", dw, dw64, 1e-5)
    assert_close("db", db, db64, 1e-5)


@pytest.mark.parametrize("layout", ["rows", "columns", "tokens"])
def test_layer_norm_reads_through_strides(layout):
    """Rows at a stride past ``N`` (a slice of a wider buffer), every other column, and ``[B, T, N]`` slices of a
    fused buffer through the public function; no bias; the incoming gradient a transposed view. The forward and
    backward copy nothing of full size outside the kernels."""
    M, N = 150, 40
    base = torch.randn(M, 3 * N, device=DEVICE)
    x = {"rows": base[:, N : 2 * N], "columns": base[:, ::3], "tokens": base.view(2, 75, 3 * N)[..., N : 2 * N]}[layout]
    x = x.detach().requires_grad_()
    assert not x.is_contiguous()
    w, _ = params(N)
    dy = torch.randn(N, M, device=DEVICE).t().reshape(x.shape)
    y, _, (dx, dw) = run(x, w, None, F32, dy)
    y64, (dx64, dw64) = reference(x, w, None, dy)
    assert_close("y", y, y64, 1e-6)
    assert_close("dx", dx, dx64, 1e-5)
    assert_close("dw", dw, dw64, 1e-5)
    if layout == "tokens":
        dy16 = dy.bfloat16()
        counts = full_size_ops_outside_kernels(lambda: run(x, w, None, BF16, dy16), M * N)
        assert not counts, counts


def test_layer_norm_wide_rows():
    """``N = 8192`` (one row a block) and ``N = 16384``, the widest."""
    for N in (8192, 16384):
        x = torch.randn(3, N, device=DEVICE).requires_grad_()
        w, b = params(N)
        y, dy, (dx, dw, db) = run(x, w, b, F32)
        y64, (dx64, dw64, db64) = reference(x, w, b, dy)
        for name, actual, expected in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64), ("db", db, db64)):
            assert_close(f"{name} at N = {N}", actual, expected, 1e-5)


def test_layer_norm_without_rows(monkeypatch):
    """``M = 0``: no launch of the forward (no empty grid), an empty output, and zero gradients of the weight and
    bias (no partial sums to reduce), as PyTorch's."""
    forward = launch_counter(monkeypatch, kernels, "layer_norm_fwd_kernel")
    backward = launch_counter(monkeypatch, kernels, "layer_norm_bwd_kernel")
    x = torch.randn(2, 0, 40, device=DEVICE, dtype=BF16).requires_grad_()
    w, b = params(40)
    y, _, (dx, dw, db) = run(x, w, b, BF16)
    assert y.shape == (2, 0, 40) and y.dtype == BF16 and dx.shape == x.shape and dx.dtype == BF16
    assert torch.equal(dw, torch.zeros(40, device=DEVICE)) and torch.equal(db, torch.zeros(40, device=DEVICE))
    assert forward == backward == []


def test_layer_norm_validation():
    w, b = params(40)
    with pytest.raises(ValueError, match="x: expected a float tensor"):
        ln.layer_norm(torch.randn(2, kernels.MAX_N + 1, device=DEVICE), w, b, 1e-5, F32)
    with pytest.raises(ValueError, match="weight: expected a float tensor \\[24\\]"):
        ln.layer_norm(torch.randn(2, 24, device=DEVICE), w, None, 1e-5, F32)
    with pytest.raises(ValueError, match="bias: expected"):
        ln.layer_norm(torch.randn(2, 40, device=DEVICE), w, b[:20], 1e-5, F32)
    with pytest.raises(ValueError, match="out_dtype"):
        ln.layer_norm(torch.randn(2, 40, device=DEVICE), w, b, 1e-5, torch.int32)


def test_layer_norm_opcheck():
    x = torch.randn(37, 40, device=DEVICE, dtype=BF16, requires_grad=True)
    w, b = params(40)
    torch.library.opcheck(ln.layer_norm_op, (x, w, b, 1e-5, BF16))
    torch.library.opcheck(ln.layer_norm_op, (x, w, None, 1e-5, F32))
    y, mean, rstd = ln.layer_norm_op(x, w, b, 1e-5, BF16)
    torch.library.opcheck(ln.layer_norm_bwd_op, (torch.randn_like(y), x.detach(), mean, rstd, w.detach()))
