"""VLA's gates in fused kernels: the write directions ``α̂_t = A_t k̂_t / ‖A_t k̂_t‖`` of every token, forward and
backward, one program per chunk (or per group of consecutive chunks in the forward).

Each chunk's penalty ``Λ_c = A_init⁻¹ + Σ_{chunks before c} UᵀU`` comes from :func:`gram_prefix_kernel`, one
program per sequence and head walking its chunks (it also inverts the final penalty); its backward,
:func:`gram_suffix_kernel`, walks them back and carries ``dΛ_c`` to the earlier chunks' ``u`` and to ``A_init``.
Packed sequences (``cu_seqlens``) run in the same launches: chunk slots as ``chunk_program`` in
``attnkit/ops/common/triton/delta_fwd.py``. Per chunk, in registers:

- ``A0 = Λ_c⁻¹`` by the sweep operator (Gauss–Jordan without pivoting: ``Λ_c`` is symmetric positive definite),
  or, for the later chunks of a program's group, carried from the chunk before: ``A0 ← A0 − RᵀR``;
- the Sherman–Morrison vectors ``z_t = A_{t−1} u_t``, ``d_t = 1 + u_tᵀ z_t`` by rank-one downdates of
  ``Y = U A`` (row ``t`` is final once the rows before it have been applied), ``R = D^{−1/2} Z``, in blocks of
  ``SB`` rows with ``A ← A − R_bᵀ R_b`` between blocks;
- ``a = K̂ A − tril(K̂ Rᵀ) R`` per block (``a_t = A_t k̂_t``), ``α̂ = a / ‖a‖``.

Backward, from ``A_t = (Λ_c + Σ_{s≤t, s in c} u_s u_sᵀ)⁻¹`` directly (no differentiation through the
factorisation): with ``da_t = (dα̂_t − α̂_t (α̂_t·dα̂_t)) / ‖a_t‖`` and ``g_t = A_t da_t = A0 da_t − Σ_{s≤t}
(r_s·da_t) r_s``,

    dk̂_t = g_t,    dΛ_c = −Σ_{t in c} g_t a_tᵀ,    du_s = −Σ_{t≥s, t in c} (g_t (a_t·u_s) + a_t (g_t·u_s))

(the ``t`` in later chunks reach ``u_s`` through ``dΛ``). All float32, dots float32-accurate (``PRECISION``):
``A0`` carries ``1/lam0`` and ``a`` is a difference of nearby vectors when ``u`` aligns with ``k̂``.

Per-token tensors are ``[B, T, H, ·]``: ``u`` the caller's, read through its strides in its dtype; ``k̂``, ``α̂``,
``R``, ``‖a‖`` and the gradients contiguous (``du`` in ``u``'s dtype). The chunks' ``[K, K]`` matrices are
``[B, H, NC, K, K]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import (
    chunk_layout,
    chunk_site,
    dense_rows,
    dense_tokens,
    row_tile,
    seq_site,
)
from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def spd_inverse(b_m, BK: tl.constexpr):
    """``M⁻¹`` of a symmetric positive definite ``[BK, BK]`` tile by ``BK`` sweeps (padding rows and columns must
    hold the identity). After sweeping every pivot the tile holds ``−M⁻¹``.

    The sweep keeps the tile symmetric, so a step reads column ``j`` alone and takes row ``j`` to be the same: with
    ``c`` the column, ``p = c_j`` and ``s = c / p``, the tile becomes ``M − s cᵀ`` off row and column ``j``, ``s`` on
    them and ``−1/p`` at the pivot (one reduction and three tile-wide operations a step)."""
    rows = tl.arange(0, BK)[:, None]
    cols = tl.arange(0, BK)[None, :]
    o_k = tl.arange(0, BK)
    for j in range(0, BK):
        b_col = tl.sum(tl.where(cols == j, b_m, 0.0), 1)
        b_inv = 1.0 / tl.sum(tl.where(o_k == j, b_col, 0.0), 0)
        b_s = b_col * b_inv
        b_q = tl.where(o_k == j, -b_inv, b_s)
        b_m = tl.where(rows == j, b_q[None, :], tl.where(cols == j, b_q[:, None], b_m - b_s[:, None] * b_col[None, :]))
    return -b_m


@triton.jit
def padded_inverse(b_m, K: tl.constexpr, BK: tl.constexpr):
    """``M⁻¹`` of the ``[K, K]`` SPD matrix held in the corner of a ``[BK, BK]`` tile of zeros."""
    o_k = tl.arange(0, BK)
    return spd_inverse(tl.where((o_k[:, None] == o_k[None, :]) & (o_k[:, None] >= K), 1.0, b_m), BK)


@triton.jit
def chunk_inverse(lam, i_c, i_bh, NC, K: tl.constexpr, BK: tl.constexpr):
    """``A0 = Λ_c⁻¹`` of chunk ``i_c`` of head ``i_bh`` from ``lam [BH, NC, K, K]``, and its offsets and mask."""
    o_k = tl.arange(0, BK)
    m_kk = (o_k < K)[:, None] & (o_k < K)[None, :]
    p_kk = (i_bh.to(tl.int64) * NC + i_c) * K * K + o_k[:, None] * K + o_k[None, :]
    return padded_inverse(tl.load(lam + p_kk, mask=m_kk, other=0.0), K, BK), p_kk, m_kk


@triton.jit
def square_tile(i_nh, K: tl.constexpr, BK: tl.constexpr):
    """``(o_k, m_kk, p_kk, p_state)``: the ``[BK, BK]`` tile's offsets, its mask, its offsets within one ``K×K``
    matrix and within row ``i_nh`` of an ``[NH, K, K]`` tensor."""
    o_k = tl.arange(0, BK)
    p_kk = o_k[:, None] * K + o_k[None, :]
    return o_k, (o_k < K)[:, None] & (o_k < K)[None, :], p_kk, i_nh.to(tl.int64) * K * K + p_kk


@triton.jit
def gram_prefix_kernel(
    u, lam_init, lam, a_end, cu_seqlens, offsets, T, NC, lam0, sub, sut, suh, sud,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, USE_INIT: tl.constexpr,
    PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr, WRITE_END: tl.constexpr = True,
):  # fmt: skip
    """The penalty at every chunk's start, ``lam [BH, NC, K, K]`` (``Λ_c = Λ_init + Σ_{chunks before c} UᵀU``), and
    with ``WRITE_END`` the final inverse penalty ``a_end [NH, K, K]`` (``Λ_end⁻¹`` by the sweep, symmetrised),
    float32, from ``u [B, T, H, K]`` and ``lam_init [NH, K, K]`` (``lam0·I`` without ``USE_INIT``). Grid ``(NH,)``:
    one program per sequence and head walks its chunks."""
    i_nh = tl.program_id(0)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    i_bh = i_b * H + i_h
    o_k, m_kk, p_kk, p_state = square_tile(i_nh, K, BK)
    if USE_INIT:
        b_lam = tl.load(lam_init + p_state, mask=m_kk, other=0.0)
    else:
        b_lam = tl.where((o_k[:, None] == o_k[None, :]) & m_kk, lam0, 0.0)
    for i_c in range(0, tl.cdiv(L, BT)):
        tl.store(lam + (i_bh * NC + c0 + i_c) * K * K + p_kk, b_lam, mask=m_kk)
        b_u = row_tile(u, i_b, i_h, bos, i_c, L, sub, sut, suh, sud, o_k, K, BT)[0].to(tl.float32)
        b_lam += tl.dot(tl.trans(b_u), b_u, input_precision=PRECISION)
    if WRITE_END:  # K sweep steps a program: only where the final state is asked for
        b_a = padded_inverse(b_lam, K, BK)
        tl.store(a_end + p_state, 0.5 * (b_a + tl.trans(b_a)), mask=m_kk)


@triton.jit
def gram_suffix_kernel(
    u, a_end, da_end, dlam, du, du_out, dlam_init, cu_seqlens, offsets, T, NC, sub, sut, suh, sud,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, USE_DA_END: tl.constexpr,
    PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """The backward of :func:`gram_prefix_kernel`: with ``D_c = dΛ_end + Σ_{chunks after c} dΛ`` (``dΛ_end =
    −A_end dA_end A_end``), stores ``du_out [B, T, H, K]`` (its dtype): ``du`` (float32, the shares within the
    chunks) plus ``U_c (D_c + D_cᵀ)`` (the paths through later chunks' penalties), and
    ``dlam_init [NH, K, K] = dΛ_end + Σ_c dΛ_c`` float32. Grid ``(NH,)``."""
    i_nh = tl.program_id(0)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    i_bh = i_b * H + i_h
    o_k, m_kk, p_kk, p_state = square_tile(i_nh, K, BK)
    if USE_DA_END:
        b_a = tl.load(a_end + p_state, mask=m_kk, other=0.0)
        b_da = tl.load(da_end + p_state, mask=m_kk, other=0.0).to(tl.float32)
        b_ada = tl.dot(tl.trans(b_a), b_da, input_precision=PRECISION)
        b_d = -tl.dot(b_ada, tl.trans(b_a), input_precision=PRECISION)
    else:
        b_d = tl.zeros([BK, BK], dtype=tl.float32)
    NCS = tl.cdiv(L, BT)
    for i_back in range(0, NCS):
        i_c = NCS - 1 - i_back
        b_u = row_tile(u, i_b, i_h, bos, i_c, L, sub, sut, suh, sud, o_k, K, BT)[0].to(tl.float32)
        p_k, m_k = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
        b_du = tl.load(du + p_k, mask=m_k, other=0.0) + tl.dot(b_u, b_d + tl.trans(b_d), input_precision=PRECISION)
        tl.store(du_out + p_k, b_du.to(du_out.dtype.element_ty), mask=m_k)
        b_d += tl.load(dlam + (i_bh * NC + c0 + i_c) * K * K + p_kk, mask=m_kk, other=0.0)
    tl.store(dlam_init + p_state, b_d, mask=m_kk)


@triton.jit
def vla_gates_fwd_kernel(
    k_hat, u, lam, alpha, a0_out, r_out, anorm_out, cu_seqlens, offsets, T, NC, N, sub, sut, suh, sud,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr, GROUP: tl.constexpr,
    PRECISION: tl.constexpr, NORMALIZE: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``k_hat [B, T, H, K]`` float32, ``u [B, T, H, K]`` (strided), ``lam [BH, NC, K, K]`` float32 ->
    ``alpha [B, T, H, K]`` and, for the backward, ``a0_out [BH, NC, K, K]`` (``A0``), ``r_out [B, T, H, K]``
    (``R``), ``anorm_out [B, T, H]`` (``‖a_t‖``), all float32. Grid ``(⌈NC / GROUP⌉, BH)``. ``NORMALIZE``
    false: ``alpha`` is ``a`` itself (``‖a‖`` stored all the same).

    A program takes ``GROUP`` consecutive chunks and sweeps only the first one's penalty. It then walks its
    tokens in blocks of ``SB`` rows carrying the current inverse ``A`` (``A ← A − R_bᵀ R_b`` after each block, one
    product): inside a block the ``SB`` rank-one downdates act on ``[SB, K]`` tiles, and ``a = K̂_b A −
    tril(K̂_b R_bᵀ) R_b``. ``A`` at each chunk's start is stored for the backward; ``lam`` of the other chunks
    of the group is not read (their ``A0`` is the same matrix), except where a packed sequence starts inside
    the group (chunk slots as :func:`chunk_program`): its first chunk's penalty is swept afresh."""
    i_g, i_bh = tl.program_id(0), tl.program_id(1)
    NB: tl.constexpr = BT // SB
    o_k = tl.arange(0, BK)
    o_s = tl.arange(0, SB)
    rows = o_s[:, None]
    b_a0 = chunk_inverse(lam, i_g * GROUP, i_bh, NC, K, BK)[0]
    for j in range(0, GROUP):
        i_p = i_g * GROUP + j
        i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
        if IS_VARLEN:  # a dense row starts only at a group's start
            if (j > 0) & (i_c == 0):
                b_a0 = chunk_inverse(lam, tl.minimum(i_p, NC - 1), i_bh, NC, K, BK)[0]
        p_kk = (i_bh.to(tl.int64) * NC + i_p) * K * K + o_k[:, None] * K + o_k[None, :]
        m_kk = (o_k < K)[:, None] & (o_k < K)[None, :] & (o_k * 0 + i_p < NC)[None, :]
        tl.store(a0_out + p_kk, b_a0, mask=m_kk)
        for b in range(0, NB):
            i_sb = i_c * NB + b
            p_k, m_k = dense_rows(i_b, i_h, bos, i_sb, L, T, H, o_k, K, SB)
            b_kh = tl.load(k_hat + p_k, mask=m_k, other=0.0)
            b_u = row_tile(u, i_b, i_h, bos, i_sb, L, sub, sut, suh, sud, o_k, K, SB)[0].to(tl.float32)
            b_y = tl.dot(b_u, b_a0, input_precision=PRECISION)  # rows A u_t
            b_d = tl.zeros([SB], dtype=tl.float32)
            for t in range(0, SB):
                b_z = tl.sum(tl.where(rows == t, b_y, 0.0), 0)  # z_t = A_{t-1} u_t, final once rows < t applied
                b_uz = tl.sum(b_u * b_z[None, :], 1)  # u_i · z_t for every row i
                b_dt = 1.0 + tl.sum(tl.where(o_s == t, b_uz, 0.0), 0)
                b_d = tl.where(o_s == t, b_dt, b_d)
                b_y -= tl.where(o_s > t, b_uz / b_dt, 0.0)[:, None] * b_z[None, :]
            b_r = b_y / tl.sqrt(b_d)[:, None]
            tl.store(r_out + p_k, b_r, mask=m_k)

            b_kr = tl.where(rows >= o_s[None, :], tl.dot(b_kh, tl.trans(b_r), input_precision=PRECISION), 0.0)
            b_a = tl.dot(b_kh, b_a0, input_precision=PRECISION) - tl.dot(b_kr, b_r, input_precision=PRECISION)
            b_norm = tl.sqrt(tl.sum(b_a * b_a, 1))
            b_norm = tl.where(b_norm > 0, b_norm, 1.0)  # rows past T (zero k̂)
            if NORMALIZE:
                b_a = b_a / b_norm[:, None]
            tl.store(alpha + p_k, b_a, mask=m_k)
            o_tok = i_sb * SB + o_s
            tl.store(anorm_out + dense_tokens(i_b, i_h, bos, o_tok, T, H), b_norm, mask=o_tok < L)
            # A after the block: A − Σ_t r_t r_tᵀ (rows past T are zero)
            b_a0 -= tl.dot(tl.trans(b_r), b_r, input_precision=PRECISION)


@triton.jit
def direction_adjoint(
    alpha, dalpha, anorm, p_k, m_k, i_b, i_h, bos, o_tok, L, T, H: tl.constexpr, NORMALIZE: tl.constexpr
):
    """``(da, a)`` of a chunk's rows ``p_k``: with ``NORMALIZE`` the gradient through ``α̂ = a / ‖a‖``, ``da = (dα̂ −
    α̂ (α̂·dα̂)) / ‖a‖``, and ``a = α̂ ‖a‖``; without it ``dα̂`` and ``α̂`` themselves (``a`` was stored)."""
    b_al = tl.load(alpha + p_k, mask=m_k, other=0.0)
    b_dal = tl.load(dalpha + p_k, mask=m_k, other=0.0).to(tl.float32)
    if NORMALIZE:
        b_norm = tl.load(anorm + dense_tokens(i_b, i_h, bos, o_tok, T, H), mask=o_tok < L, other=1.0)
        return (b_dal - b_al * tl.sum(b_al * b_dal, 1)[:, None]) / b_norm[:, None], b_al * b_norm[:, None]
    else:
        return b_dal, b_al


@triton.jit
def vla_gates_bwd_kernel(
    u, alpha, a0, r, anorm, dalpha, dk_hat, du, dlam, cu_seqlens, offsets, T, NC, N, sub, sut, suh, sud,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
    NORMALIZE: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``u [B, T, H, K]`` (strided), the forward's ``alpha``, ``a0``, ``r``, ``anorm`` and ``dalpha
    [B, T, H, K]`` -> ``dk_hat``, ``du [B, T, H, K]`` (the within-chunk share) and ``dlam [BH, NC, K, K]``,
    float32. Grid
    ``(NC, BH)``. ``NORMALIZE`` as the forward's: without it ``da = dalpha`` and ``a = alpha``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    p_k, m_k = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
    o_tok = i_c * BT + o_t
    # tiles loaded where their first product needs them, so that fewer are alive at once
    b_da, b_a = direction_adjoint(alpha, dalpha, anorm, p_k, m_k, i_b, i_h, bos, o_tok, L, T, H, NORMALIZE)
    rows = o_t[:, None]
    cols = o_t[None, :]
    b_r = tl.load(r + p_k, mask=m_k, other=0.0)
    b_dr = tl.where(rows >= cols, tl.dot(b_da, tl.trans(b_r), input_precision=PRECISION), 0.0)
    m_kk = (o_k < K)[:, None] & (o_k < K)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_kk = (i_bh.to(tl.int64) * NC + i_p) * K * K + o_k[:, None] * K + o_k[None, :]
    b_a0 = tl.load(a0 + p_kk, mask=m_kk, other=0.0)
    b_g = tl.dot(b_da, b_a0, input_precision=PRECISION) - tl.dot(b_dr, b_r, input_precision=PRECISION)
    tl.store(dk_hat + p_k, b_g, mask=m_k)
    tl.store(dlam + p_kk, -tl.dot(tl.trans(b_g), b_a, input_precision=PRECISION), mask=m_kk)
    # du_s = -Σ_{t>=s} g_t (a_t·u_s) + a_t (g_t·u_s): [s, t] tiles kept where t >= s
    b_u = row_tile(u, i_b, i_h, bos, i_c, L, sub, sut, suh, sud, o_k, K, BT)[0].to(tl.float32)
    b_ua = tl.where(rows <= cols, tl.dot(b_u, tl.trans(b_a), input_precision=PRECISION), 0.0)
    b_ug = tl.where(rows <= cols, tl.dot(b_u, tl.trans(b_g), input_precision=PRECISION), 0.0)
    b_du = -(tl.dot(b_ua, b_g, input_precision=PRECISION) + tl.dot(b_ug, b_a, input_precision=PRECISION))
    tl.store(du + p_k, b_du, mask=m_k)


@triton.jit
def column_block_site(
    cu_seqlens, offsets, T, N, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    BT: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """Program ``(chunk slot, batch row × head, column block)``'s chunk (:func:`chunk_site`), the offsets and masks of
    its chunk's ``[BT, BK]`` rows and of their columns ``[i_col·BC, (i_col + 1)·BC)`` in a contiguous ``[B, T, H, K]``
    tensor: ``(i_p, i_bh, i_b, i_h, bos, L, i_c, o_k, o_j, o_t, p_k, m_k, p_j, m_j)``."""
    i_p, i_bh, i_col = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    o_k = tl.arange(0, BK)
    o_j = i_col * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    p_k, m_k = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
    p_j, m_j = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_j, K, BT)
    return i_p, i_bh, i_b, i_h, bos, L, i_c, o_k, o_j, o_t, p_k, m_k, p_j, m_j


@triton.jit
def vla_gates_bwd_g_kernel(
    alpha, a0, r, anorm, dalpha, dk_hat, dlam, cu_seqlens, offsets, T, NC, N,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, NORMALIZE: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """The first half of :func:`vla_gates_bwd_kernel` by column blocks (``BWD_COLUMNS``): ``g = A0 da − Σ (r·da) r``'s
    columns ``[i_col·BC, (i_col + 1)·BC)`` into ``dk_hat`` and the same rows of ``dlam = −gᵀa``. Grid ``(NC, BH,
    ⌈K / BC⌉)``; each program forms ``tril(da Rᵀ)`` itself (a ``K``-wide product), the rest is its columns' share."""
    i_p, i_bh, i_b, i_h, bos, L, i_c, o_k, o_j, o_t, p_k, m_k, p_j, m_j = column_block_site(
        cu_seqlens, offsets, T, N, H, K, BK, BC, BT, IS_VARLEN, LOG_N
    )
    o_tok = i_c * BT + o_t
    b_da, b_a = direction_adjoint(alpha, dalpha, anorm, p_k, m_k, i_b, i_h, bos, o_tok, L, T, H, NORMALIZE)
    b_r = tl.load(r + p_k, mask=m_k, other=0.0)
    b_dr = tl.where(o_t[:, None] >= o_t[None, :], tl.dot(b_da, tl.trans(b_r), input_precision=PRECISION), 0.0)
    m_kj = (o_k < K)[:, None] & (o_j < K)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_kk = (i_bh.to(tl.int64) * NC + i_p) * K * K
    b_a0 = tl.load(a0 + p_kk + o_k[:, None] * K + o_j[None, :], mask=m_kj, other=0.0)
    b_rj = tl.load(r + p_j, mask=m_j, other=0.0)
    b_g = tl.dot(b_da, b_a0, input_precision=PRECISION) - tl.dot(b_dr, b_rj, input_precision=PRECISION)
    tl.store(dk_hat + p_j, b_g, mask=m_j)
    b_dlam = -tl.dot(tl.trans(b_g), b_a, input_precision=PRECISION)  # rows o_j of -gᵀa
    tl.store(dlam + p_kk + o_j[:, None] * K + o_k[None, :], b_dlam, mask=tl.trans(m_kj))


@triton.jit
def vla_gates_bwd_u_kernel(
    u, alpha, anorm, dk_hat, du, cu_seqlens, offsets, T, NC, N, sub, sut, suh, sud,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, NORMALIZE: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """The second half: ``du_s = −Σ_{t≥s} g_t (a_t·u_s) + a_t (g_t·u_s)``'s columns ``[i_col·BC, (i_col + 1)·BC)``
    from ``u``, ``a`` and :func:`vla_gates_bwd_g_kernel`'s ``g`` (``dk_hat``). Grid ``(NC, BH, ⌈K / BC⌉)``; each
    program forms ``triu(U Aᵀ)`` and ``triu(U Gᵀ)`` itself."""
    i_p, i_bh, i_b, i_h, bos, L, i_c, o_k, o_j, o_t, p_k, m_k, p_j, m_j = column_block_site(
        cu_seqlens, offsets, T, N, H, K, BK, BC, BT, IS_VARLEN, LOG_N
    )
    o_tok = i_c * BT + o_t
    upper = o_t[:, None] <= o_t[None, :]
    if NORMALIZE:
        b_norm = tl.load(anorm + dense_tokens(i_b, i_h, bos, o_tok, T, H), mask=o_tok < L, other=1.0)[:, None]
    else:
        b_norm = tl.full([BT, 1], 1.0, tl.float32)
    b_u = row_tile(u, i_b, i_h, bos, i_c, L, sub, sut, suh, sud, o_k, K, BT)[0].to(tl.float32)
    b_a = tl.load(alpha + p_k, mask=m_k, other=0.0) * b_norm
    b_ua = tl.where(upper, tl.dot(b_u, tl.trans(b_a), input_precision=PRECISION), 0.0)
    b_g = tl.load(dk_hat + p_k, mask=m_k, other=0.0)
    b_ug = tl.where(upper, tl.dot(b_u, tl.trans(b_g), input_precision=PRECISION), 0.0)
    b_gj = tl.load(dk_hat + p_j, mask=m_j, other=0.0)
    b_aj = tl.load(alpha + p_j, mask=m_j, other=0.0) * b_norm
    b_du = -(tl.dot(b_ua, b_gj, input_precision=PRECISION) + tl.dot(b_ug, b_aj, input_precision=PRECISION))
    tl.store(du + p_j, b_du, mask=m_j)


# The gate backward as two launches over column blocks of this width (None: one program a chunk). Timed on an H100
# (thirty-fifth session, `benchmarks/vla_gates_ab.py`, 32768 tokens, ms one program -> 64 columns -> 32 columns):
# K = 64, T = 1k 1.255 -> 1.186 -> 1.481, T = 32k 3.317 -> 3.240 -> 3.521; K = 128, T = 1k 4.998 -> 3.371 -> 4.416, T =
# 32k 15.32 -> 13.70 -> 14.66 (the same gradients to 2e-7). So 64: at K = 64 one block, the backward's two halves in
# two launches; at K = 128 two. Compiled for sm_90a (Triton 3.6, bf16 ``u``): 32-column blocks spill nothing
# at K = 64 (four warps: 229 / 190 registers, 64 / 32 KB of shared memory) and 0 / 164 bytes at K = 128 (eight warps,
# 128 / 64 KB), where the one-program kernel spills 604 bytes at K = 64 and 2932 at K = 128 (96 / 192 KB); the price
# is the ``K``-wide products ``tril(da Rᵀ)``, ``triu(U Aᵀ)``, ``triu(U Gᵀ)`` in every column block and a second read
# of ``g`` and ``a``.
BWD_COLUMNS: int | None = 64


def launch_config(key_dim: int, chunks: int = 1) -> dict[str, int]:
    """Warps, stages, ``GROUP`` (chunks per program) and ``SB`` (rows per downdate block) of the gate kernels.

    The ``[K, K]`` tiles live in registers through the sweeps, so eight warps from ``K = 128``; no loop to
    pipeline over loads. ``chunks`` (all heads' chunks together): the largest ``GROUP`` of 8, 4, 2 that still
    leaves 512 programs. The H200 sweep of ``benchmarks/vla_profile.py`` (``vla_profile_h200.txt``, T = 1k, 32768
    tokens) set it: the forward gate kernel took 1.50 ms with ``GROUP = 8`` against 1.71 (4) and 2.93 (1) at
    K = 64 (8192 chunks), and 4.07 ms against 5.20 (4) and 11.9 (1) at K = 128 (4096 chunks); ``SB = 16`` beat
    32 and 64 at both, and eight warps at K = 64 were 2.2× slower than four. Fewer warps were slower too
    (twentieth session, ``vla_profile_session20_h200.log``): two at K = 64 took 2.30 ms forward and 25.5 backward
    (spilling), four at K = 128 5.54 against 3.94. The backward kernel ignores ``GROUP`` and ``SB``."""
    group = next((g for g in (8, 4, 2) if chunks // g >= 512), 1)
    return dict(num_warps=4 if key_dim <= 64 else 8, num_stages=1, GROUP=group, SB=16)


def u_strides(u: torch.Tensor) -> dict[str, int]:
    """The gate kernels' stride arguments of ``u [B, T, H, K]``."""
    return dict(zip(("sub", "sut", "suh", "sud"), u.stride()))


def vla_gates_fwd_fn(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam: torch.Tensor,
    chunk_size: int,
    precision: str,
    config: dict[str, int] | None = None,
    normalize: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k_hat [B, T, H, K]`` float32 contiguous, ``u [B, T, H, K]`` (any strides and float dtype),
    ``lam [B, H, NC, K, K]`` float32 contiguous (the chunk slots of :func:`chunk_layout`: ``⌈T / C⌉`` dense) ->
    ``(alpha, A0, R, ‖a‖)``: ``alpha, R [B, T, H, K]``, ``A0`` like ``lam``, ``‖a‖ [B, T, H]``, float32.
    ``config``: warps, stages and ``GROUP`` instead of :func:`launch_config` (the benchmarks' sweep);
    ``normalize``: ``alpha = a / ‖a‖`` (else ``a``); ``cu_seqlens``, ``offsets``: packed sequences (``B == 1``)
    and their first chunks."""
    B, T, H, K = k_hat.shape
    NC = lam.shape[-3]
    _, _, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, offsets)
    f32 = dict(dtype=torch.float32, device=k_hat.device)
    alpha, r = torch.empty(B, T, H, K, **f32), torch.empty(B, T, H, K, **f32)
    a0, anorm = torch.empty(lam.shape, **f32), torch.empty(B, T, H, **f32)
    config = config or launch_config(K, NC * B * H)
    vla_gates_fwd_kernel[(triton.cdiv(NC, config["GROUP"]), B * H)](
        k_hat, u, lam, alpha, a0, r, anorm, T=T, NC=NC, H=H, K=K, BK=block_dim(K), BT=chunk_size,
        PRECISION=precision, NORMALIZE=normalize, **u_strides(u), **varlen, **config,
    )  # fmt: skip
    return alpha, a0, r, anorm


def vla_gates_bwd_fn(
    u: torch.Tensor,
    alpha: torch.Tensor,
    a0: torch.Tensor,
    r: torch.Tensor,
    anorm: torch.Tensor,
    dalpha: torch.Tensor,
    chunk_size: int,
    precision: str,
    config: dict[str, int] | None = None,
    normalize: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk_hat, du_within, dlam)`` float32 (``[B, T, H, K]`` contiguous, and ``dlam`` like ``a0``) from the
    forward's saved tensors and ``dalpha`` (contiguous; ``u`` any strides); ``normalize``, ``cu_seqlens`` and
    ``offsets`` as the forward's."""
    B, T, H, K = u.shape
    NC = a0.shape[-3]
    _, _, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, offsets)
    dk_hat, du = torch.empty_like(alpha), torch.empty_like(alpha)
    dlam = torch.empty_like(a0)
    config = {n: x for n, x in (config or launch_config(K)).items() if n not in ("GROUP", "SB")}
    dims = dict(T=T, NC=NC, H=H, K=K, BK=block_dim(K), BT=chunk_size, PRECISION=precision, NORMALIZE=normalize)
    if BWD_COLUMNS is None:
        vla_gates_bwd_kernel[(NC, B * H)](
            u, alpha, a0, r, anorm, dalpha, dk_hat, du, dlam, **dims, **u_strides(u), **varlen, **config
        )
        return dk_hat, du, dlam
    BC = max(16, min(BWD_COLUMNS, block_dim(K)))  # tl.dot's least width
    grid = (NC, B * H, triton.cdiv(K, BC))
    vla_gates_bwd_g_kernel[grid](alpha, a0, r, anorm, dalpha, dk_hat, dlam, BC=BC, **dims, **varlen, **config)
    vla_gates_bwd_u_kernel[grid](u, alpha, anorm, dk_hat, du, BC=BC, **dims, **u_strides(u), **varlen, **config)
    return dk_hat, du, dlam


def vla_write_fwd_fn(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam_init: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    lam0: float,
    chunk_size: int,
    precision: str,
    normalize: bool = True,
    final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole gate stage: the chunks' penalties (:func:`gram_prefix_kernel`), then the write directions.
    ``k_hat [B, T, H, K]`` float32 contiguous, ``u [B, T, H, K]`` (any strides and float dtype), ``lam_init
    [N, H, K, K]`` (``A_init⁻¹``) or None for ``lam0·I`` -> ``(alpha [B, T, H, K], A_end [N, H, K, K], A0, R,
    ‖a‖)``, float32; without ``final`` ``A_end`` is empty (``[0]``), its sweep not run."""
    B, T, H, K = k_hat.shape
    offsets, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size)
    N = varlen["N"]
    lam = torch.empty(B, H, NC, K, K, dtype=torch.float32, device=u.device)
    a_end = torch.empty((N, H, K, K) if final else (0,), dtype=torch.float32, device=u.device)
    warps = launch_config(K)["num_warps"]
    gram_prefix_kernel[(N * H,)](
        u, lam_init, lam, a_end, cu_seqlens, offsets, T, NC, lam0, H=H, K=K, BK=block_dim(K), BT=chunk_size,
        USE_INIT=lam_init is not None, PRECISION=precision, IS_VARLEN=cu_seqlens is not None, WRITE_END=final,
        num_warps=warps, **u_strides(u),
    )  # fmt: skip
    alpha, a0, r, anorm = vla_gates_fwd_fn(
        k_hat, u, lam, chunk_size, precision, normalize=normalize, cu_seqlens=cu_seqlens, offsets=offsets
    )
    return alpha, a_end, a0, r, anorm


def vla_write_bwd_fn(
    u: torch.Tensor,
    alpha: torch.Tensor,
    a0: torch.Tensor,
    r: torch.Tensor,
    anorm: torch.Tensor,
    a_end: torch.Tensor,
    dalpha: torch.Tensor,
    da_end: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    precision: str,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk_hat, du, dlam_init)``: the backward of :func:`vla_write_fwd_fn`, from ``dalpha`` and the gradient of
    ``A_end`` (or None); ``dk_hat`` float32 and ``du`` in ``u``'s dtype, ``[B, T, H, K]`` contiguous,
    ``dlam_init`` float32."""
    B, T, H, K = u.shape
    offsets, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size)
    N = varlen["N"]
    dk_hat, du_within, dlam = vla_gates_bwd_fn(
        u, alpha, a0, r, anorm, dalpha, chunk_size, precision, normalize=normalize, cu_seqlens=cu_seqlens,
        offsets=offsets,
    )  # fmt: skip
    du = torch.empty(B, T, H, K, dtype=u.dtype, device=u.device)
    dlam_init = torch.empty(N, H, K, K, dtype=torch.float32, device=u.device)
    gram_suffix_kernel[(N * H,)](
        u, a_end, da_end, dlam, du_within, du, dlam_init, cu_seqlens, offsets, T, NC, H=H, K=K, BK=block_dim(K),
        BT=chunk_size, USE_DA_END=da_end is not None, PRECISION=precision, IS_VARLEN=cu_seqlens is not None,
        num_warps=launch_config(K)["num_warps"], **u_strides(u),
    )  # fmt: skip
    return dk_hat, du, dlam_init
