"""Generalised delta rule, backward kernels (forward: ``delta_fwd.py``).

With ``h`` the state at a chunk's start, ``h' = h + Aᵀ U`` at its end, ``U = Ũ − W h`` and
``O = Q h + tril(Q Aᵀ) U``, and ``dh'`` the gradient reaching ``h'`` from later chunks:

    dU  = tril(Q Aᵀ)ᵀ dO + A dh'              dh = dh' + Qᵀ dO − Wᵀ dU        (sequential, right to left)
    dQ  = dO hᵀ + tril(dO Uᵀ) A               dA = U dh'ᵀ + tril(dO Uᵀ)ᵀ Q + dZᵀ K
    dW  = −dU hᵀ,  dŨ = dU                     dK = Tᵀ dW + dZ A,  dV = Tᵀ dŨ
    dZ  = strict_tril(−Tᵀ (dW Kᵀ + dŨ Vᵀ) Tᵀ)  (Z = strict_tril(K Aᵀ), T = (I + Z)⁻¹)

Three kernels: the reverse state pass (stores ``dU`` and ``dh'`` per chunk), then two per-chunk kernels, one for
the gradients through the reads (``dQ`` and part of ``dA``) and one through the WY form (``dK``, ``dV``, the
rest of ``dA``): split so that each fits shared memory at ``K = 128``. Inputs and gradients are in the caller's
``[B, T, H, ·]`` layout and dtypes (``delta_fwd.py``); with ``q`` scaled by ``scale``, ``dq = scale · dQ``; with
``a = β k`` (DeltaNet), ``dk`` gains ``β dA`` and ``dβ = Σ_d dA ⊙ k``. With more than one value block the two
per-chunk kernels leave float32 shares per block and :func:`delta_bwd_sum_kernel` adds them up.
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
    few_state_programs,
    launch_config,
    launch_dims,
    operand,
    query_chunk,
    register_cap,
    row_tile,
    seq_site,
    seq_tiles,
    state_launch,
    strides,
    token_values,
    write_rows,
)

# The state pass's terms that do not depend on the state, triu(A Qᵀ) dO (dU's share) and Qᵀ dO (dh's), computed a
# chunk at a time by delta_bwd_local_kernel (chunk-parallel, into du and dhs) before the pass, which then reads them
# where it read Q and dO: its chunk step goes from five products to two, as the forward's (U = Ũ − W h, h + Aᵀ U).
# Counted at K = 64 and 16 value columns (the narrow launch at T = 32k, B = 1), a step's multiply-adds fall from 524k
# to 131k (A Qᵀ, BT × BT × K, was half of them, recomputed by every value block's program); the pass reads a [K, BV]
# and a [BT, BV] float32 tile a chunk instead of Q and dO. One more launch, and one more float32 write and read of
# du and dhs. Compiled for sm_90a (Triton 3.6, DeltaNet K = V = 64, bf16, no prefetch; mixers_h200.md, twentieth
# session) the pass's loop went from 1303 to 592 instructions at 16 columns (16 wgmma against 40, no spills against 196
# bytes, 24 KB of shared memory against 56) and from 1765 to 888 at 64. Timed on an H100 (thirty-first session,
# DeltaNet D = 64, bf16, forward+backward kernels; `bash benchmarks/run_gpu.sh deltastate`): at T = 32k, B = 1 (16
# programs, the pass a chain of 512 chunk steps) 4.554 ms against 4.851 (the pass 1509 us against 1992, the new kernel
# 194); at T = 2k, B = 16 (256 programs, the GPU full) 2.706 against 2.551 (the pass 283 against 322, the new kernel
# 191). So None, the default, takes it where the state passes launch few programs
# (delta_fwd.few_state_programs, the rule that narrows them to 16 columns); True or False forces it.
LOCAL_DU: bool | None = None
# The WY-form kernel (delta_bwd_wy_kernel) loads each tile where its first product needs it and takes Tᵀ once: compiled
# for sm_90a (Triton 3.6, DeltaNet, bf16, thirty-third session) its shared memory went from 144 to 80 KB at K = 64
# (eight warps, 208 -> 219 registers, no spills) and from 208 to 128 KB at K = 128, the same products. Two settings,
# off and untimed (`run_gpu.sh deltastate` times them): WY_WARPS, its warps (None: launch_config's wide rule, eight
# from K = 64; four at K = 64 compile to 201 registers and no spills, so two programs share an SM where one did);
# WY_MAXNREG, a cap on its registers a thread (eight warps capped at 128: 268 bytes of spills, two programs an SM).
WY_WARPS: int | None = None
WY_MAXNREG: int | None = None


@triton.jit
def local_du(b_q, b_a, b_do, rows, cols, PRECISION: tl.constexpr, LOW: tl.constexpr):
    """``triu(A Qᵀ) dO`` of a chunk (``tril(Q Aᵀ)ᵀ = triu(A Qᵀ)``): the share of ``dU`` that skips the state."""
    b_aq = tl.where(
        rows <= cols, tl.dot(operand(b_a, LOW), operand(tl.trans(b_q), LOW), input_precision=PRECISION), 0.0
    )
    return tl.dot(operand(b_aq, LOW), operand(b_do, LOW), input_precision=PRECISION)


@triton.jit
def local_dh(b_q, b_do, PRECISION: tl.constexpr, LOW: tl.constexpr):
    """``Qᵀ dO`` of a chunk: the share of the state's gradient that skips the state."""
    return tl.dot(operand(tl.trans(b_q), LOW), operand(b_do, LOW), input_precision=PRECISION)


@triton.jit
def bwd_state_step(b_a, b_w, b_dh, b_f1, b_f2, rows, cols, PRECISION: tl.constexpr, LOW: tl.constexpr,
                   LOCAL: tl.constexpr):  # fmt: skip
    """One chunk of the backward's state pass, right to left, from :func:`free_tiles`: ``dU = triu(A Qᵀ) dO + A dh'``
    and ``dh'`` carried to the chunk's start, ``dh' + Qᵀ dO − Wᵀ dU``, the terms without the state (:func:`local_du`,
    :func:`local_dh`) read (``LOCAL``) or computed. Returns ``(dU, dh')``."""
    if LOCAL:
        b_du = b_f1
    else:
        b_du = local_du(b_f1, b_a, b_f2, rows, cols, PRECISION, LOW)
    b_du += tl.dot(operand(b_a, LOW), operand(b_dh, LOW), input_precision=PRECISION)
    if LOCAL:
        b_dh += b_f2
    else:
        b_dh += local_dh(b_f1, b_f2, PRECISION, LOW)
    b_dh -= tl.dot(operand(tl.trans(b_w), LOW), operand(b_du, LOW), input_precision=PRECISION)
    return b_du, b_dh


@triton.jit
def delta_bwd_local_kernel(
    q, a, beta, do, du, dhs, cu_seqlens, offsets, T, NC, N, scale,
    sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr, LOW: tl.constexpr = "",
):  # fmt: skip
    """:func:`local_du` and :func:`local_dh` of every chunk, ``Q`` the queries times ``scale``, into ``du [BH, T,
    V]`` and ``dhs [BH, NC, K, V]`` (float32, inputs as :func:`delta_bwd_state_kernel`'s), where the state pass
    reads them and then writes its own (:data:`LOCAL_DU`). Grid ``(chunk slots, BH, value blocks)``."""
    i_p = tl.program_id(0)
    i_b, i_h, bos, L, i_c, i_bh, o_k, o_v, p_v, m_v, b_q, b_a = query_chunk(
        q, a, beta, cu_seqlens, offsets, T, N, scale, sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh,
        H, K, V, BK, BV, BT, IS_VARLEN, LOG_N,
    )  # fmt: skip
    b_do = row_tile(do, i_b, i_h, bos, i_c, L, sdob, sdot, sdoh, sdod, o_v, V, BT)[0].to(tl.float32)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    tl.store(du + p_v, local_du(b_q, b_a, b_do, rows, cols, PRECISION, LOW), mask=m_v)
    p_dhs = (i_bh * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]  # no chunk past the last
    tl.store(dhs + p_dhs, local_dh(b_q, b_do, PRECISION, LOW), mask=m_kv)


@triton.jit
def delta_bwd_state_kernel(
    q, a, beta, w, do, dht, dhs, du, dh0, cu_seqlens, offsets, T, NC, H, scale,
    sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_DHT: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOW: tl.constexpr = "",
    PREFETCH: tl.constexpr = False, LOCAL: tl.constexpr = False,
):  # fmt: skip
    """``q [B, T, H, K]``, ``a`` (and ``beta``) as the forward's, ``w [BH, T, K]`` float32, ``do [B, T, H, V]``
    (strided), ``dht [NH, V, K]`` (gradient of the final state) -> ``dhs [BH, NC, K, V]`` (``dh'`` of each chunk),
    ``du [BH, T, V]``, ``dh0 [NH, V, K]``, all float32. Grid ``(value blocks, NH)`` (:func:`seq_site`).
    ``PREFETCH`` (:data:`delta_fwd.STATE_PREFETCH`): each chunk's tiles that do not depend on ``dh'`` are read during
    the chunk after it. ``LOCAL`` (:data:`LOCAL_DU`): ``du`` and ``dhs`` hold every chunk's :func:`local_du` and
    :func:`local_dh` on entry, read (each before its slot is overwritten) instead of ``Q`` and ``dO``."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    i_bh = i_b * H + i_h
    row0 = i_bh * T + bos
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_state = i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]
    if USE_DHT:
        b_dh = tl.load(dht + p_state, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    NCS = tl.cdiv(L, BT)
    if PREFETCH:  # the tiles that do not depend on dh', read one chunk ahead of their use (right to left)
        i_l = tl.maximum(NCS - 1, 0)  # the last chunk (an empty sequence: chunk 0, every row masked, never used)
        b_a, b_w, b_f1, b_f2 = free_tiles(
            q, a, beta, w, do, du, dhs, i_b, i_h, bos, i_l, L, row0, i_bh * NC + c0 + i_l, scale, o_k, o_v, m_kv,
            sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod, K, V, BT, LOCAL,
        )  # fmt: skip
    for i_back in range(0, NCS):
        i_c = NCS - 1 - i_back
        # The tiles read now: this chunk's, or with PREFETCH chunk i_c − 1's (at the first chunk its own again,
        # unused), before this step overwrites slot i_c of dhs and du (LOCAL: i_c − 1's are not yet overwritten).
        i_t = tl.maximum(i_c - 1, 0) if PREFETCH else i_c
        p_dhs = (i_bh * NC + c0 + i_c) * K * V + o_k[:, None] * V + o_v[None, :]
        if not LOCAL:
            tl.store(dhs + p_dhs, b_dh, mask=m_kv)
        n_a, n_w, n_f1, n_f2 = free_tiles(
            q, a, beta, w, do, du, dhs, i_b, i_h, bos, i_t, L, row0, i_bh * NC + c0 + i_t, scale, o_k, o_v, m_kv,
            sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod, K, V, BT, LOCAL,
        )  # fmt: skip
        if not PREFETCH:
            b_a, b_w, b_f1, b_f2 = n_a, n_w, n_f1, n_f2
        if LOCAL:
            # Slot i_c's local terms were just read (in the step) or a step ago (PREFETCH: and du's slot i_c − 1 now),
            # by other threads than those that overwrite them: every load is performed before any store to them.
            tl.debug_barrier()
            tl.store(dhs + p_dhs, b_dh, mask=m_kv)
        b_du, b_dh = bwd_state_step(b_a, b_w, b_dh, b_f1, b_f2, rows, cols, PRECISION, LOW, LOCAL)
        _, _, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
        tl.store(du + p_v, b_du, mask=m_v)
        if PREFETCH:
            b_a, b_w, b_f1, b_f2 = n_a, n_w, n_f1, n_f2
    tl.store(dh0 + p_state, b_dh, mask=m_kv)


@triton.jit
def free_tiles(
    q, a, beta, w, do, du, dhs, i_b, i_h, bos, i_c, L, row0, slot, scale, o_k, o_v, m_kv,
    sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """The tiles of chunk ``i_c`` (dhs slot ``slot``) that the state pass's step reads and that do not depend on
    ``dh'``: ``(A, W, f1, f2)``, with ``(f1, f2)`` the chunk's :func:`local_du` and :func:`local_dh` as the local
    kernel stored them (``LOCAL``), else ``(Q · scale, dO)``, float32."""
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    if LOCAL:
        b_f1 = tl.load(du + p_v, mask=m_v, other=0.0)
    else:
        b_f1 = row_tile(q, i_b, i_h, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)[0].to(tl.float32) * scale
    b_a = write_rows(a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, BT)
    b_w = tl.load(w + p_k, mask=m_k, other=0.0)
    if LOCAL:
        b_f2 = tl.load(dhs + slot * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    else:
        b_f2 = row_tile(do, i_b, i_h, bos, i_c, L, sdob, sdot, sdoh, sdod, o_v, V, BT)[0].to(tl.float32)
    return b_a, b_w, b_f1, b_f2


@triton.jit
def delta_bwd_read_kernel(
    q, a, beta, hs, dhs, u_new, do, dq, da_part, cu_seqlens, offsets, T, NC, N, scale,
    sqb, sqt, sqh, sqd, sab, sat, sah, sad, sbeb, sbet, sbeh, sdob, sdot, sdoh, sdod,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """The gradients through the reads: ``dQ = dO hᵀ + tril(dO Uᵀ) A`` and the share
    ``U dh'ᵀ + tril(dO Uᵀ)ᵀ Q`` of ``dA``, float32 ``[NV, BH, T, K]`` per value block (each a sum over the value
    dimension). ``ONE_BLOCK``: ``dq`` is ``scale · dQ`` itself, ``[B, T, H, K]`` in its dtype; else float32 shares
    like ``da_part``. Grid ``(chunk slots, BH, NV)``."""
    i_p, i_v = tl.program_id(0), tl.program_id(2)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, H, IS_VARLEN, LOG_N)
    i_bh = i_b * H + i_h
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(i_bh * T + bos, i_c, L, o_k, o_v, K, V, BT)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_hs = (i_bh * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    b_q = row_tile(q, i_b, i_h, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)[0].to(tl.float32) * scale
    b_a = write_rows(a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, BT)
    b_u = tl.load(u_new + p_v, mask=m_v, other=0.0)
    b_do = row_tile(do, i_b, i_h, bos, i_c, L, sdob, sdot, sdoh, sdod, o_v, V, BT)[0].to(tl.float32)
    b_h = tl.load(hs + p_hs, mask=m_kv, other=0.0)
    b_dh = tl.load(dhs + p_hs, mask=m_kv, other=0.0)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_dou = tl.where(rows >= cols, tl.dot(b_do, tl.trans(b_u), input_precision=PRECISION), 0.0)  # tril(dO Uᵀ)
    b_dq = tl.dot(b_do, tl.trans(b_h), input_precision=PRECISION) + tl.dot(b_dou, b_a, input_precision=PRECISION)
    b_da = tl.dot(b_u, tl.trans(b_dh), input_precision=PRECISION)
    b_da += tl.dot(tl.trans(b_dou), b_q, input_precision=PRECISION)
    p_part = i_v.to(tl.int64) * tl.num_programs(1) * T * K + p_k
    if ONE_BLOCK:
        p_dq, m_dq = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
        tl.store(dq + p_dq, (b_dq * scale).to(dq.dtype.element_ty), mask=m_dq)
    else:
        tl.store(dq + p_part, b_dq, mask=m_k)
    tl.store(da_part + p_part, b_da, mask=m_k)


@triton.jit
def write_grads(
    b_dk, b_da, k, beta, dk, da, dbeta, i_b, i_h, bos, i_c, L, T, skb, skt, skh, skd, sbeb, sbet, sbeh,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Stores the finished ``dk`` and ``dA`` of a chunk (float32 ``[BT, BK]`` tiles) in the caller's layout and
    dtypes: ``da [B, T, H, K]``, or, with ``beta`` (``a = β k``), ``dk + β dA`` and ``dbeta [B, T, H]``
    (``Σ_d dA ⊙ k``, contiguous)."""
    o_k = tl.arange(0, BK)
    p_d, m_d = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
    if beta is None:
        tl.store(da + p_d, b_da.to(da.dtype.element_ty), mask=m_d)
    else:
        b_k, o_t, m_t = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
        b_beta = token_values(beta, i_b, i_h, bos, o_t, m_t, sbeb, sbet, sbeh)
        b_dk += b_beta[:, None] * b_da
        p_dbeta = dense_tokens(i_b, i_h, bos, o_t, T, H)
        tl.store(dbeta + p_dbeta, tl.sum(b_da * b_k.to(tl.float32), 1).to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dk + p_d, b_dk.to(dk.dtype.element_ty), mask=m_d)


@triton.jit
def delta_bwd_wy_kernel(
    k, a, beta, v, tm, hs, du, dk, da, dbeta, da_read, dv, cu_seqlens, offsets, T, NC, N,
    skb, skt, skh, skd, sab, sat, sah, sad, sbeb, sbet, sbeh, svb, svt, svh, svd,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr, ONE_BLOCK: tl.constexpr,
):  # fmt: skip
    """The gradients through the WY representation: with ``dW = −dU hᵀ`` and ``T`` from the forward,
    ``dV = Tᵀ dU`` (``[B, T, H, V]``, its dtype) and ``dK = Tᵀ dW + dZ A`` and the ``dZᵀ K`` share of ``dA``
    (``dZ`` is linear in ``dT = dW Kᵀ + dU Vᵀ``). Grid ``(chunk slots, BH, NV)``. ``ONE_BLOCK``: ``dA`` adds the
    read kernel's share from ``da_read`` (float32, written by the launch before) and the kernel writes the finished
    gradients (:func:`write_grads`); else ``dk`` and ``da`` take float32 shares ``[NV, BH, T, K]``."""
    i_p, i_v = tl.program_id(0), tl.program_id(2)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, H, IS_VARLEN, LOG_N)
    i_bh = i_b * H + i_h
    row0 = i_bh * T + bos
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_hs = (i_bh * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    # Each tile loaded where its first product needs it and dropped after its last (the registers of one program).
    b_du = tl.load(du + p_v, mask=m_v, other=0.0)
    b_dw = -tl.dot(b_du, tl.trans(tl.load(hs + p_hs, mask=m_kv, other=0.0)), input_precision=PRECISION)
    p_t, m_t, _, _ = seq_tiles(row0, i_c, L, tl.arange(0, BT), tl.arange(0, BT), BT, BT, BT)
    b_tt = tl.trans(tl.load(tm + p_t, mask=m_t, other=0.0))  # Tᵀ, the left operand of four products
    b_dv = tl.dot(b_tt, b_du, input_precision=PRECISION)
    p_dv, m_dv = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_v, V, BT)
    tl.store(dv + p_dv, b_dv.to(dv.dtype.element_ty), mask=m_dv)
    b_v = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)[0]
    b_dt = tl.dot(b_du, tl.trans(b_v.to(tl.float32)), input_precision=PRECISION)
    b_k = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)[0].to(tl.float32)
    b_dt += tl.dot(b_dw, tl.trans(b_k), input_precision=PRECISION)
    b_dk = tl.dot(b_tt, b_dw, input_precision=PRECISION)
    b_dz = tl.dot(b_tt, b_dt, input_precision=PRECISION)
    b_dz = -tl.dot(b_dz, b_tt, input_precision=PRECISION)
    b_dz = tl.where(rows > cols, b_dz, 0.0)
    b_a = write_rows(a, beta, i_b, i_h, bos, i_c, L, sab, sat, sah, sad, sbeb, sbet, sbeh, o_k, K, BT)
    b_dk += tl.dot(b_dz, b_a, input_precision=PRECISION)
    b_da = tl.dot(tl.trans(b_dz), b_k, input_precision=PRECISION)
    p_part = i_v.to(tl.int64) * tl.num_programs(1) * T * K + p_k
    if ONE_BLOCK:
        b_da += tl.load(da_read + p_part, mask=m_k, other=0.0)
        write_grads(
            b_dk, b_da, k, beta, dk, da, dbeta, i_b, i_h, bos, i_c, L, T,
            skb, skt, skh, skd, sbeb, sbet, sbeh, H, K, BK, BT,
        )  # fmt: skip
    else:
        tl.store(dk + p_part, b_dk, mask=m_k)
        tl.store(da + p_part, b_da, mask=m_k)


@triton.jit
def delta_bwd_sum_kernel(
    parts, k, beta, dq, dk, da, dbeta, T, NV, scale, skb, skt, skh, skd, sbeb, sbet, sbeh,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """More than one value block: the float32 shares ``parts [4, NV, BH, T, K]`` (``dQ``, ``dK`` and the two of
    ``dA``) summed over the blocks into ``dq = scale · dQ`` and what :func:`write_grads` stores. Every row of the
    ``[BH, T]`` slots holds a token (packed sequences fill the row), so no sequence bookkeeping. Grid
    ``(⌈T / BT⌉, BH)``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_k = tl.arange(0, BK)
    p_k, m_k, _, _ = seq_tiles(i_bh.to(tl.int64) * T, i_c, T, o_k, o_k, K, K, BT)
    share = tl.num_programs(1).to(tl.int64) * T * K
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_da = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, NV):
        b_dq += tl.load(parts + i_v * share + p_k, mask=m_k, other=0.0)
        b_dk += tl.load(parts + (NV + i_v) * share + p_k, mask=m_k, other=0.0)
        b_da += tl.load(parts + (2 * NV + i_v) * share + p_k, mask=m_k, other=0.0)
        b_da += tl.load(parts + (3 * NV + i_v) * share + p_k, mask=m_k, other=0.0)
    bos = i_b * 0
    p_dq, m_dq = dense_rows(i_b, i_h, bos, i_c, T, T, H, o_k, K, BT)
    tl.store(dq + p_dq, (b_dq * scale).to(dq.dtype.element_ty), mask=m_dq)
    write_grads(
        b_dk, b_da, k, beta, dk, da, dbeta, i_b, i_h, bos, i_c, T, T,
        skb, skt, skh, skd, sbeb, sbet, sbeh, H, K, BK, BT,
    )  # fmt: skip


def delta_bwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dht: torch.Tensor | None,
    chunk_size: int,
    precision: str,
    cu_seqlens: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, da, dS_0)``: the first four ``[B, T, H, ·]`` contiguous in the dtypes of their inputs (``da``
    is ``dbeta [B, T, H]`` when ``beta`` is given), ``dS_0 [N, H, V, K]`` float32. Inputs as
    :func:`delta_fwd.delta_fwd_fn` took them, ``saved`` from it with the same ``cu_seqlens`` (its ``offsets``
    recomputed when absent), ``do [B, T, H, V]`` (any strides, unit last stride), ``dht`` the gradient of ``S_T`` or
    None."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    a_or_k = k if a is None else a
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, saved.get("offsets"))
    N = varlen["N"]
    BV_STATE, dims = launch_dims(K, V, chunk_size, precision)
    f32 = dict(dtype=torch.float32, device=k.device)
    dhs = torch.empty(B, H, NC, K, V, **f32)
    du = torch.empty(B, H, T, V, **f32)
    dh0 = torch.empty(N, H, V, K, **f32)
    seq = {n: varlen[n] for n in ("cu_seqlens", "offsets", "IS_VARLEN")}
    write = strides(a=a_or_k, beta=beta)
    reads = strides(q=q, do=do) | write
    bv, state_dims = state_launch(BV_STATE, dims, N * H, k.device, k.dtype, backward=True)
    NV = triton.cdiv(V, BV_STATE)
    local = few_state_programs(BV_STATE, dims, N * H, k.device) if LOCAL_DU is None else LOCAL_DU
    if local:
        delta_bwd_local_kernel[(NC, B * H, NV)](
            q, a_or_k, beta, do, du, dhs, T=T, NC=NC, scale=scale, H=H, BV=BV_STATE, LOW=state_dims["LOW"], **reads,
            **varlen, **dims,
        )  # fmt: skip
    delta_bwd_state_kernel[(triton.cdiv(V, bv), N * H)](
        q, a_or_k, beta, saved["w"], do, dht, dhs, du, dh0, T=T, NC=NC, H=H, scale=scale, BV=bv,
        USE_DHT=dht is not None, LOCAL=local, **reads, **seq, **state_dims,
    )  # fmt: skip
    grid = (NC, B * H, NV)
    hs, u_new = saved["hs"], saved["u_new"]
    wy = dims | launch_config(K, wide=True)
    if WY_WARPS is not None:
        wy["num_warps"] = WY_WARPS
    wy |= register_cap(WY_MAXNREG)
    dv = torch.empty(B, T, H, V, dtype=v.dtype, device=v.device)
    dk = torch.empty(B, T, H, K, dtype=k.dtype, device=k.device)
    dq = torch.empty(B, T, H, K, dtype=q.dtype, device=q.device)
    if beta is None:
        da, dbeta = torch.empty(B, T, H, K, dtype=a.dtype, device=a.device), None
    else:
        da, dbeta = None, torch.empty(B, T, H, dtype=beta.dtype, device=beta.device)
    one = NV == 1
    common = dict(T=T, NC=NC, H=H, BV=BV_STATE, ONE_BLOCK=one, **varlen)
    if one:
        # One value block (V <= 64): the kernels write the gradients themselves, the WY kernel adding the read
        # kernel's share of dA.
        da_read = torch.empty(B, H, T, K, **f32)
        outs_read, outs_wy = (dq, da_read), (dk, da, dbeta, da_read)
    else:
        # float32 shares per value block, summed by one more kernel: dQ, dK, and dA from the reads and the WY form.
        parts = torch.empty(4, NV, B, H, T, K, **f32)
        outs_read, outs_wy = (parts[0], parts[2]), (parts[1], parts[3], None, None)
    delta_bwd_read_kernel[grid](
        q, a_or_k, beta, hs, dhs, u_new, do, *outs_read, scale=scale, **reads, **common, **dims
    )  # fmt: skip
    delta_bwd_wy_kernel[grid](
        k, a_or_k, beta, v, saved["tm"], hs, du, *outs_wy, dv, **strides(k=k, v=v), **write, **common, **wy
    )  # fmt: skip
    if not one:
        delta_bwd_sum_kernel[(triton.cdiv(T, chunk_size), B * H)](
            parts, k, beta, dq, dk, da, dbeta, T, NV, scale, H=H, K=K, BK=dims["BK"], BT=chunk_size,
            num_warps=dims["num_warps"], num_stages=1, **strides(k=k, beta=beta),
        )  # fmt: skip
    return dq, dk, dv, (da if beta is None else dbeta), dh0
