"""The delta rule's prepare kernel as it ran on the GPU through the twelfth session: the chunk's ``T = (I + Z)⁻¹``
one 16-row diagonal block after another, row by row, and the blocks below them through ``t_out`` behind a barrier.

``delta_fwd.delta_prepare_kernel`` (all diagonal blocks at once, the rest in registers) replaces it: it passed its GPU
tests in the fifteenth session and is the default (``delta_fwd.BLOCKED_PREPARE``). This one stays, forced by
``BLOCKED_PREPARE = False``, until the two have been timed against each other (``bash benchmarks/run_gpu.sh
linear``); the interpreter's tests run both. Delete this file when the flag goes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import chunk_site, row_tile, seq_tiles, write_rows


@triton.jit
def unit_lower_inverse(b_z, BT: tl.constexpr):
    """``(I + Z)⁻¹`` of a strictly lower-triangular ``[BT, BT]`` tile given as its transpose ``b_zt = Zᵀ``.

    Forward substitution, one row per step: row ``i`` is ``e_i − Σ_{j<i} Z[i, j] X[j, :]``; the coefficients
    ``Z[i, :]`` are column ``i`` of ``Zᵀ``, which indexes them along the rows of ``X`` without a transpose.
    """
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_x = tl.where(rows == cols, 1.0, 0.0)
    for i in range(1, BT):
        b_coef = tl.sum(tl.where(cols == i, b_z, 0.0), 1)
        b_row = tl.sum(b_coef[:, None] * b_x, 0)
        b_x = tl.where(rows == i, b_x - b_row[None, :], b_x)
    return b_x


@triton.jit
def t_block(row0, i_c, length, bi, bj, BT: tl.constexpr, SB: tl.constexpr):
    """Offsets and mask of block ``(bi, bj)`` (``SB × SB``) of chunk ``i_c``'s ``T`` in a ``[rows, BT]`` tensor, for
    the sequence whose first row is ``row0``."""
    o_r = i_c * BT + bi * SB + tl.arange(0, SB)
    o_c = bj * SB + tl.arange(0, SB)
    return (row0 + o_r)[:, None] * BT + o_c[None, :], (o_r < length)[:, None] & (o_c < BT)[None, :]


@triton.jit
def delta_prepare_rows_kernel(
    k, a, beta, v, w_out, u_out, t_out, cu_seqlens, offsets, T, N,
    skb, skt, skh, skd, sab, sat, sah, sad, sbeb, sbet, sbeh, svb, svt, svh, svd,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    SB: tl.constexpr, PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr,
):  # fmt: skip
    """``k, a [B, T, H, K]``, ``v [B, T, H, V]`` (strided; ``a = β k`` when ``beta`` is given, as
    ``delta_fwd.delta_prepare_kernel``'s) -> the chunk's ``T = (I + Z)⁻¹``, ``Z = strict_tril(K Aᵀ)``, row by
    row (``t_out [BH, T, BT]``, also for the backward), ``W = T K`` (``w_out [BH, T, K]``) and ``Ũ = T V``
    (``u_out [BH, T, V]``), float32. Grid ``(chunk slots, BH)`` (:func:`chunk_program`).

    ``T`` by blocks of ``SB`` rows: the diagonal blocks by forward substitution (``SB`` steps on an ``SB × SB``
    tile), then ``T_ij = −T_ii Σ_{j≤k<i} Z_ik T_kj`` by products, reading the earlier block rows back from
    ``t_out`` (the program's own writes, behind a barrier). The solve's products are float32-accurate
    (``SOLVE_PRECISION``) whatever ``PRECISION``: ``T`` enters every later product, and with ``beta`` near 2 its
    entries are large."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    row0 = (i_b * H + i_h) * T + bos
    NB: tl.constexpr = BT // SB
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    o_s = tl.arange(0, SB)
    for bi in tl.static_range(NB):
        b_ki = row_tile(k, i_b, i_h, bos, i_c * NB + bi, L, skb, skt, skh, skd, o_k, K, SB)[0].to(tl.float32)
        b_ai = write_rows(a, beta, i_b, i_h, bos, i_c * NB + bi, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, SB)
        # Zᵀ of the diagonal block: a_r · k_c for r < c
        b_zt = tl.dot(b_ai, tl.trans(b_ki), input_precision=SOLVE_PRECISION)
        b_zt = tl.where(o_s[:, None] < o_s[None, :], b_zt, 0.0)
        b_tii = unit_lower_inverse(b_zt, SB)
        p_t, m_t = t_block(row0, i_c, L, bi, bi, BT, SB)
        tl.store(t_out + p_t, b_tii, mask=m_t)
        for bj in tl.static_range(bi):
            b_acc = tl.zeros([SB, SB], dtype=tl.float32)
            for bk in tl.static_range(bj, bi):
                b_ak = write_rows(
                    a, beta, i_b, i_h, bos, i_c * NB + bk, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, SB
                )
                b_zik = tl.dot(b_ki, tl.trans(b_ak), input_precision=SOLVE_PRECISION)  # Z_ik = K_i A_kᵀ
                p_t, m_t = t_block(row0, i_c, L, bk, bj, BT, SB)
                b_tkj = tl.load(t_out + p_t, mask=m_t, other=0.0)
                b_acc += tl.dot(b_zik, b_tkj, input_precision=SOLVE_PRECISION)
            p_t, m_t = t_block(row0, i_c, L, bi, bj, BT, SB)
            tl.store(t_out + p_t, -tl.dot(b_tii, b_acc, input_precision=SOLVE_PRECISION), mask=m_t)
        for bj in tl.static_range(bi + 1, NB):
            p_t, m_t = t_block(row0, i_c, L, bi, bj, BT, SB)
            tl.store(t_out + p_t, tl.zeros([SB, SB], dtype=tl.float32), mask=m_t)
        tl.debug_barrier()
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    p_t, m_t, _, _ = seq_tiles(row0, i_c, L, tl.arange(0, BT), tl.arange(0, BT), BT, BT, BT)
    b_t = tl.load(t_out + p_t, mask=m_t, other=0.0)
    b_k = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)[0].to(tl.float32)
    b_v = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)[0].to(tl.float32)
    tl.store(w_out + p_k, tl.dot(b_t, b_k, input_precision=PRECISION), mask=m_k)
    tl.store(u_out + p_v, tl.dot(b_t, b_v, input_precision=PRECISION), mask=m_v)
