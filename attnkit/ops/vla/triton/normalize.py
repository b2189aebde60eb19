"""VLA's normaliser in two chunk-parallel kernels: ``o_t = r_t / max(q_t·n_t, eps)`` with ``n_t = n_0 + Σ_{s≤t} k_s``
(``r = S q``, the delta rule's output), written straight into the ``[B, T, H, V]`` layout of the result.

Forward: one kernel walks each sequence's chunks and stores the running ``n`` at each chunk's start
(``[B, H, NC, K]``, 1/C of ``k``) and at its end; a second kernel forms ``n_t`` inside each chunk with ``tl.cumsum``
and divides. Backward, with ``m_t = max(den_t, eps)``:

    dr_t = do_t / m_t,    dden_t = −(do_t·r_t) / m_t²  where den_t > eps (else 0)
    dq_t = dden_t n_t,    dk_s = Σ_{t≥s} dden_t q_t + dn_T,    dn_0 = Σ_t dden_t q_t + dn_T

the same two-pass shape in reverse (the running sum of ``dden·q`` from each sequence's end, then the
within-chunk reverse cumulative sum). Packed sequences (``cu_seqlens``) run in the same launches. ``q``, ``k`` and
``do`` are the caller's ``[B, T, H, ·]``, read through their strides in their dtypes; ``r``, ``o`` and the gradients
are contiguous ``[B, T, H, ·]`` in their dtypes, and what the kernels keep for each other (``den``, ``dden``, the
chunks' sums) is ``[B·H, ·]`` float32; everything is float32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import (
    chunk_layout,
    chunk_site,
    dense_rows,
    row_tile,
    seq_site,
    strides,
)
from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def normalize_prefix_kernel(
    x, y, n0, starts, n_end, cu_seqlens, offsets, T, NC, sxb, sxt, sxh, sxd,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, HAS_Y: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Per sequence and head, the running sum of ``x_t`` (``[B, T, H, K]``, strided), or of ``y_t x_t``
    (``y [BH, T]``), over its chunks, from ``n0 [NH, K]`` (zero when None): ``starts [BH, NC, K]`` holds the sum
    before each chunk (after it, from the end, with ``REVERSE``) and ``n_end [NH, K]`` the total, float32. Grid
    ``(NH,)``."""
    i_nh = tl.program_id(0)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    i_bh = i_b * H + i_h
    o_k = tl.arange(0, BK)
    p_n = i_nh.to(tl.int64) * K + o_k
    if n0 is None:
        b_n = tl.zeros([BK], dtype=tl.float32)
    else:
        b_n = tl.load(n0 + p_n, mask=o_k < K, other=0.0).to(tl.float32)
    NCS = tl.cdiv(L, BT)
    for i_step in range(0, NCS):
        i_c = NCS - 1 - i_step if REVERSE else i_step
        tl.store(starts + (i_bh * NC + c0 + i_c) * K + o_k, b_n, mask=o_k < K)
        b_x, o_t, m_t = row_tile(x, i_b, i_h, bos, i_c, L, sxb, sxt, sxh, sxd, o_k, K, BT)
        b_x = b_x.to(tl.float32)
        if HAS_Y:
            b_x *= tl.load(y + i_bh * T + bos + o_t, mask=m_t, other=0.0)[:, None]
        b_n += tl.sum(b_x, 0)
    tl.store(n_end + p_n, b_n, mask=o_k < K)


@triton.jit
def normalize_fwd_kernel(
    r, q, k, starts, o, den, cu_seqlens, offsets, T, NC, N, eps, sqb, sqt, sqh, sqd, skb, skt, skh, skd,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``r [B, T, H, V]``, ``q, k [B, T, H, K]`` (strided), ``starts [BH, NC, K]`` (``n`` before each chunk) ->
    ``o [B, T, H, V]`` (its dtype) and ``den [BH, T]`` float32. Grid ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    b_k, o_t, m_t = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
    b_q = row_tile(q, i_b, i_h, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)[0].to(tl.float32)
    b_n0 = tl.load(starts + (i_bh.to(tl.int64) * NC + i_p) * K + o_k, mask=(o_k < K) & (o_k * 0 + L > 0), other=0.0)
    b_den = tl.sum(b_q * (b_n0[None, :] + tl.cumsum(b_k.to(tl.float32), 0)), 1)
    tl.store(den + i_bh.to(tl.int64) * T + bos + o_t, b_den, mask=m_t)
    p_o, m_o = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_v, V, BT)
    b_r = tl.load(r + p_o, mask=m_o, other=0.0).to(tl.float32)
    tl.store(o + p_o, (b_r / tl.maximum(b_den, eps)[:, None]).to(o.dtype.element_ty), mask=m_o)


@triton.jit
def normalize_dden_kernel(
    r, do, den, dden, cu_seqlens, offsets, T, N, eps, sdob, sdot, sdoh, sdod,
    H: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr,
):  # fmt: skip
    """``dden [BH, T]`` = ``−(do_t·r_t) / m_t²`` where ``den_t > eps``, else 0; ``do [B, T, H, V]`` strided.
    Grid ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    o_v = tl.arange(0, BV)
    p_r, m_r = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_v, V, BT)
    b_do, o_t, m_t = row_tile(do, i_b, i_h, bos, i_c, L, sdob, sdot, sdoh, sdod, o_v, V, BT)
    p_t = i_bh.to(tl.int64) * T + bos + o_t
    b_den = tl.load(den + p_t, mask=m_t, other=1.0)
    b_m = tl.maximum(b_den, eps)
    b_r = tl.load(r + p_r, mask=m_r, other=0.0).to(tl.float32)
    b_dden = tl.where(b_den > eps, -tl.sum(b_do.to(tl.float32) * b_r, 1) / (b_m * b_m), 0.0)
    tl.store(dden + p_t, b_dden, mask=m_t)


@triton.jit
def normalize_bwd_kernel(
    q, k, do, den, dden, starts, later, dq, dk, dr, cu_seqlens, offsets, T, NC, N, eps,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, sdob, sdot, sdoh, sdod,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``dq``, ``dk [B, T, H, K]`` and ``dr [B, T, H, V]`` (contiguous, their dtypes) from ``dden``, ``starts`` and
    ``later [BH, NC, K]`` (``Σ dden·q`` over the later chunks, plus ``dn_T``). Grid ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, i_bh, T, N, H, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    b_k, o_t, m_t = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
    b_q = row_tile(q, i_b, i_h, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)[0].to(tl.float32)
    p_t = i_bh.to(tl.int64) * T + bos + o_t
    p_c = (i_bh.to(tl.int64) * NC + i_p) * K + o_k
    m_c = (o_k < K) & (o_k * 0 + L > 0)
    b_dden = tl.load(dden + p_t, mask=m_t, other=0.0)
    b_n = tl.load(starts + p_c, mask=m_c, other=0.0)[None, :] + tl.cumsum(b_k.to(tl.float32), 0)
    p_k, m_k = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_k, K, BT)
    tl.store(dq + p_k, (b_dden[:, None] * b_n).to(dq.dtype.element_ty), mask=m_k)
    b_dn = b_dden[:, None] * b_q
    # Σ_{t>=s} within the chunk = chunk total − Σ_{t<s}
    b_dk = tl.sum(b_dn, 0)[None, :] - tl.cumsum(b_dn, 0) + b_dn
    b_dk += tl.load(later + p_c, mask=m_c, other=0.0)[None, :]
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_k)
    b_m = tl.maximum(tl.load(den + p_t, mask=m_t, other=1.0), eps)
    b_do = row_tile(do, i_b, i_h, bos, i_c, L, sdob, sdot, sdoh, sdod, o_v, V, BT)[0].to(tl.float32)
    p_r, m_r = dense_rows(i_b, i_h, bos, i_c, L, T, H, o_v, V, BT)
    tl.store(dr + p_r, (b_do / b_m[:, None]).to(dr.dtype.element_ty), mask=m_r)


def _dims(q: torch.Tensor, r: torch.Tensor, chunk_size: int) -> dict[str, int]:
    """Tile sizes, and eight warps past ``K = V = 64`` (the backward kernel spills at 128 on four)."""
    K, V = q.shape[-1], r.shape[-1]
    return dict(K=K, V=V, BK=block_dim(K), BV=block_dim(V), BT=chunk_size, num_warps=8 if max(K, V) > 64 else 4)


def _prefix(x, y, n0, chunk_size, cu_seqlens, offsets, reverse):
    """``(starts [B, H, NC, K], total [N, H, K])`` of :func:`normalize_prefix_kernel`."""
    B, T, H, K = x.shape
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, offsets)
    N = varlen["N"]
    starts = torch.empty(B, H, NC, K, dtype=torch.float32, device=x.device)
    total = torch.empty(N, H, K, dtype=torch.float32, device=x.device)
    normalize_prefix_kernel[(N * H,)](
        x, y, n0, starts, total, cu_seqlens, varlen["offsets"], T, NC, *x.stride(), H=H, K=K, BK=block_dim(K),
        BT=chunk_size, HAS_Y=y is not None, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
    )  # fmt: skip
    return starts, total, varlen


def normalize_fwd_fn(
    r: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    n0: torch.Tensor,
    eps: float,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``r [B, T, H, V]`` contiguous, ``q, k [B, T, H, K]`` (any strides), ``n0 [N, H, K]`` ->
    ``(o [B, T, H, V] in r.dtype, n_T [N, H, K], den [B, H, T], starts [B, H, NC, K])``, float32 but ``o``;
    ``cu_seqlens``: packed sequences (``B == 1``), each with its own ``n``."""
    B, T, H, _ = k.shape
    offsets, _, _ = chunk_layout(cu_seqlens, B, T, chunk_size)
    starts, n_end, varlen = _prefix(k, None, n0.contiguous(), chunk_size, cu_seqlens, offsets, False)
    o = torch.empty(r.shape, dtype=r.dtype, device=r.device)
    den = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    NC = starts.shape[2]
    normalize_fwd_kernel[(NC, B * H)](
        r, q, k, starts, o, den, T=T, NC=NC, eps=eps, H=H, **strides(q=q, k=k), **varlen, **_dims(q, r, chunk_size)
    )  # fmt: skip
    return o, n_end, den, starts


def normalize_bwd_fn(
    r: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    den: torch.Tensor,
    starts: torch.Tensor,
    do: torch.Tensor,
    dn_end: torch.Tensor | None,
    eps: float,
    chunk_size: int,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dr, dq, dk, dn0)``: ``dr``, ``dq``, ``dk`` ``[B, T, H, ·]`` contiguous in the dtypes of ``r``, ``q``,
    ``k``, ``dn0`` float32; ``do [B, T, H, V]`` (any strides), ``dn_end [N, H, K]`` or None; ``cu_seqlens`` as the
    forward's."""
    B, T, H, _ = k.shape
    NC = starts.shape[2]
    offsets, _, varlen = chunk_layout(cu_seqlens, B, T, chunk_size)
    dims = _dims(q, r, chunk_size)
    dden = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    normalize_dden_kernel[(NC, B * H)](
        r, do, den, dden, T=T, eps=eps, H=H, V=dims["V"], BV=dims["BV"], BT=chunk_size, **strides(do=do), **varlen
    )  # fmt: skip
    dn_end = None if dn_end is None else dn_end.contiguous()
    later, total, _ = _prefix(q, dden, dn_end, chunk_size, cu_seqlens, offsets, True)  # later chunks and dn_T
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dr = torch.empty(r.shape, dtype=r.dtype, device=r.device)
    normalize_bwd_kernel[(NC, B * H)](
        q, k, do, den, dden, starts, later, dq, dk, dr, T=T, NC=NC, eps=eps, H=H, **strides(q=q, k=k, do=do),
        **varlen, **dims,
    )  # fmt: skip
    return dr, dq, dk, total
