"""TAPA forward: FlashAttention's online softmax over the TAPA logit, one program per (query block, query head).

The amplitude and phase products are two ``tl.dot`` on the tensor cores (the linear phase, ``LINEAR``, takes row
sums of the phase channels instead of the second); the distance factor comes from
``common.distance_factor``; the softmax runs in base 2 (``log2(e)/sqrt(dA)`` applied in the FMA that forms
each exponent) and uses ``exp2``. Saves the base-2 log-sum-exp for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
)


@triton.jit
def _fwd_block(
    b_acc, b_m, b_l, b_qa, b_qp, b_u, o_m, start_n, L,
    k, v, kv_base, stride_k, stride_v,
    o_da, o_dp, o_v, scale_log2, alpha, log2_scale,
    DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr, ALPHA_ZERO: tl.constexpr,
    LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """One key block ``[start_n, start_n + BN)`` folded into the running ``(acc, max, sum)`` of a query block;
    ``b_u`` is the query rows' phase-channel sums (used by the linear phase only). ``SERIES > 0``: the distance
    factor from the series of that order (a block far enough from the diagonal, ``common.series_gap``)."""
    o_n = start_n + tl.arange(0, BN)
    p_n = kv_base + o_n.to(tl.int64)
    m_da, m_dp, m_v = (o_da < DA)[None, :], (o_dp < DP)[None, :], (o_v < V)[None, :]
    if CAUSAL:
        # Only the blocks that cross the diagonal can run past the end of the sequence.
        m_n = (o_n < L)[:, None]
        m_da, m_dp, m_v = m_da & m_n, m_dp & m_n, m_v & m_n
    b_ka = tl.load(k + p_n[:, None] * stride_k + o_da[None, :], mask=m_da, other=0.0)
    b_kp = tl.load(k + p_n[:, None] * stride_k + DA + o_dp[None, :], mask=m_dp, other=0.0)
    b_v = tl.load(v + p_n[:, None] * stride_v + o_v[None, :], mask=m_v, other=0.0)
    b_amp = tl.dot(b_qa, tl.trans(b_ka), input_precision=PRECISION)
    if LINEAR:
        b_phase = b_u[:, None] - tl.sum(b_kp.to(tl.float32), 1)[None, :]
    else:
        b_phase = tl.dot(b_qp, tl.trans(b_kp), input_precision=PRECISION)
    if SERIES > 0:
        n_c = start_n + (BN - 1) / 2
        b_r = distance_factor_series(o_m.to(tl.float32) - n_c, n_c - o_n.to(tl.float32), alpha, log2_scale, SERIES)
    else:
        b_r = distance_factor(o_m.to(tl.float32), o_n.to(tl.float32), alpha, log2_scale, ALPHA_ZERO, CAUSAL)
    # The running max is kept in unscaled logits, so the scale rides in the FMA that forms the exponent.
    b_logit = b_amp * cos_cycles(phase_cycles(b_phase, b_r), TRIG_ASM)
    if CAUSAL:
        m_causal = (o_m[:, None] >= o_n[None, :]) & (o_n < L)[None, :]
        b_logit = tl.where(m_causal, b_logit, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_logit, 1))
    b_p = fast_exp2(b_logit * scale_log2 - (b_m_new * scale_log2)[:, None])
    b_rescale = fast_exp2((b_m - b_m_new) * scale_log2)
    b_l = b_l * b_rescale + tl.sum(b_p, 1)
    b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_acc, b_m_new, b_l


@triton.jit
def tapa_fwd_kernel(
    q, k, v, o, lse, cu_seqlens, offsets, N, T, NT, scale_log2, alpha, log2_scale, series_gap,
    HQ: tl.constexpr, H: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr,
    BDA: tl.constexpr, BDP: tl.constexpr, BV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, TRIG_ASM: tl.constexpr,
    ALPHA_ZERO: tl.constexpr, LINEAR: tl.constexpr, SERIES: tl.constexpr,
):  # fmt: skip
    """``q [*, HQ, DA+DP]``, ``k [*, H, DA+DP]``, ``v [*, H, V]``, ``o [*, HQ, V]`` with ``*`` the ``NT`` packed
    tokens; ``lse [HQ, NT]`` float32 in base 2. Grid: ``triton_seq.launch_grid`` over query blocks of ``BM``.
    ``LINEAR``: the linear phase ``Σ q_P − Σ k_P`` instead of ``q_P·k_P``. ``SERIES > 0``: the key blocks at
    ``m − n >= series_gap`` take the distance factor from the series of that order."""
    # The last query blocks see the most keys: the launch runs them first so the tail of the grid is short work.
    i_b, i_hq, bos, L, i_m = program_block(cu_seqlens, offsets, N, T, HQ, LOG_N, IS_VARLEN)
    i_h = i_hq // (HQ // H)
    bos += i_b * T
    start_m = i_m * BM
    if start_m >= L:
        return
    D = DA + DP
    o_m = start_m + tl.arange(0, BM)
    m_m = o_m < L
    o_da, o_dp, o_v = tl.arange(0, BDA), tl.arange(0, BDP), tl.arange(0, BV)
    p_m = bos + o_m.to(tl.int64)
    p_q = q + p_m[:, None] * (HQ * D) + i_hq * D
    b_qa = tl.load(p_q + o_da[None, :], mask=m_m[:, None] & (o_da < DA)[None, :], other=0.0)
    b_qp = tl.load(p_q + DA + o_dp[None, :], mask=m_m[:, None] & (o_dp < DP)[None, :], other=0.0)
    if LINEAR:
        b_u = tl.sum(b_qp.to(tl.float32), 1)
    else:
        b_u = 0.0  # unused

    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    kv_base = bos
    k_h, v_h = k + i_h * D, v + i_h * V
    # Key blocks wholly below the diagonal need no mask; the blocks that cross it do. With SERIES, the blocks whose
    # smallest distance start_m − (start_n + BN − 1) is at least series_gap come first.
    n_far = 0
    if SERIES > 0:
        n_far = tl.minimum(tl.maximum(start_m - series_gap + 1, 0) // BN * BN, start_m)
        for start_n in range(0, n_far, BN):
            b_acc, b_m, b_l = _fwd_block(
                b_acc, b_m, b_l, b_qa, b_qp, b_u, o_m, start_n, L, k_h, v_h, kv_base, H * D, H * V,
                o_da, o_dp, o_v, scale_log2, alpha, log2_scale, DA, DP, V, BN, False, PRECISION, TRIG_ASM, ALPHA_ZERO,
                LINEAR, SERIES,
            )  # fmt: skip
    for start_n in range(n_far, start_m, BN):
        b_acc, b_m, b_l = _fwd_block(
            b_acc, b_m, b_l, b_qa, b_qp, b_u, o_m, start_n, L, k_h, v_h, kv_base, H * D, H * V,
            o_da, o_dp, o_v, scale_log2, alpha, log2_scale, DA, DP, V, BN, False, PRECISION, TRIG_ASM, ALPHA_ZERO,
            LINEAR, 0,
        )  # fmt: skip
    for start_n in range(start_m, tl.minimum(start_m + BM, L), BN):
        b_acc, b_m, b_l = _fwd_block(
            b_acc, b_m, b_l, b_qa, b_qp, b_u, o_m, start_n, L, k_h, v_h, kv_base, H * D, H * V,
            o_da, o_dp, o_v, scale_log2, alpha, log2_scale, DA, DP, V, BN, True, PRECISION, TRIG_ASM, ALPHA_ZERO,
            LINEAR, 0,
        )  # fmt: skip

    b_o = b_acc / b_l[:, None]
    p_o = o + p_m[:, None] * (HQ * V) + i_hq * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & (o_v < V)[None, :])
    tl.store(lse + i_hq.to(tl.int64) * NT + p_m, b_m * scale_log2 + tl.log2(b_l), mask=m_m)


def fwd_config(dims: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """``(BM, BN, num_warps, num_stages)`` for channel blocks ``(BDA, BDP, BV)``; tiny under the interpreter.

    Measured on an H200 (``benchmarks/tapa_tune.py``): at D = 64 four warps on 64-row blocks, at D = 128 eight
    warps on 128-row blocks; wider heads halve the blocks to stay in registers.
    """
    if interpreting():
        return 16, 16, 1, 1
    width = max(dims[0] + dims[1], dims[2])
    if width <= 64:
        return 64, 64, 4, 3
    if width <= 128:
        return 128, 64, 8, 2
    return 64, 32, 4, 2


def tapa_fwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    amp_dim: int,
    alpha: float,
    cu_seqlens: torch.Tensor | None,
    config: tuple[int, int, int, int] | None = None,
    trig_asm: bool = False,
    phase: str = "quadratic",
    series_order: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. ``q [B,T,HQ,D]``, ``k [B,T,H,D]``, ``v [B,T,H,V]`` contiguous, same float dtype.

    ``config`` overrides :func:`fwd_config`; ``trig_asm`` takes the cosine from the special-function unit
    instead of the polynomial (GPU only); ``phase`` is ``"quadratic"`` or ``"linear"``; ``series_order`` the
    order of the distance power's series off the diagonal (0: exact everywhere; default ``common.SERIES_ORDER``).
    Returns ``o [B,T,HQ,V]`` in ``v.dtype`` and ``lse [HQ, B*T]`` float32 (base 2, for the backward).
    """
    B, T, HQ, D = q.shape
    H, V = k.shape[2], v.shape[-1]
    DA, DP = amp_dim, D - amp_dim
    dims = (block_dim(DA), block_dim(DP), block_dim(V))
    BM, BN, num_warps, num_stages = config or fwd_config(dims)
    series_order = SERIES_ORDER if series_order is None else series_order
    gap = series_gap(alpha, BN, series_order)
    alpha, log2_scale, alpha_zero = power_args(alpha, DP, phase)
    o = torch.empty(B, T, HQ, V, dtype=v.dtype, device=q.device)
    lse = torch.empty(HQ, B * T, dtype=torch.float32, device=q.device)
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, HQ, BM)
    if grid[0] * grid[1] > 0:
        tapa_fwd_kernel[grid](
            q, k, v, o, lse, cu_seqlens, offsets, N, T, B * T, DA**-0.5 * LOG2E, alpha, log2_scale, gap,
            HQ=HQ, H=H, DA=DA, DP=DP, V=V, BDA=dims[0], BDP=dims[1], BV=dims[2], BM=BM, BN=BN, LOG_N=log_n,
            IS_VARLEN=cu_seqlens is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            TRIG_ASM=trig_asm and not interpreting(), ALPHA_ZERO=alpha_zero, LINEAR=phase == "linear",
            SERIES=series_order if gap < NEVER else 0, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return o, lse
