"""TAPA backward: recompute the probabilities from the saved log-sum-exp, FlashAttention style.

Three kernels: ``delta = rowsum(dO ⊙ O)`` (``ops/common/triton/rowdot.py``); dK and dV per (key block, key/value
head), looping over the ``G`` query heads that share the head and the query blocks that see the keys; dQ per
(query block, query head) over its causal key prefix, or, with ``atomic_dq``, added into a float32 buffer by the
dK/dV kernel (one recomputation of the logits instead of two). With ``l = a·cos(2πx)``, ``a = sA·q_A·k_A``,
``x = (q_P·k_P)·r[m−n]`` and ``dS = P ⊙ (dP − delta)``, the two channel groups get
``dS_A = dS·cos(2πx)·sA`` and ``dS_P = −2π·dS·a·sin(2πx)·r``. With the linear phase (``LINEAR``, ``x = (Σ q_P −
Σ k_P)·r``) the phase channels get the row sums of ``dS_P`` (queries) and minus its column sums (keys), the same
in every channel. Derivation: ``README.md`` of the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.rowdot import output_delta
from attnkit.ops.common.triton_seq import launch_grid, program_block
from attnkit.ops.common.triton_utils import LOG2E, block_dim, interpreting
from attnkit.ops.tapa.triton.common import (
    NEVER,
    SERIES_ORDER,
    cos_cycles,
    distance_factor,
    distance_factor_series,
    fast_exp2,
    phase_cycles,
    power_args,
    series_gap,
    sin_cycles,
)

TWO_PI = 6.283185307179586


@triton.jit
def _grad_logits(
    b_amp, b_phase, b_r, b_lse, b_delta, b_dp, mask, scale_log2, CAUSAL: tl.constexpr, TRIG_ASM: tl.constexpr
):
    """``(P, dS_A / sA, dS_P / (−2π·sA))`` of one tile from its raw products; ``b_lse`` / ``b_delta`` come
    broadcast to it. The constant factors of the two channel groups are applied once to the accumulated
    gradients (``sA`` and ``−2π·sA`` at the stores), not per logit."""
    b_x = phase_cycles(b_phase, b_r)
    b_cos = cos_cycles(b_x, TRIG_ASM)
    b_p = fast_exp2(b_amp * b_cos * scale_log2 - b_lse)
    if CAUSAL:
        b_p = tl.where(mask, b_p, 0.0)
    b_ds = b_p * (b_dp - b_delta)
    b_ds_amp = b_ds * b_cos
    b_ds_phase = (b_ds * b_amp) * (sin_cycles(b_x, TRIG_ASM) * b_r)
    return b_p, b_ds_amp, b_ds_phase


@triton.jit
def _dkdv_block(
    b_dka, b_dkp, b_dv, b_ka, b_kp, b_w, b_v, o_n, start_m, L, i_hq,
    q, do, lse, delta, dq, bos, NT, scale_log2, scale_amp, alpha, log2_scale,
    o_da, o_dp, o_v,
    HQ: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BDP: tl.constexpr,
    CAUSAL: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr,
    ALPHA_ZERO: tl.constexpr, LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """One query block against the program's key block, in the transposed (keys × queries) orientation; ``b_w``
    is the keys' phase-channel sums (used by the linear phase only); ``SERIES > 0``: the distance factor from the
    series of that order."""
    D = DA + DP
    o_m = start_m + tl.arange(0, BM)
    m_m = o_m < L
    p_m = bos + o_m.to(tl.int64)
    p_q = q + p_m[:, None] * (HQ * D) + i_hq * D
    m_da, m_dp, m_v = (
        m_m[:, None] & (o_da < DA)[None, :],
        m_m[:, None] & (o_dp < DP)[None, :],
        m_m[:, None] & (o_v < V)[None, :],
    )
    b_qa = tl.load(p_q + o_da[None, :], mask=m_da, other=0.0)
    b_qp = tl.load(p_q + DA + o_dp[None, :], mask=m_dp, other=0.0)
    b_do = tl.load(do + p_m[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_v, other=0.0)
    # Rows past the end get lse = +inf, hence P = 0: no row mask is needed on the tile.
    b_lse = tl.load(lse + i_hq.to(tl.int64) * NT + p_m, mask=m_m, other=float("inf"))
    b_delta = tl.load(delta + i_hq.to(tl.int64) * NT + p_m, mask=m_m, other=0.0)

    b_amp = tl.dot(b_ka, tl.trans(b_qa), input_precision=PRECISION)
    if LINEAR:
        b_phase = tl.sum(b_qp.to(tl.float32), 1)[None, :] - b_w[:, None]
    else:
        b_phase = tl.dot(b_kp, tl.trans(b_qp), input_precision=PRECISION)
    b_dp = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)
    mask = o_m[None, :] >= o_n[:, None]
    if SERIES > 0:
        # Rows are keys: each key's distance to the block's centre query, and the queries' offsets from it.
        m_c = start_m + (BM - 1) / 2
        b_r = distance_factor_series(m_c - o_n.to(tl.float32), o_m.to(tl.float32) - m_c, alpha, log2_scale, SERIES)
    else:
        # Transposed tile: rows are keys, so the factor of (n, m) is r(m − n) with the arguments swapped.
        b_r = tl.trans(distance_factor(o_m.to(tl.float32), o_n.to(tl.float32), alpha, log2_scale, ALPHA_ZERO, CAUSAL))
    b_p, b_ds_amp, b_ds_phase = _grad_logits(
        b_amp, b_phase, b_r, b_lse[None, :], b_delta[None, :], b_dp, mask, scale_log2, CAUSAL, TRIG_ASM
    )
    b_dv += tl.dot(b_p.to(b_do.dtype), b_do, input_precision=PRECISION)
    b_ds_amp = b_ds_amp.to(b_qa.dtype)
    if LINEAR:
        # float32 sums: no tensor-core operand to round to
        b_dka += tl.dot(b_ds_amp, b_qa, input_precision=PRECISION)
        b_dkp -= tl.sum(b_ds_phase, 1)
    else:
        b_ds_phase = b_ds_phase.to(b_qp.dtype)
        b_dka += tl.dot(b_ds_amp, b_qa, input_precision=PRECISION)
        b_dkp += tl.dot(b_ds_phase, b_qp, input_precision=PRECISION)
    if ATOMIC_DQ:
        p_dq = dq + p_m[:, None] * (HQ * D) + i_hq * D
        b_dqa = tl.dot(tl.trans(b_ds_amp), b_ka, input_precision=PRECISION)
        if LINEAR:
            b_dqp = tl.broadcast_to(tl.sum(b_ds_phase, 0)[:, None], (BM, BDP))
        else:
            b_dqp = tl.dot(tl.trans(b_ds_phase), b_kp, input_precision=PRECISION)
        tl.atomic_add(p_dq + o_da[None, :], b_dqa, mask=m_da, sem="relaxed")
        tl.atomic_add(p_dq + DA + o_dp[None, :], b_dqp, mask=m_dp, sem="relaxed")
    return b_dka, b_dkp, b_dv


@triton.jit
def tapa_bwd_dkdv_kernel(
    q, k, v, do, lse, delta, dq, dk, dv, cu_seqlens, offsets, N, T, NT, scale_log2, scale_amp, alpha, log2_scale,
    series_gap,
    HQ: tl.constexpr, H: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr,
    BDA: tl.constexpr, BDP: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr,
    ALPHA_ZERO: tl.constexpr, LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """dK, dV (and with ``ATOMIC_DQ`` dQ, float32) of one key block of one key/value head.

    Grid ``triton_seq.launch_grid`` over key blocks of ``BN`` and the ``H`` heads; ``BN`` is a multiple of ``BM``.
    """
    i_b, i_h, bos, L, i_nb = program_block(cu_seqlens, offsets, N, T, H, LOG_N, IS_VARLEN)
    bos += i_b * T
    G = HQ // H
    D = DA + DP
    start_n = i_nb * BN
    if start_n >= L:
        return
    o_n = start_n + tl.arange(0, BN)
    m_n = o_n < L
    o_da, o_dp, o_v = tl.arange(0, BDA), tl.arange(0, BDP), tl.arange(0, BV)
    p_n = bos + o_n.to(tl.int64)
    m_da, m_dp, m_v = (
        m_n[:, None] & (o_da < DA)[None, :],
        m_n[:, None] & (o_dp < DP)[None, :],
        m_n[:, None] & (o_v < V)[None, :],
    )
    p_k = k + p_n[:, None] * (H * D) + i_h * D
    b_ka = tl.load(p_k + o_da[None, :], mask=m_da, other=0.0)
    b_kp = tl.load(p_k + DA + o_dp[None, :], mask=m_dp, other=0.0)
    b_v = tl.load(v + p_n[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_v, other=0.0)
    if LINEAR:
        b_w = tl.sum(b_kp.to(tl.float32), 1)
    else:
        b_w = 0.0  # unused
    b_dka = tl.zeros([BN, BDA], dtype=tl.float32)
    if LINEAR:
        b_dkp = tl.zeros([BN], dtype=tl.float32)  # the same in every phase channel
    else:
        b_dkp = tl.zeros([BN, BDP], dtype=tl.float32)
    b_dv = tl.zeros([BN, BV], dtype=tl.float32)
    for g in range(G):
        i_hq = i_h * G + g
        # The query blocks that cross the diagonal need the causal mask; the rest see every key of the block.
        for start_m in range(start_n, tl.minimum(start_n + BN, L), BM):
            b_dka, b_dkp, b_dv = _dkdv_block(
                b_dka, b_dkp, b_dv, b_ka, b_kp, b_w, b_v, o_n, start_m, L, i_hq, q, do, lse, delta, dq, bos,
                NT, scale_log2, scale_amp, alpha, log2_scale, o_da, o_dp, o_v, HQ, DA, DP, V, BM, BDP, True,
                ATOMIC_DQ, PRECISION, TRIG_ASM, ALPHA_ZERO, LINEAR, 0,
            )  # fmt: skip
        # With SERIES, the query blocks whose smallest distance start_m − (start_n + BN − 1) is at least
        # series_gap come last.
        m_far = L
        if SERIES > 0:
            m_far = tl.minimum(start_n + BN + tl.cdiv(tl.maximum(series_gap - 1, 0), BM) * BM, L)
        for start_m in range(start_n + BN, m_far, BM):
            b_dka, b_dkp, b_dv = _dkdv_block(
                b_dka, b_dkp, b_dv, b_ka, b_kp, b_w, b_v, o_n, start_m, L, i_hq, q, do, lse, delta, dq, bos,
                NT, scale_log2, scale_amp, alpha, log2_scale, o_da, o_dp, o_v, HQ, DA, DP, V, BM, BDP, False,
                ATOMIC_DQ, PRECISION, TRIG_ASM, ALPHA_ZERO, LINEAR, 0,
            )  # fmt: skip
        if SERIES > 0:
            for start_m in range(m_far, L, BM):
                b_dka, b_dkp, b_dv = _dkdv_block(
                    b_dka, b_dkp, b_dv, b_ka, b_kp, b_w, b_v, o_n, start_m, L, i_hq, q, do, lse, delta, dq, bos,
                    NT, scale_log2, scale_amp, alpha, log2_scale, o_da, o_dp, o_v, HQ, DA, DP, V, BM, BDP, False,
                    ATOMIC_DQ, PRECISION, TRIG_ASM, ALPHA_ZERO, LINEAR, SERIES,
                )  # fmt: skip
    p_dk = dk + p_n[:, None] * (H * D) + i_h * D
    tl.store(p_dk + o_da[None, :], (b_dka * scale_amp).to(dk.dtype.element_ty), mask=m_da)
    if LINEAR:
        b_dkp = tl.broadcast_to(b_dkp[:, None], (BN, BDP))
    tl.store(p_dk + DA + o_dp[None, :], (b_dkp * (-6.283185307179586 * scale_amp)).to(dk.dtype.element_ty), mask=m_dp)
    tl.store(dv + p_n[:, None] * (H * V) + i_h * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_v)


@triton.jit
def _dq_block(
    b_dqa, b_dqp, b_qa, b_qp, b_u, b_do, b_lse, b_delta, o_m, start_n, L,
    k, v, bos, scale_log2, scale_amp, alpha, log2_scale, o_da, o_dp, o_v,
    H: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr, ALPHA_ZERO: tl.constexpr,
    LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """One key block folded into the dQ of the program's query block; ``b_u`` is the query rows' phase-channel
    sums (used by the linear phase only); ``SERIES > 0``: the distance factor from the series of that order."""
    D = DA + DP
    o_n = start_n + tl.arange(0, BN)
    p_n = bos + o_n.to(tl.int64)
    m_da, m_dp, m_v = (o_da < DA)[None, :], (o_dp < DP)[None, :], (o_v < V)[None, :]
    if CAUSAL:
        m_n = (o_n < L)[:, None]
        m_da, m_dp, m_v = m_da & m_n, m_dp & m_n, m_v & m_n
    b_ka = tl.load(k + p_n[:, None] * (H * D) + o_da[None, :], mask=m_da, other=0.0)
    b_kp = tl.load(k + p_n[:, None] * (H * D) + DA + o_dp[None, :], mask=m_dp, other=0.0)
    b_v = tl.load(v + p_n[:, None] * (H * V) + o_v[None, :], mask=m_v, other=0.0)
    b_amp = tl.dot(b_qa, tl.trans(b_ka), input_precision=PRECISION)
    if LINEAR:
        b_phase = b_u[:, None] - tl.sum(b_kp.to(tl.float32), 1)[None, :]
    else:
        b_phase = tl.dot(b_qp, tl.trans(b_kp), input_precision=PRECISION)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
    mask = o_m[:, None] >= o_n[None, :]
    if SERIES > 0:
        n_c = start_n + (BN - 1) / 2
        b_r = distance_factor_series(o_m.to(tl.float32) - n_c, n_c - o_n.to(tl.float32), alpha, log2_scale, SERIES)
    else:
        b_r = distance_factor(o_m.to(tl.float32), o_n.to(tl.float32), alpha, log2_scale, ALPHA_ZERO, CAUSAL)
    _, b_ds_amp, b_ds_phase = _grad_logits(
        b_amp, b_phase, b_r, b_lse[:, None], b_delta[:, None], b_dp, mask, scale_log2, CAUSAL, TRIG_ASM
    )
    b_dqa += tl.dot(b_ds_amp.to(b_ka.dtype), b_ka, input_precision=PRECISION)
    if LINEAR:
        b_dqp += tl.sum(b_ds_phase, 1)
    else:
        b_dqp += tl.dot(b_ds_phase.to(b_kp.dtype), b_kp, input_precision=PRECISION)
    return b_dqa, b_dqp


@triton.jit
def tapa_bwd_dq_kernel(
    q, k, v, do, lse, delta, dq, cu_seqlens, offsets, N, T, NT, scale_log2, scale_amp, alpha, log2_scale, series_gap,
    HQ: tl.constexpr, H: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr,
    BDA: tl.constexpr, BDP: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr, ALPHA_ZERO: tl.constexpr,
    LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """dQ of one query block of one query head; grid ``triton_seq.launch_grid`` over query blocks of ``BM``."""
    i_b, i_hq, bos, L, i_m = program_block(cu_seqlens, offsets, N, T, HQ, LOG_N, IS_VARLEN)
    bos += i_b * T
    i_h = i_hq // (HQ // H)
    D = DA + DP
    start_m = i_m * BM
    if start_m >= L:
        return
    o_m = start_m + tl.arange(0, BM)
    m_m = o_m < L
    o_da, o_dp, o_v = tl.arange(0, BDA), tl.arange(0, BDP), tl.arange(0, BV)
    p_m = bos + o_m.to(tl.int64)
    m_da, m_dp = m_m[:, None] & (o_da < DA)[None, :], m_m[:, None] & (o_dp < DP)[None, :]
    p_q = q + p_m[:, None] * (HQ * D) + i_hq * D
    b_qa = tl.load(p_q + o_da[None, :], mask=m_da, other=0.0)
    b_qp = tl.load(p_q + DA + o_dp[None, :], mask=m_dp, other=0.0)
    b_do = tl.load(do + p_m[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_m[:, None] & (o_v < V)[None, :])
    b_lse = tl.load(lse + i_hq.to(tl.int64) * NT + p_m, mask=m_m, other=float("inf"))
    b_delta = tl.load(delta + i_hq.to(tl.int64) * NT + p_m, mask=m_m, other=0.0)
    if LINEAR:
        b_u = tl.sum(b_qp.to(tl.float32), 1)
    else:
        b_u = 0.0  # unused
    b_dqa = tl.zeros([BM, BDA], dtype=tl.float32)
    if LINEAR:
        b_dqp = tl.zeros([BM], dtype=tl.float32)  # the same in every phase channel
    else:
        b_dqp = tl.zeros([BM, BDP], dtype=tl.float32)
    k_h, v_h = k + i_h * D, v + i_h * V
    # With SERIES, the key blocks whose smallest distance is at least series_gap come first (as in the forward).
    n_far = 0
    if SERIES > 0:
        n_far = tl.minimum(tl.maximum(start_m - series_gap + 1, 0) // BN * BN, start_m)
        for start_n in range(0, n_far, BN):
            b_dqa, b_dqp = _dq_block(
                b_dqa, b_dqp, b_qa, b_qp, b_u, b_do, b_lse, b_delta, o_m, start_n, L, k_h, v_h, bos, scale_log2,
                scale_amp, alpha, log2_scale, o_da, o_dp, o_v, H, DA, DP, V, BN, False, PRECISION, TRIG_ASM,
                ALPHA_ZERO, LINEAR, SERIES,
            )  # fmt: skip
    for start_n in range(n_far, start_m, BN):
        b_dqa, b_dqp = _dq_block(
            b_dqa, b_dqp, b_qa, b_qp, b_u, b_do, b_lse, b_delta, o_m, start_n, L, k_h, v_h, bos, scale_log2,
            scale_amp, alpha, log2_scale, o_da, o_dp, o_v, H, DA, DP, V, BN, False, PRECISION, TRIG_ASM, ALPHA_ZERO,
            LINEAR, 0,
        )  # fmt: skip
    for start_n in range(start_m, tl.minimum(start_m + BM, L), BN):
        b_dqa, b_dqp = _dq_block(
            b_dqa, b_dqp, b_qa, b_qp, b_u, b_do, b_lse, b_delta, o_m, start_n, L, k_h, v_h, bos, scale_log2,
            scale_amp, alpha, log2_scale, o_da, o_dp, o_v, H, DA, DP, V, BN, True, PRECISION, TRIG_ASM, ALPHA_ZERO,
            LINEAR, 0,
        )  # fmt: skip
    p_dq = dq + p_m[:, None] * (HQ * D) + i_hq * D
    tl.store(p_dq + o_da[None, :], (b_dqa * scale_amp).to(dq.dtype.element_ty), mask=m_da)
    if LINEAR:
        b_dqp = tl.broadcast_to(b_dqp[:, None], (BM, BDP))
    tl.store(p_dq + DA + o_dp[None, :], (b_dqp * (-6.283185307179586 * scale_amp)).to(dq.dtype.element_ty), mask=m_dp)


def bwd_config(dims: tuple[int, int, int]) -> dict[str, object]:
    """Block sizes and warps of the dK/dV and dQ kernels for channel blocks ``(BDA, BDP, BV)``.

    Measured on an H200 (``benchmarks/tapa_tune.py``): dQ by float32 atomics from the dK/dV kernel beat a
    second recomputation by 1.1-1.4x at D = 128 and 64.
    """
    if interpreting():
        return {"dkdv": (16, 16, 1, 1), "dq": (16, 16, 1, 1), "atomic_dq": False}
    width = max(dims[0] + dims[1], dims[2])
    if width <= 64:
        return {"dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 2), "atomic_dq": True}
    if width <= 128:
        return {"dkdv": (32, 128, 8, 2), "dq": (128, 64, 8, 2), "atomic_dq": True}
    return {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2), "atomic_dq": True}


def tapa_bwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    amp_dim: int,
    alpha: float,
    cu_seqlens: torch.Tensor | None,
    config: dict[str, object] | None = None,
    trig_asm: bool = False,
    phase: str = "quadratic",
    series_order: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the dtypes of ``(q, k, v)``; inputs as :func:`tapa_fwd_fn` takes and
    returns them, ``do`` shaped like ``o`` (contiguous). ``config`` overrides :func:`bwd_config`;
    ``trig_asm``, ``phase`` and ``series_order`` as in :func:`tapa_fwd_fn`."""
    B, T, HQ, D = q.shape
    H, V = k.shape[2], v.shape[-1]
    DA, DP = amp_dim, D - amp_dim
    dims = (block_dim(DA), block_dim(DP), block_dim(V))
    config = config or bwd_config(dims)
    series_order = SERIES_ORDER if series_order is None else series_order
    # The dK/dV kernel's series runs along its query columns (BM of them), the dQ kernel's along its keys (BN).
    gap_dkdv, gap_dq = (series_gap(alpha, config[name][i], series_order) for name, i in (("dkdv", 0), ("dq", 1)))
    alpha, log2_scale, alpha_zero = power_args(alpha, DP, phase)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    scales = (DA**-0.5 * LOG2E, DA**-0.5, alpha, log2_scale)
    common = dict(
        HQ=HQ,
        H=H,
        DA=DA,
        DP=DP,
        V=V,
        BDA=dims[0],
        BDP=dims[1],
        BV=dims[2],
        PRECISION=precision,
        TRIG_ASM=trig_asm and not interpreting(),
        ALPHA_ZERO=alpha_zero,
        LINEAR=phase == "linear",
    )
    is_varlen = cu_seqlens is not None

    delta = output_delta(o, do, head_major=True)  # [HQ, B·T], as lse

    atomic_dq = bool(config["atomic_dq"])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic_dq else torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    BM, BN, num_warps, num_stages = config["dkdv"]
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, H, BN)
    if grid[0] * grid[1] > 0:
        tapa_bwd_dkdv_kernel[grid](
            q, k, v, do, lse, delta, dq, dk, dv, cu_seqlens, offsets, N, T, B * T, *scales, gap_dkdv,
            BM=BM, BN=BN, LOG_N=log_n, IS_VARLEN=is_varlen, ATOMIC_DQ=atomic_dq,
            SERIES=series_order if gap_dkdv < NEVER else 0, num_warps=num_warps, num_stages=num_stages, **common,
        )  # fmt: skip
    if atomic_dq:
        # The atomics added the unscaled products: the channel groups' factors are applied here, once.
        dq[..., :DA] *= scales[1]
        dq[..., DA:] *= -TWO_PI * scales[1]
        return dq.to(q.dtype), dk, dv
    BM, BN, num_warps, num_stages = config["dq"]
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, HQ, BM)
    if grid[0] * grid[1] > 0:
        tapa_bwd_dq_kernel[grid](
            q, k, v, do, lse, delta, dq, cu_seqlens, offsets, N, T, B * T, *scales, gap_dq,
            BM=BM, BN=BN, LOG_N=log_n, IS_VARLEN=is_varlen, SERIES=series_order if gap_dq < NEVER else 0,
            num_warps=num_warps, num_stages=num_stages, **common,
        )  # fmt: skip
    return dq, dk, dv
