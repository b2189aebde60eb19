"""TAPA's distance power off the diagonal from a series (issue 17, item 5): ``(d + t)^alpha`` of a tile far from the
diagonal as ``Σ_k binom(alpha, k)·d^(alpha−k)·t^k`` on the FMA pipe, ``d`` each row's exact distance at the tile's
centre column. Off by default (``common.SERIES_ORDER = 0``) until timed on a GPU.

The truncation bound (``series_truncation``) is checked against the series in float64, the kernels' float32
``r`` against float64 ``d^alpha`` at every distance of a 64k sequence, and the kernels with the series against the
PyTorch backend (under the interpreter on CPU, at real sizes on a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from attnkit.ops.tapa import tapa_attention
from attnkit.ops.tapa.torch_impl import MAX_DISTANCE_POWER_LOG2
from attnkit.ops.tapa.triton import backward, forward
from attnkit.ops.tapa.triton.backward import tapa_bwd_fn
from attnkit.ops.tapa.triton.common import (
    NEVER,
    SERIES_MAX_RATIO,
    SERIES_TOLERANCE,
    distance_factor,
    distance_factor_series,
    series_gap,
    series_truncation,
)
from attnkit.ops.tapa.triton.forward import tapa_fwd_fn
from tests.helpers import assert_close, rel_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHAS = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]


def series_error(alpha, order, d, t):
    """``max |Σ_{k<=order} binom(alpha,k)·(t/d)^k − (1 + t/d)^alpha| / (1 + t/d)^alpha`` in float64."""
    x = t[None, :] / d[:, None]
    terms, term = torch.zeros_like(x), torch.ones_like(x)
    for k in range(order + 1):
        terms += term
        term = term * x * (alpha - k) / (k + 1)
    exact = (1 + x) ** alpha
    return ((terms - exact).abs() / exact).max().item()


@pytest.mark.parametrize("columns", [16, 32, 64, 128])
@pytest.mark.parametrize("order", [2, 3, 4, 6])
def test_truncation_bound_holds_and_the_gap_is_the_smallest(columns, order):
    """At ``series_gap`` the truncation is within its bound, the bound within the tolerance; one token closer the
    bound is not, or ``t/d`` would pass ``SERIES_MAX_RATIO`` (the gap is the smallest that both allow)."""
    h = (columns - 1) / 2
    t = torch.arange(columns, dtype=torch.float64) - h
    for alpha in ALPHAS:
        gap = series_gap(alpha, columns, order)
        assert 1 <= gap < NEVER, alpha
        d = gap + h + torch.arange(64, dtype=torch.float64)  # the tile's rows, the nearest first
        bound = series_truncation(alpha, order, h / (gap + h))
        assert series_error(alpha, order, d, t) <= bound + 1e-12 and bound <= SERIES_TOLERANCE, alpha  # float64
        assert h / (gap + h) <= SERIES_MAX_RATIO < h / (gap - 1 + h) or (
            series_truncation(alpha, order, h / (gap - 1 + h)) > SERIES_TOLERANCE
        ), alpha
        if alpha == int(alpha) and alpha <= order:
            assert bound == 0 and h / (gap - 1 + h) > SERIES_MAX_RATIO, alpha  # a polynomial: the series is exact


def test_off_and_alpha_zero_never_take_the_series():
    assert series_gap(0.5, 64, 0) == NEVER and series_gap(0.0, 64, 4) == NEVER
    assert series_truncation(40.0, 4, 0.01) == math.inf  # the bound needs order + 1 >= (alpha − 1)/2


@triton.jit
def _factor_kernel(d_rows, t_cols, r_series, r_exact, alpha, log2_scale, R: tl.constexpr, C: tl.constexpr,
                   ORDER: tl.constexpr):  # fmt: skip
    """One tile's distance factor both ways: rows at distances ``d_rows [R]`` from the centre column, columns at
    offsets ``t_cols [C]``; the exact path from the positions ``m = d``, ``n = −t``."""
    o_r, o_c = tl.arange(0, R), tl.arange(0, C)
    b_d, b_t = tl.load(d_rows + o_r), tl.load(t_cols + o_c)
    p = o_r[:, None] * C + o_c[None, :]
    tl.store(r_series + p, distance_factor_series(b_d, b_t, alpha, log2_scale, ORDER))
    tl.store(r_exact + p, distance_factor(b_d, -b_t, alpha, log2_scale, False, False))


def factors(alpha, order, d, columns, phase_dim=32):
    """``(series, exact, float64)`` distance factors of the tiles whose rows sit at distances ``d`` from their
    centre column."""
    h = (columns - 1) / 2
    t = torch.arange(columns, dtype=torch.float64) - h
    log2_scale = -0.5 * math.log2(phase_dim)
    series, exact = (torch.empty(len(d), columns, device=DEVICE) for _ in range(2))
    R = len(d)
    _factor_kernel[(1,)](
        d.float().to(DEVICE), t.float().to(DEVICE), series, exact, alpha, log2_scale, R, columns, order
    )
    truth = (d[:, None] + t[None, :]) ** alpha * 2**log2_scale
    return series.cpu().double(), exact.cpu().double(), truth


def max_rel(a, b):
    return ((a - b).abs() / b).max().item()


@pytest.mark.parametrize("order", [3, 4, 6])
@pytest.mark.parametrize("columns", [32, 64])
def test_float32_factor_up_to_64k(order, columns):
    """At every row distance from the gap to 64k (every 7th, plus the extremes) and for every alpha up to the
    largest the op takes there (``(L − 1)^alpha <= 2^16``: alpha = 1 at 64k), the series' float32 ``r`` is within
    float32 rounding of the float64 truth, as the exact path's is, and no worse than it by more than three half ulps
    (the truncation's and Horner's roundings)."""
    for L, alpha in [(65536, 0.1), (65536, 0.5), (65536, 1.0), (4096, 1.3), (600, 1.7)]:
        assert alpha * math.log2(L - 1) <= MAX_DISTANCE_POWER_LOG2
        gap = series_gap(alpha, columns, order)
        h = (columns - 1) / 2
        if gap + 2 * h >= L:
            continue  # no tile of the sequence is that far from the diagonal
        d = torch.cat([torch.arange(gap + h, L - h, 7.0, dtype=torch.float64), torch.tensor([L - 1 - h])])
        d = torch.cat([d, d[-1:].expand(triton.next_power_of_2(len(d)) - len(d))])  # tl.arange: a power of 2
        series, exact, truth = factors(alpha, order, d, columns)
        err_series, err_exact = max_rel(series, truth), max_rel(exact, truth)
        assert err_series <= 2e-6, (L, alpha, err_series)
        assert err_series <= err_exact + 3 * 2**-24, (L, alpha, err_series, err_exact)


def outputs(q, k, v, do, alpha, cu=None, series_order=0, configs=(None, None)):
    """``(o, dq, dk, dv)`` of the Triton kernels with the series of ``series_order`` (0: exact)."""
    o, lse = tapa_fwd_fn(q, k, v, q.shape[-1] // 2, alpha, cu, config=configs[0], series_order=series_order)
    grads = tapa_bwd_fn(
        q, k, v, o, lse, do, q.shape[-1] // 2, alpha, cu, config=configs[1], series_order=series_order
    )  # fmt: skip
    return (o, *grads)


def reference(q, k, v, do, alpha, cu=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = tapa_attention(q, k, v, alpha=alpha, cu_seqlens=cu, backend="torch")
    return (o, *torch.autograd.grad(o, (q, k, v), do))


TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 1e-2)}
# The GPU's blocks (64-key tiles: series from the gap ~400 on) and its dQ by atomics from the dK/dV kernel; under
# the interpreter the default blocks are 16 wide (series from ~100 on).
CONFIGS = {
    "interpreter-blocks": (None, None),
    "atomic-dq": ((64, 32, 4, 2), {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2), "atomic_dq": True}),
}


# config, dtype, alpha, T: the interpreter is slow, so a few cells, each with many tiles past the gap
KERNEL_CASES = [
    ("interpreter-blocks", torch.float32, 0.1, 320),
    ("interpreter-blocks", torch.float16, 0.5, 320),
    ("interpreter-blocks", torch.float32, 1.0, 320),  # an exact polynomial: the gap is the ratio cap
    ("atomic-dq", torch.float32, 0.5, 480),
]


@pytest.mark.parametrize(
    "config, dtype, alpha, T", KERNEL_CASES, ids=[f"{c}-{str(d)[6:]}-alpha{a}-T{T}" for c, d, a, T in KERNEL_CASES]
)
def test_kernels_with_the_series_match_torch_backend(config, dtype, alpha, T):
    """Forward and every gradient with the series (order 4) on the tiles past the gap, on a packed batch (an empty
    and a short sequence before the long one): as close to the float64 PyTorch backend as the exact kernels are
    (within 1.25× their error), and within the kernels' bars of the float32 one where the phases leave float32 its
    digits (alpha = 1 at T = 320 reaches 300 cycles, where both kernels and the float32 backend are ~1e-4 apart)."""
    torch.manual_seed(0)
    q, do = (torch.randn(1, T, 2, 16, device=DEVICE).to(dtype) for _ in range(2))  # GQA: 2 query heads on 1
    k, v = (torch.randn(1, T, 1, 16, device=DEVICE).to(dtype) for _ in range(2))
    cu = torch.tensor([0, 7, 7, T], device=DEVICE)
    fwd_config = CONFIGS[config][0] or forward.fwd_config((8, 8, 16))
    assert series_gap(alpha, fwd_config[1], 4) < T // 2  # the series runs on most of the long sequence's tiles
    series = outputs(q, k, v, do, alpha, cu, series_order=4, configs=CONFIGS[config])
    exact = outputs(q, k, v, do, alpha, cu, configs=CONFIGS[config])
    truth = reference(*(x.double() for x in (q, k, v, do)), alpha, cu)
    for name, a, x, e in zip(("o", "dq", "dk", "dv"), series, exact, truth):
        assert rel_rms(a.double(), e) <= 1.25 * rel_rms(x.double(), e) + 1e-6, name
    if alpha <= 0.5:
        tol_o, tol_grad = TOL[dtype]
        expected = reference(q, k, v, do, alpha, cu)
        for name, a, e, tol in zip(("o", "dq", "dk", "dv"), series, expected, (tol_o, tol_grad, tol_grad, tol_grad)):
            assert_close(name, a, e, tol)


def test_series_too_near_the_diagonal_is_caught(monkeypatch):
    """The check above can fail: a first-order series forced onto every off-diagonal tile (gap 1, where ``t/d``
    reaches 1/2 and more) misses the PyTorch backend by far more than the bars."""
    monkeypatch.setattr(forward, "series_gap", lambda alpha, columns, order: 1)
    monkeypatch.setattr(backward, "series_gap", lambda alpha, columns, order: 1)
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 120, 1, 16, device=DEVICE) for _ in range(4))
    actual = outputs(q, k, v, do, 0.5, series_order=1)
    expected = reference(q, k, v, do, 0.5)
    assert min(rel_rms(a, e) for a, e in zip(actual, expected)) > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU; the interpreter runs the small cases")
@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("D", [64, 128])
def test_real_sizes_on_gpu(D, alpha):
    """T = 64k in bfloat16 with the GPU's blocks: the series (order 4) keeps the kernels within the bars of the
    PyTorch backend wherever the exact path is, and within a tenth of the exact path's distance from it."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 65536, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    expected = reference(q, k, v, do, alpha)
    exact = outputs(q, k, v, do, alpha)
    series = outputs(q, k, v, do, alpha, series_order=4)
    for name, s, x, e, bar in zip(("o", "dq", "dk", "dv"), series, exact, expected, (5e-3, 1e-2, 1e-2, 1e-2)):
        err_series, err_exact = rel_rms(s, e), rel_rms(x, e)
        assert err_series <= max(bar, 1.1 * err_exact), (name, err_series, err_exact)
        assert err_series <= 1.1 * err_exact + 1e-3, (name, err_series, err_exact)
