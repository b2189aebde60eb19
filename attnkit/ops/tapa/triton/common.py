"""Pieces shared by the TAPA kernels: the distance factor, the sequence bounds and the cosine of a phase.

Phases are kept in cycles, ``x = s·r(m − n)`` with ``s = q_P·k_P`` (the linear phase: ``s = Σ q_P − Σ k_P``) and
``r(d) = d^alpha/sqrt(dP)`` (``sqrt(2·dP)`` for the linear phase), and reduced to
``[-1/2, 1/2]`` before the cosine: ``cos(2π·x)``
of a raw ``x`` of tens of cycles would lose digits in a hardware cosine, and the reduced range lets a short
polynomial replace the cosine (``cos_cycles``).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import interpreting
from attnkit.ops.tapa.torch_impl import phase_variance

# On the GPU, log2 and exp2 come straight from the special-function unit (``lg2.approx.ftz``, ``ex2.approx.ftz``;
# relative error ~1e-7): ``tl.log2`` is libdevice's exact log2, dozens of instructions a logit, and ``tl.exp2``
# wraps the unit in three instructions of denormal handling that a softmax does not need. The interpreter has no
# PTX and uses ``tl.log2`` / ``tl.exp2``.
NATIVE = tl.constexpr(not interpreting())


@triton.jit
def fast_exp2(x):
    """``2^x`` (denormal results flush to 0)."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.exp2(x)


@triton.jit
def fast_log2(x):
    """``log2(x)``; ``-inf`` at 0, NaN below."""
    if NATIVE:
        return tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.log2(x)


def power_args(alpha: float, phase_dim: int, phase: str = "quadratic") -> tuple[float, float, bool]:
    """Kernel arguments of :func:`distance_factor`: ``(alpha, log2(1/sqrt(variance)), alpha == 0)``, the variance
    from ``phase_variance`` (``dP``, or ``2·dP`` for the linear phase)."""
    return float(alpha), -0.5 * math.log2(phase_variance(phase, phase_dim)), alpha == 0


@triton.jit
def distance_factor(b_rows, b_cols, alpha, log2_scale, ALPHA_ZERO: tl.constexpr, CLAMP: tl.constexpr):
    """``r(m − n) = (m − n)^alpha / sqrt(dP)`` of a tile, ``0`` at ``m = n``, from float positions.

    Two special-function ops per logit (``log2``, ``exp2``), computed where they are needed: a float32 table
    read per logit cost more (a gather, its address arithmetic, a layout change through shared memory, and a
    load latency the loop cannot hide). ``log2(0) = -inf`` gives ``0^alpha = 0``; ``alpha = 0`` is its own
    case (``0·inf``). ``CLAMP`` maps the masked upper triangle of a diagonal tile to ``d = 0`` so that it
    stays finite (the backward multiplies by ``r`` after masking).
    """
    b_d = b_rows[:, None] - b_cols[None, :]
    if CLAMP:
        b_d = tl.maximum(b_d, 0.0)
    if ALPHA_ZERO:
        return tl.where(b_d > 0, tl.exp2(log2_scale), 0.0)
    return fast_exp2(alpha * fast_log2(b_d) + log2_scale)


# Off the diagonal the distance power can come from a short series on the FMA pipe instead of two special-function ops
# a logit (``distance_factor_series``). Off until timed on a GPU: ``SERIES_ORDER`` is the order the launchers use by
# default (0: exact everywhere); ``series_order=`` overrides it per call.
SERIES_ORDER = 0
# The series' truncation bound, relative to d^alpha: below float32's half ulp, so the series changes r by less than
# the rounding the exact path already carries (lg2/ex2.approx and the rounding of alpha·log2(d), ~2^-22 or more).
SERIES_TOLERANCE = 2.0**-24
# series_gap's "never": no tile of an int32 position range is that far from the diagonal.
NEVER = 2**31 - 1
# The largest |t/d| the series takes, whatever its truncation: the terms may cancel, which multiplies Horner's float32
# rounding (relative to r) by up to ((1 + rho)/(1 − rho))^alpha, 1.3 at alpha = 1 and rho = 1/8.
SERIES_MAX_RATIO = 1 / 8


def _binomial(alpha: float, k: int) -> float:
    c = 1.0
    for j in range(k):
        c *= (alpha - j) / (j + 1)
    return c


def series_truncation(alpha: float, order: int, rho: float) -> float:
    """A bound on ``|Σ_{k>order} binom(alpha, k)·x^k| / (1 + x)^alpha`` over ``|x| <= rho < 1``:
    ``|binom(alpha, order+1)|·rho^(order+1) / (1 − rho)^(1+alpha)``. From ``k >= (alpha − 1)/2`` on the terms'
    binomials shrink (``|binom(alpha, k+1)/binom(alpha, k)| = |alpha − k|/(k + 1) <= 1``), so the tail is below its
    first term times the geometric sum ``1/(1 − rho)``, and ``(1 + x)^alpha >= (1 − rho)^alpha``. Infinite where that
    does not hold (``order + 1 < (alpha − 1)/2``)."""
    if order + 1 < (alpha - 1) / 2 or rho >= 1:
        return math.inf
    return abs(_binomial(alpha, order + 1)) * rho ** (order + 1) / (1 - rho) ** (1 + alpha)


def series_gap(alpha: float, columns: int, order: int, tolerance: float = SERIES_TOLERANCE) -> int:
    """The smallest gap ``g >= 1`` (the tile's smallest distance ``m − n``) from which a tile of ``columns`` columns
    takes the series of ``order``: its rows sit at ``d >= g + h`` from the centre column, ``h = (columns − 1)/2``,
    so ``|t/d| <= rho = h/(g + h)``; ``rho <= SERIES_MAX_RATIO`` and :func:`series_truncation` is within
    ``tolerance`` there. ``NEVER`` for ``order = 0`` or ``alpha = 0`` (whose exact path is one constant)."""
    if order <= 0 or alpha == 0:
        return NEVER
    h = (columns - 1) / 2
    if series_truncation(alpha, order, h / (h + NEVER)) > tolerance:
        return NEVER
    low = max(math.ceil(h / SERIES_MAX_RATIO - h), 1)
    if series_truncation(alpha, order, h / (h + low)) <= tolerance:
        return low
    high = NEVER  # the truncation is within the tolerance at high, not at low
    while high - low > 1:
        mid = (low + high) // 2
        if series_truncation(alpha, order, h / (h + mid)) <= tolerance:
            high = mid
        else:
            low = mid
    return high


@triton.jit
def _binomial_jit(alpha, K: tl.constexpr):
    c = 1.0
    for j in tl.static_range(K):
        c = c * (alpha - j) / (j + 1)
    return c


@triton.jit
def _power(x, K: tl.constexpr):
    p = 1.0
    for _ in tl.static_range(K):
        p = p * x
    return p


@triton.jit
def distance_factor_series(b_d, b_t, alpha, log2_scale, ORDER: tl.constexpr):
    """``r = (d + t)^alpha / sqrt(dP)`` of a tile off the diagonal, from ``b_d [R]``, each row's distance at the
    tile's centre column, and ``b_t [C]``, each column's signed offset from it (``d + t`` the distance of the logit).

    ``(d + t)^alpha = Σ_k binom(alpha, k)·d^(alpha−k)·t^k``, truncated after ``t^ORDER``: the row values
    ``d^alpha/sqrt(dP)`` take the two special-function ops of :func:`distance_factor` once a row, and the logits
    ``ORDER`` FMAs each, Horner in ``t`` with per-row coefficients ``b_k = binom(alpha, k)·d^alpha/sqrt(dP)/d^k``.
    The launchers use it on tiles at ``m − n >= series_gap(...)``, where the truncation is below
    ``SERIES_TOLERANCE`` relative to ``r`` (README: the distance power off the diagonal).
    """
    b_c = fast_exp2(alpha * fast_log2(b_d) + log2_scale)
    b_inv = 1.0 / b_d
    b_r = _series_coefficient(b_c, b_inv, alpha, ORDER)[:, None] * b_t[None, :]
    b_r += _series_coefficient(b_c, b_inv, alpha, ORDER - 1)[:, None]
    for i in tl.static_range(ORDER - 1):
        b_r = b_r * b_t[None, :] + _series_coefficient(b_c, b_inv, alpha, ORDER - 2 - i)[:, None]
    return b_r


@triton.jit
def _series_coefficient(b_c, b_inv, alpha, K: tl.constexpr):
    """``b_c·binom(alpha, K)·b_inv^K`` per row."""
    return b_c * (_binomial_jit(alpha, K) * _power(b_inv, K))


@triton.jit
def phase_cycles(s, r):
    """``x − rint(x)`` of the phase ``x = s·r`` in cycles: the phase reduced to ``[-1/2, 1/2]``.

    Adding and subtracting 1.5·2²³ rounds to an integer in float adds (exact for ``|x| < 2²²``), where ``floor``
    would be a conversion instruction on the GPU's slow pipe; with FMA contraction the product rides in both
    the rounding and the subtraction (three instructions in all).
    """
    n = (s * r + 12582912.0) - 12582912.0
    return s * r - n


@triton.jit
def cos_cycles(f, ASM: tl.constexpr):
    """``cos(2π·f)`` for ``f`` in ``[-1/2, 1/2]``, within 1.3e-6.

    A degree-5 polynomial in ``f²`` (fitted by iteratively reweighted least squares on Chebyshev nodes; its
    error, float32 Horner rounding included, is 1.3e-6) runs on the FMA pipe and in the interpreter; ``ASM``
    uses the GPU's special-function unit instead (``cos.approx``, similar accuracy on ``[-π, π]``), so the
    two pipes can share the work. ``tl.cos`` would be libdevice's full-range cosine, many times slower.
    """
    if ASM:
        return tl.inline_asm_elementwise(
            "cos.approx.ftz.f32 $0, $1;", "=f,f", [6.283185307179586 * f], dtype=tl.float32, is_pure=True, pack=1
        )
    t = f * f
    c = -21.0767822265625 * t + 58.79404067993164
    c = c * t - 85.27239990234375
    c = c * t + 64.92872619628906
    c = c * t - 19.738983154296875
    return c * t + 0.9999992251396179


@triton.jit
def sin_cycles(f, ASM: tl.constexpr):
    """``sin(2π·f)`` for ``f`` in ``[-1/2, 1/2]``, within 6e-7: ``f`` times a degree-5 polynomial in ``f²``."""
    if ASM:
        return tl.inline_asm_elementwise(
            "sin.approx.ftz.f32 $0, $1;", "=f,f", [6.283185307179586 * f], dtype=tl.float32, is_pure=True, pack=1
        )
    t = f * f
    c = -12.473669052124023 * t + 41.344398498535156
    c = c * t - 76.61480712890625
    c = c * t + 81.5999755859375
    c = c * t - 41.341590881347656
    return (c * t + 6.283185005187988) * f
