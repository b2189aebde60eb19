"""VLA's normaliser in two chunk-parallel kernels: ``o_t = r_t / max(q_t·n_t, eps)`` with ``n_t = n_0 + Σ_{s≤t} k_s``
(``r = S q``, the delta rule's output), written straight into the ``[B, T, H, V]`` layout of the result.

Forward: one kernel walks each sequence's chunks and stores the running ``n`` at each chunk's start
(``[B, H, NC, K]``, 1/C of ``k``) and at its end; a second kernel forms ``n_t`` inside each chunk with ``tl.cumsum``
and divides. Backward, with ``m_t = max(den_t, eps)``:

    dr_t = do_t / m_t,    dden_t = −(do_t·r_t) / m_t²  where den_t > eps (else 0)
    dq_t = dden_t n_t,    dk_s = Σ_{t≥s} dden_t q_t + dn_T,    dn_0 = Σ_t dden_t q_t + dn_T

the same two-pass shape in reverse (the running sum of ``dden·q`` from each sequence's end, then the
within-chunk reverse cumulative sum). Packed sequences (``cu_seqlens``) run in the same launches. Tensors are
contiguous ``[B, H, T, ·]`` except ``o`` / ``do``
(``[B, T, H, V]``); everything is float32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import chunk_layout, chunk_program, seq_program, seq_tiles
from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def token_major(row0, i_c, length, i_bh, T, o_v, H, V: tl.constexpr, BT: tl.constexpr):
    """Offsets and mask of the ``[BT, BV]`` tile of chunk ``i_c`` of the sequence whose first row is ``row0`` (in
    ``[BH, T]`` rows, head ``i_bh``) in a ``[B, T, H, V]`` tensor."""
    o_t = i_c * BT + tl.arange(0, BT)
    i_b, i_h = i_bh // H, i_bh % H
    tok = i_b.to(tl.int64) * T + (row0 - i_bh.to(tl.int64) * T) + o_t  # the sequence's first token + position
    rows = tok * H + i_h
    return rows[:, None] * V + o_v[None, :], (o_t < length)[:, None] & (o_v < V)[None, :]


@triton.jit
def normalize_prefix_kernel(
    x, y, n0, starts, n_end, cu_seqlens, offsets, T, NC, H,
    K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, HAS_Y: tl.constexpr, REVERSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """Per sequence and head, the running sum of ``x_t`` (or ``y_t x_t``, ``y [BH, T]``) over its chunks, from
    ``n0 [NH, K]`` (zero when None): ``starts [BH, NC, K]`` holds the sum before each chunk (after it, from the
    end, with ``REVERSE``) and ``n_end [NH, K]`` the total, float32. Grid ``(NH,)``."""
    i_nh = tl.program_id(0)
    row0, L, c0, i_bh = seq_program(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    p_n = i_nh.to(tl.int64) * K + o_k
    if n0 is None:
        b_n = tl.zeros([BK], dtype=tl.float32)
    else:
        b_n = tl.load(n0 + p_n, mask=o_k < K, other=0.0).to(tl.float32)
    NCS = tl.cdiv(L, BT)
    for i_step in range(0, NCS):
        i_c = NCS - 1 - i_step if REVERSE else i_step
        tl.store(starts + (i_bh.to(tl.int64) * NC + c0 + i_c) * K + o_k, b_n, mask=o_k < K)
        p_k, m_k, _, _ = seq_tiles(row0, i_c, L, o_k, o_k, K, K, BT)
        b_x = tl.load(x + p_k, mask=m_k, other=0.0).to(tl.float32)
        if HAS_Y:
            o_t = i_c * BT + tl.arange(0, BT)
            b_x *= tl.load(y + row0 + o_t, mask=o_t < L, other=0.0)[:, None]
        b_n += tl.sum(b_x, 0)
    tl.store(n_end + p_n, b_n, mask=o_k < K)


@triton.jit
def normalize_fwd_kernel(
    r, q, k, starts, o, den, cu_seqlens, offsets, T, NC, H, N, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``r [BH, T, V]``, ``q, k [BH, T, K]``, ``starts [BH, NC, K]`` (``n`` before each chunk) -> ``o [B, T, H, V]``
    (its dtype) and ``den [BH, T]`` float32. Grid ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    row0, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_n0 = tl.load(starts + (i_bh.to(tl.int64) * NC + i_p) * K + o_k, mask=(o_k < K) & (o_k * 0 + L > 0), other=0.0)
    b_den = tl.sum(b_q * (b_n0[None, :] + tl.cumsum(b_k, 0)), 1)
    o_t = i_c * BT + tl.arange(0, BT)
    tl.store(den + row0 + o_t, b_den, mask=o_t < L)
    b_r = tl.load(r + p_v, mask=m_v, other=0.0).to(tl.float32)
    p_o, m_o = token_major(row0, i_c, L, i_bh, T, o_v, H, V, BT)
    tl.store(o + p_o, (b_r / tl.maximum(b_den, eps)[:, None]).to(o.dtype.element_ty), mask=m_o)


@triton.jit
def normalize_dden_kernel(
    r, do, den, dden, cu_seqlens, offsets, T, H, N, eps,
    V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``dden [BH, T]`` = ``−(do_t·r_t) / m_t²`` where ``den_t > eps``, else 0. Grid ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    row0, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN, LOG_N)
    o_v = tl.arange(0, BV)
    _, _, p_v, m_v = seq_tiles(row0, i_c, L, o_v, o_v, V, V, BT)
    p_o, m_o = token_major(row0, i_c, L, i_bh, T, o_v, H, V, BT)
    o_t = i_c * BT + tl.arange(0, BT)
    b_den = tl.load(den + row0 + o_t, mask=o_t < L, other=1.0)
    b_m = tl.maximum(b_den, eps)
    b_r = tl.load(r + p_v, mask=m_v, other=0.0).to(tl.float32)
    b_do = tl.load(do + p_o, mask=m_o, other=0.0).to(tl.float32)
    b_dden = tl.where(b_den > eps, -tl.sum(b_do * b_r, 1) / (b_m * b_m), 0.0)
    tl.store(dden + row0 + o_t, b_dden, mask=o_t < L)


@triton.jit
def normalize_bwd_kernel(
    q, k, do, den, dden, starts, later, dq, dk, dr, cu_seqlens, offsets, T, NC, H, N, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, LOG_N: tl.constexpr,
):  # fmt: skip
    """``dq [BH, T, K]`` (``q``'s dtype), ``dk [BH, T, K]`` float32 and ``dr [BH, T, V]`` (its dtype) from ``dden``,
    ``starts`` and ``later [BH, NC, K]`` (``Σ dden·q`` over the later chunks, plus ``dn_T``). Grid
    ``(chunk slots, BH)``."""
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    row0, L, i_c = chunk_program(cu_seqlens, offsets, i_p, i_bh, T, N, IS_VARLEN, LOG_N)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p_k, m_k, p_v, m_v = seq_tiles(row0, i_c, L, o_k, o_v, K, V, BT)
    o_t = i_c * BT + tl.arange(0, BT)
    p_t = row0 + o_t
    p_c = (i_bh.to(tl.int64) * NC + i_p) * K + o_k
    m_c = (o_k < K) & (o_k * 0 + L > 0)
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_dden = tl.load(dden + p_t, mask=o_t < L, other=0.0)
    b_n = tl.load(starts + p_c, mask=m_c, other=0.0)[None, :] + tl.cumsum(b_k, 0)
    tl.store(dq + p_k, (b_dden[:, None] * b_n).to(dq.dtype.element_ty), mask=m_k)
    b_dn = b_dden[:, None] * b_q
    # Σ_{t>=s} within the chunk = chunk total − Σ_{t<s}
    b_dk = tl.sum(b_dn, 0)[None, :] - tl.cumsum(b_dn, 0) + b_dn
    b_dk += tl.load(later + p_c, mask=m_c, other=0.0)[None, :]
    tl.store(dk + p_k, b_dk, mask=m_k)
    b_m = tl.maximum(tl.load(den + p_t, mask=o_t < L, other=1.0), eps)
    p_o, m_o = token_major(row0, i_c, L, i_bh, T, o_v, H, V, BT)
    b_do = tl.load(do + p_o, mask=m_o, other=0.0).to(tl.float32)
    tl.store(dr + p_v, (b_do / b_m[:, None]).to(dr.dtype.element_ty), mask=m_v)


def _dims(q: torch.Tensor, r: torch.Tensor, chunk_size: int) -> dict[str, int]:
    """Tile sizes, and eight warps past ``K = V = 64`` (the backward kernel spills at 128 on four)."""
    K, V = q.shape[-1], r.shape[-1]
    return dict(K=K, V=V, BK=block_dim(K), BV=block_dim(V), BT=chunk_size, num_warps=8 if max(K, V) > 64 else 4)


def _prefix(x, y, n0, chunk_size, cu_seqlens, offsets, reverse):
    """``(starts [B, H, NC, K], total [N, H, K])`` of :func:`normalize_prefix_kernel`."""
    B, H, T, K = x.shape
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, chunk_size, offsets)
    N = varlen["N"]
    starts = torch.empty(B, H, NC, K, dtype=torch.float32, device=x.device)
    total = torch.empty(N, H, K, dtype=torch.float32, device=x.device)
    normalize_prefix_kernel[(N * H,)](
        x, y, n0, starts, total, cu_seqlens, varlen["offsets"], T, NC, H, K=K, BK=block_dim(K), BT=chunk_size,
        HAS_Y=y is not None, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
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
    """``r [B, H, T, V]``, ``q, k [B, H, T, K]`` contiguous, ``n0 [N, H, K]`` ->
    ``(o [B, T, H, V] in r.dtype, n_T [N, H, K], den [B, H, T], starts [B, H, NC, K])``, float32 but ``o``;
    ``cu_seqlens``: packed sequences (``B == 1``), each with its own ``n``."""
    B, H, T, _ = k.shape
    offsets, _, _ = chunk_layout(cu_seqlens, B, T, chunk_size)
    starts, n_end, varlen = _prefix(k, None, n0.contiguous(), chunk_size, cu_seqlens, offsets, False)
    o = torch.empty(B, T, H, r.shape[-1], dtype=r.dtype, device=r.device)
    den = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    NC = starts.shape[2]
    normalize_fwd_kernel[(NC, B * H)](
        r, q, k, starts, o, den, T=T, NC=NC, H=H, eps=eps, **varlen, **_dims(q, r, chunk_size)
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
    """``(dr, dq, dk, dn0)``: ``dr`` like ``r``, ``dq`` like ``q``, ``dk`` and ``dn0`` float32; ``do [B, T, H, V]``
    contiguous, ``dn_end [N, H, K]`` or None; ``cu_seqlens`` as the forward's."""
    B, H, T, _ = k.shape
    NC = starts.shape[2]
    offsets, _, varlen = chunk_layout(cu_seqlens, B, T, chunk_size)
    dims = _dims(q, r, chunk_size)
    dden = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    normalize_dden_kernel[(NC, B * H)](
        r, do, den, dden, T=T, H=H, eps=eps, V=dims["V"], BV=dims["BV"], BT=chunk_size, **varlen
    )  # fmt: skip
    dn_end = None if dn_end is None else dn_end.contiguous()
    later, total, _ = _prefix(q, dden, dn_end, chunk_size, cu_seqlens, offsets, True)  # later chunks and dn_T
    dq, dr = torch.empty_like(q), torch.empty_like(r)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    normalize_bwd_kernel[(NC, B * H)](
        q, k, do, den, dden, starts, later, dq, dk, dr, T=T, NC=NC, H=H, eps=eps, **varlen, **dims
    )  # fmt: skip
    return dr, dq, dk, total
