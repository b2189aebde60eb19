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
