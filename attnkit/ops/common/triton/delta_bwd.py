"""Generalised delta rule, backward kernels (forward: ``delta_fwd.py``).

With ``h`` the state at a chunk's start, ``h' = h + Aᵀ U`` at its end, ``U = Ũ − W h`` and
``O = Q h + tril(Q Aᵀ) U``, and ``dh'`` the gradient reaching ``h'`` from later chunks:

    dU  = tril(Q Aᵀ)ᵀ dO + A dh'              dh = dh' + Qᵀ dO − Wᵀ dU        (sequential, right to left)
    dQ  = dO hᵀ + tril(dO Uᵀ) A               dA = U dh'ᵀ + tril(dO Uᵀ)ᵀ Q + dZᵀ K
    dW  = −dU hᵀ,  dŨ = dU                     dK = Tᵀ dW + dZ A,  dV = Tᵀ dŨ
    dZ  = strict_tril(−Tᵀ (dW Kᵀ + dŨ Vᵀ) Tᵀ)  (Z = strict_tril(K Aᵀ), T = (I + Z)⁻¹)

Three kernels: the reverse state pass (stores ``dU`` and ``dh'`` per chunk), then two per-chunk kernels, one for
the gradients through the reads (``dQ`` and part of ``dA``) and one through the WY form (``dK``, ``dV``, the
rest of ``dA``): split so that each fits shared memory at ``K = 128``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import (
    chunk_layout,
    chunk_program,
    launch_config,
    launch_dims,
    seq_program,
    seq_tiles,
)


@triton.jit
def delta_bwd_state_kernel(
    q, a, w, do, dht, dhs, du, dh0, cu_seqlens, offsets, T, NC, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_DHT: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``q, a [BH, T, K]``, ``w [BH, T, K]`` float32, ``do [BH, T, V]``, ``dht [NH, V, K]`` (gradient of the
    final state) -> ``dhs [BH, NC, K, V]`` (``dh'`` of each chunk), ``du [BH, T, V]``, ``dh0 [NH, V, K]``, all
    float32. Grid ``(value blocks, NH)`` (:func:`seq_program`)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    row0, L, c0, i_bh = seq_program(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
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
    for i_back in range(0, NCS):
        i_c = NCS - 1 - i_back
        p_dhs = (i_bh.to(tl.int64) * NC + c0 + i_c) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(dhs + p_dhs, b_dh, mask=m_kv)
        p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
        b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
        b_w = tl.load(w + p_k, mask=m_k, other=0.0)
        b_do = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
        # tril(Q Aᵀ)ᵀ = triu(A Qᵀ)
        b_aq = tl.where(rows <= cols, tl.dot(b_a, tl.trans(b_q), input_precision=PRECISION), 0.0)
        b_du = tl.dot(b_aq, b_do, input_precision=PRECISION) + tl.dot(b_a, b_dh, input_precision=PRECISION)
        tl.store(du + p_v, b_du, mask=m_v)
        b_dh += tl.dot(tl.trans(b_q), b_do, input_precision=PRECISION)
        b_dh -= tl.dot(tl.trans(b_w), b_du, input_precision=PRECISION)
    tl.store(dh0 + p_state, b_dh, mask=m_kv)


@triton.jit
def delta_bwd_read_kernel(
    q, a, hs, dhs, u_new, do, dq_part, da_part, cu_seqlens, offsets, T, NC, N,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """The gradients through the reads: ``dQ = dO hᵀ + tril(dO Uᵀ) A`` and the share
    ``U dh'ᵀ + tril(dO Uᵀ)ᵀ Q`` of ``dA``, per value block as float32 ``[NV, BH, T, K]`` (each a sum over the
    value dimension; with one value block ``dq_part`` is ``dQ`` itself, in its dtype). Grid
    ``(chunk slots, BH, NV)``."""
    i_p, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_hs = (i_bh.to(tl.int64) * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_u = tl.load(u_new + p_v, mask=m_v, other=0.0)
    b_do = tl.load(do + p_v, mask=m_v, other=0.0).to(tl.float32)
    b_h = tl.load(hs + p_hs, mask=m_kv, other=0.0)
    b_dh = tl.load(dhs + p_hs, mask=m_kv, other=0.0)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_dou = tl.where(rows >= cols, tl.dot(b_do, tl.trans(b_u), input_precision=PRECISION), 0.0)  # tril(dO Uᵀ)
    b_dq = tl.dot(b_do, tl.trans(b_h), input_precision=PRECISION) + tl.dot(b_dou, b_a, input_precision=PRECISION)
    b_da = tl.dot(b_u, tl.trans(b_dh), input_precision=PRECISION)
    b_da += tl.dot(tl.trans(b_dou), b_q, input_precision=PRECISION)
    p_part = i_v.to(tl.int64) * tl.num_programs(1) * T * K + p_k
    tl.store(dq_part + p_part, b_dq.to(dq_part.dtype.element_ty), mask=m_k)
    tl.store(da_part + p_part, b_da, mask=m_k)


@triton.jit
def delta_bwd_wy_kernel(
    k, a, v, tm, hs, du, dk_part, da_part, da_read, dv, cu_seqlens, offsets, T, NC, N,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr, ADD_READ: tl.constexpr,
):  # fmt: skip
    """The gradients through the WY representation: with ``dW = −dU hᵀ`` and ``T`` from the forward,
    ``dV = Tᵀ dU`` (its dtype) and, per value block as float32 shares, ``dK = Tᵀ dW + dZ A`` and the ``dZᵀ K``
    share of ``dA`` (``dZ`` is linear in ``dT = dW Kᵀ + dU Vᵀ``). Grid ``(chunk slots, BH, NV)``. ``ADD_READ``
    (one value block): ``dk_part`` and ``da_part`` are the gradients themselves, in their dtypes, and ``dA`` adds
    the read kernel's share from ``da_read`` (float32, written by the launch before)."""
    i_p, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row0, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :] & (o_k * 0 + L > 0)[:, None]
    p_hs = (i_bh.to(tl.int64) * NC + i_p) * K * V + o_k[:, None] * V + o_v[None, :]
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_a = tl.load(a + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
    b_du = tl.load(du + p_v, mask=m_v, other=0.0)
    b_h = tl.load(hs + p_hs, mask=m_kv, other=0.0)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_dw = -tl.dot(b_du, tl.trans(b_h), input_precision=PRECISION)
    p_t, m_t, _, _ = seq_tiles(row0, i_c, L, tl.arange(0, BT), tl.arange(0, BT), BT, BT, BT)
    b_t = tl.load(tm + p_t, mask=m_t, other=0.0)
    b_dk = tl.dot(tl.trans(b_t), b_dw, input_precision=PRECISION)
    b_dv = tl.dot(tl.trans(b_t), b_du, input_precision=PRECISION)
    b_dt = tl.dot(b_dw, tl.trans(b_k), input_precision=PRECISION)
    b_dt += tl.dot(b_du, tl.trans(b_v), input_precision=PRECISION)
    b_dz = -tl.dot(tl.dot(tl.trans(b_t), b_dt, input_precision=PRECISION), tl.trans(b_t), input_precision=PRECISION)
    b_dz = tl.where(rows > cols, b_dz, 0.0)
    b_dk += tl.dot(b_dz, b_a, input_precision=PRECISION)
    b_da = tl.dot(tl.trans(b_dz), b_k, input_precision=PRECISION)
    p_part = i_v.to(tl.int64) * tl.num_programs(1) * T * K + p_k
    if ADD_READ:
        b_da += tl.load(da_read + p_part, mask=m_k, other=0.0)
    tl.store(dk_part + p_part, b_dk.to(dk_part.dtype.element_ty), mask=m_k)
    tl.store(da_part + p_part, b_da.to(da_part.dtype.element_ty), mask=m_k)
    tl.store(dv + p_v, b_dv.to(dv.dtype.element_ty), mask=m_v)


def delta_bwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    dht: torch.Tensor | None,
    chunk_size: int,
    precision: str,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, da, dS_0)``: the first four in the dtypes of their inputs, ``dS_0 [N, H, V, K]`` float32;
    ``saved`` from :func:`delta_fwd_fn` with the same ``cu_seqlens`` (its ``offsets`` recomputed when absent),
    ``do [B, H, T, V]`` contiguous, ``dht`` the gradient of ``S_T`` or None."""
    B, H, T, K = k.shape
    V = v.shape[-1]
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, saved.get("offsets"))
    N = varlen["N"]
    BV_STATE, dims = launch_dims(K, V, chunk_size, precision)
    f32 = dict(dtype=torch.float32, device=k.device)
    dhs = torch.empty(B, H, NC, K, V, **f32)
    du = torch.empty(B, H, T, V, **f32)
    dh0 = torch.empty(N, H, V, K, **f32)
    seq = {n: varlen[n] for n in ("cu_seqlens", "offsets", "IS_VARLEN")}
    delta_bwd_state_kernel[(triton.cdiv(V, BV_STATE), N * H)](
        q, a, saved["w"], do, dht, dhs, du, dh0, T=T, NC=NC, H=H, BV=BV_STATE, USE_DHT=dht is not None, **seq, **dims
    )
    NV = triton.cdiv(V, BV_STATE)
    dv = torch.empty_like(v)
    grid = (NC, B * H, NV)
    hs, u_new = saved["hs"], saved["u_new"]
    wy = dims | launch_config(K, wide=True)
    if NV == 1:
        # One value block (V <= 64): the kernels write dq, dk and dA themselves, the WY kernel adding the read
        # kernel's share of dA; no sums over blocks, no casts.
        dq, dk, da = torch.empty_like(q), torch.empty_like(k), torch.empty_like(a)
        da_read = torch.empty(B, H, T, K, **f32)
        delta_bwd_read_kernel[grid](
            q, a, hs, dhs, u_new, do, dq, da_read, T=T, NC=NC, BV=BV_STATE, **varlen, **dims
        )  # fmt: skip
        delta_bwd_wy_kernel[grid](
            k, a, v, saved["tm"], hs, du, dk, da, da_read, dv, T=T, NC=NC, BV=BV_STATE, ADD_READ=True, **varlen, **wy
        )  # fmt: skip
        return dq, dk, dv, da, dh0
    # float32 shares per value block: dq, dk, and dA from the reads and from the WY form.
    parts = torch.empty(4, NV, B, H, T, K, **f32)
    delta_bwd_read_kernel[grid](
        q, a, hs, dhs, u_new, do, parts[0], parts[2], T=T, NC=NC, BV=BV_STATE, **varlen, **dims
    )  # fmt: skip
    delta_bwd_wy_kernel[grid](
        k, a, v, saved["tm"], hs, du, parts[1], parts[3], None, dv, T=T, NC=NC, BV=BV_STATE, ADD_READ=False, **varlen,
        **wy,
    )  # fmt: skip
    # One sum per gradient, so the three outputs are separate tensors (custom ops may not return aliases).
    dq, dk = (parts[i].sum(0).to(x.dtype) for i, x in enumerate((q, k)))
    da = (parts[2].sum(0) + parts[3].sum(0)).to(a.dtype)
    return dq, dk, dv, da, dh0
