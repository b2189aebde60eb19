"""Linear attention backward: the reverse state pass, then dQ per (chunk, query head) and dK, dV per (chunk,
key/value head).

With ``r = 1 / max(z, eps)``, the output's gradient splits into the numerator's ``dU = dO·r`` and the
normaliser's ``dz = −rowsum(dO ⊙ O)·r`` (zero where ``z < eps``, as the clamp passes none); without ``normalize``
``dU = dO``, ``dz = 0``. With ``dh`` (``dSᵀ``) and ``dn`` the gradients reaching a chunk's end state from later
tokens and from the final state, and ``M = tril(dU Vᵀ + dz 1ᵀ)``:

    dQ = dU hᵀ + M K + dz nᵀ          dK = Σ_g Mᵀ Q + V dhᵀ + 1 dnᵀ          dV = Σ_g tril(Q Kᵀ)ᵀ dU + K dh
    dh ← dh + Σ_g Qᵀ dU,  dn ← dn + Σ_g Qᵀ dz   (right to left; ``Σ_g`` over the query heads of a key/value head)

Derivation: ``README.md`` beside this file.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.baselines.linear_triton.forward import chunk_size, num_warps, state_block, state_offsets
from attnkit.ops.common.triton.delta_fwd import chunk_layout, chunk_site, row_tile, seq_site
from attnkit.ops.common.triton.rowdot import output_delta
from attnkit.ops.common.triton_utils import block_dim, float32_dots


@triton.jit
def output_grads(
    do, z, delta, i_b, i_hq, bos, i_c, L, T, eps, sdb, sdt, sdh, sdd, o_v,
    HQ: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """``(dU [BT, ·], dz [BT], o_t, m_t)`` of chunk ``i_c``'s rows of query head ``i_hq``, float32: the gradients
    of the numerator and of the normaliser (zeros past the sequence), the positions and their mask."""
    b_do, o_t, m_t = row_tile(do, i_b, i_hq, bos, i_c, L, sdb, sdt, sdh, sdd, o_v, V, BT)
    b_du = b_do.to(tl.float32)
    if NORMALIZE:
        p_row = (i_b * T + bos + o_t) * HQ + i_hq
        b_z = tl.load(z + p_row, mask=m_t, other=1.0)
        b_r = 1.0 / tl.maximum(b_z, eps)
        b_du = b_du * b_r[:, None]
        b_dz = tl.where(b_z >= eps, -tl.load(delta + p_row, mask=m_t, other=0.0) * b_r, 0.0)
    else:
        b_dz = tl.zeros([BT], dtype=tl.float32)
    return b_du, b_dz, o_t, m_t


@triton.jit
def linear_bwd_state_kernel(
    q, do, z, delta, dst, dnt, dhs, dns, ds0, dn0, cu_seqlens, offsets, T, NC, H, eps,
    sqb, sqt, sqh, sqd, sdb, sdt, sdh, sdd,
    HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_DST: tl.constexpr, USE_DNT: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``q [B,T,HQ,K]``, ``do [B,T,HQ,V]`` (strided), ``z``, ``delta [B,T,HQ]`` float32, ``dst [N,H,V,K]``,
    ``dnt [N,H,K]`` (the final state's gradients) -> ``dhs [B,H,NC,K,V]``, ``dns [B,H,NC,K]`` (``dSᵀ`` and ``dn`` at
    each chunk's end), ``ds0 [N,H,V,K]``, ``dn0 [N,H,K]``, float32. Grid ``(value blocks, N·H)``; the first value
    block writes the normalisers'."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    G = HQ // H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    m_n = (o_k < K) & (o_k * 0 + i_v == 0)
    p_s = i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]
    p_n = i_nh.to(tl.int64) * K + o_k
    if USE_DST:
        b_dh = tl.load(dst + p_s, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DNT:
        b_dn = tl.load(dnt + p_n, mask=o_k < K, other=0.0).to(tl.float32)
    else:
        b_dn = tl.zeros([BK], dtype=tl.float32)
    slot0 = (i_b * H + i_h) * NC + c0
    NCS = tl.cdiv(L, BT)
    for i_back in range(0, NCS):
        i_c = NCS - 1 - i_back
        # No name is reused across these loops with another shape: Triton (compiled, not interpreted) carries a
        # name assigned in a loop body and before it, and refuses a change of type (`_` did, at `for i_g`).
        p_h, m_h, p_ns = state_offsets(slot0 + i_c, o_k, o_v, K, V)
        tl.store(dhs + p_h, b_dh, mask=m_h)
        tl.store(dns + p_ns, b_dn, mask=m_n)
        for i_g in range(G):
            i_hq = i_h * G + i_g
            b_q, o_tq, m_tq = row_tile(q, i_b, i_hq, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)
            b_q = b_q.to(tl.float32)
            b_du, b_dz, o_td, m_td = output_grads(
                do, z, delta, i_b, i_hq, bos, i_c, L, T, eps, sdb, sdt, sdh, sdd, o_v, HQ, V, BT, NORMALIZE
            )
            b_dh += tl.dot(tl.trans(b_q), b_du, input_precision=PRECISION)
            b_dn += tl.sum(b_q * b_dz[:, None], 0)
    tl.store(ds0 + p_s, b_dh, mask=m_kv)
    tl.store(dn0 + p_n, b_dn, mask=m_n)


@triton.jit
def linear_bwd_dq_kernel(
    k, v, do, z, delta, hs, ns, dq, cu_seqlens, offsets, T, NC, N, eps,
    skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr,
):  # fmt: skip
    """``dq [B,T,HQ,K]`` (contiguous, ``dq``'s dtype) of one chunk of one query head from the forward's chunk
    states ``hs``, ``ns``. Grid ``(chunk slots, B·HQ)``; ``BV`` covers ``V``."""
    i_p = tl.program_id(0)
    i_b, i_hq, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, HQ, IS_VARLEN, LOG_N)
    if i_c * BT >= L:
        return
    i_h = i_hq // (HQ // H)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    b_du, b_dz, o_t, m_t = output_grads(
        do, z, delta, i_b, i_hq, bos, i_c, L, T, eps, sdb, sdt, sdh, sdd, o_v, HQ, V, BT, NORMALIZE
    )
    b_k, _, _ = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
    b_v, _, _ = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)
    p_h, m_kv, p_ns = state_offsets((i_b * H + i_h) * NC + i_p, o_k, o_v, K, V)
    b_h = tl.load(hs + p_h, mask=m_kv, other=0.0)
    b_m = tl.dot(b_du, tl.trans(b_v.to(tl.float32)), input_precision=PRECISION) + b_dz[:, None]
    b_m = tl.where(o_t[:, None] >= o_t[None, :], b_m, 0.0)
    b_dq = tl.dot(b_du, tl.trans(b_h), input_precision=PRECISION)
    b_dq += tl.dot(b_m, b_k.to(tl.float32), input_precision=PRECISION)
    if NORMALIZE:
        b_dq += b_dz[:, None] * tl.load(ns + p_ns, mask=o_k < K, other=0.0)[None, :]
    p_row = (i_b * T + bos + o_t) * HQ + i_hq
    m_qk = m_t[:, None] & (o_k < K)[None, :]
    tl.store(dq + p_row[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty), mask=m_qk)


@triton.jit
def linear_bwd_dkdv_kernel(
    q, k, v, do, z, delta, dhs, dns, dk, dv, cu_seqlens, offsets, T, NC, N, eps,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr,
):  # fmt: skip
    """``dk [B,T,H,K]``, ``dv [B,T,H,V]`` (contiguous, their dtypes) of one chunk of one key/value head, summed over
    its query heads, from the reverse pass's ``dhs``, ``dns``. Grid ``(chunk slots, B·H)``; ``BV`` covers ``V``."""
    i_p = tl.program_id(0)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, H, IS_VARLEN, LOG_N)
    if i_c * BT >= L:
        return
    G = HQ // H
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    b_k, o_t, m_t = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
    b_v, _, _ = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)
    b_vf = b_v.to(tl.float32)
    p_h, m_kv, p_ns = state_offsets((i_b * H + i_h) * NC + i_p, o_k, o_v, K, V)
    b_dh = tl.load(dhs + p_h, mask=m_kv, other=0.0)
    b_dk = tl.dot(b_vf, tl.trans(b_dh), input_precision=PRECISION)
    b_dk += tl.load(dns + p_ns, mask=o_k < K, other=0.0)[None, :]
    b_dv = tl.dot(b_k.to(tl.float32), b_dh, input_precision=PRECISION)
    m_st = o_t[:, None] <= o_t[None, :]  # key row s, query column t: t sees s
    for i_g in range(G):
        i_hq = i_h * G + i_g
        b_q, _, _ = row_tile(q, i_b, i_hq, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)
        b_du, b_dz, _, _ = output_grads(
            do, z, delta, i_b, i_hq, bos, i_c, L, T, eps, sdb, sdt, sdh, sdd, o_v, HQ, V, BT, NORMALIZE
        )
        b_at = tl.where(m_st, tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION), 0.0)
        b_dv += tl.dot(b_at, b_du, input_precision=PRECISION)
        b_mt = tl.dot(b_vf, tl.trans(b_du), input_precision=PRECISION) + b_dz[None, :]
        b_dk += tl.dot(tl.where(m_st, b_mt, 0.0), b_q.to(tl.float32), input_precision=PRECISION)
    p_row = (i_b * T + bos + o_t) * H + i_h
    m_k, m_v = m_t[:, None] & (o_k < K)[None, :], m_t[:, None] & (o_v < V)[None, :]
    tl.store(dk + p_row[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_k)
    tl.store(dv + p_row[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_v)


def linear_bwd_fn(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    hs: torch.Tensor,
    ns: torch.Tensor,
    z: torch.Tensor,
    dst: torch.Tensor | None,
    dnt: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    normalize: bool,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """Gradients ``(dq, dk, dv)`` in the inputs' dtypes (contiguous) and ``(dS_0 [N,H,V,K], dn_0 [N,H,K])`` in
    float32, from the forward's inputs and what :func:`forward.linear_fwd_fn` returned; ``do`` shaped like ``o``
    (any strides), ``dst``, ``dnt`` the final state's gradients (contiguous) or None."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    BT = chunk_size()
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, BT)
    N = varlen["N"]
    BK, BV = block_dim(K), block_dim(V)
    delta = output_delta(o, do) if normalize else None
    f32 = dict(dtype=torch.float32, device=q.device)
    dhs = torch.empty(B, H, NC, K, V, **f32)
    dns = torch.empty(B, H, NC, K, **f32)
    ds0 = torch.empty(N, H, V, K, **f32)
    dn0 = torch.empty(N, H, K, **f32)
    strides = dict(
        sqb=q.stride(0), sqt=q.stride(1), sqh=q.stride(2), sqd=q.stride(3),
        sdb=do.stride(0), sdt=do.stride(1), sdh=do.stride(2), sdd=do.stride(3),
    )  # fmt: skip
    kv_strides = dict(
        skb=k.stride(0), skt=k.stride(1), skh=k.stride(2), skd=k.stride(3),
        svb=v.stride(0), svt=v.stride(1), svh=v.stride(2), svd=v.stride(3),
    )  # fmt: skip
    common = dict(
        HQ=HQ, K=K, V=V, BK=BK, BT=BT, NORMALIZE=normalize, PRECISION=float32_dots(q.dtype),
        IS_VARLEN=varlen["IS_VARLEN"],
    )  # fmt: skip
    BV_STATE = state_block(V)
    linear_bwd_state_kernel[(triton.cdiv(V, BV_STATE), N * H)](
        q, do, z, delta, dst, dnt, dhs, dns, ds0, dn0, varlen["cu_seqlens"], varlen["offsets"], T, NC, H, eps,
        BV=BV_STATE, USE_DST=dst is not None, USE_DNT=dnt is not None, num_warps=num_warps(K, V), num_stages=1,
        **strides, **common,
    )  # fmt: skip
    rows = 1 if cu_seqlens is not None else B
    parallel = dict(
        cu_seqlens=varlen["cu_seqlens"], offsets=varlen["offsets"], T=T, NC=NC, N=N, eps=eps, H=H, BV=BV,
        LOG_N=varlen["LOG_N"], num_warps=num_warps(K, V), num_stages=1, **kv_strides, **common,
    )  # fmt: skip
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    linear_bwd_dq_kernel[(NC, rows * HQ)](
        k, v, do, z, delta, hs, ns, dq, sdb=do.stride(0), sdt=do.stride(1), sdh=do.stride(2), sdd=do.stride(3),
        **parallel,
    )  # fmt: skip
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    linear_bwd_dkdv_kernel[(NC, rows * H)](q, k, v, do, z, delta, dhs, dns, dk, dv, **strides, **parallel)
    return dq, dk, dv, ds0, dn0
