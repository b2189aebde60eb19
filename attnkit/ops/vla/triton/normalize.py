"""VLA's normaliser in two chunk-parallel kernels: ``o_t = r_t / max(q_t·n_t, eps)`` with ``n_t = n_0 + Σ_{s≤t} k_s``
(``r = S q``, the delta rule's output), written straight into the ``[B, T, H, V]`` layout of the result.

Forward: one kernel sums ``k`` over each chunk; the chunks' starting ``n`` are a cumulative sum of those sums
(``[B, H, NC, K]``, 1/C of ``k``, in PyTorch); a second kernel forms ``n_t`` inside each chunk with ``tl.cumsum``
and divides. Backward, with ``m_t = max(den_t, eps)``:

    dr_t = do_t / m_t,    dden_t = −(do_t·r_t) / m_t²  where den_t > eps (else 0)
    dq_t = dden_t n_t,    dk_s = Σ_{t≥s} dden_t q_t + dn_T,    dn_0 = Σ_t dden_t q_t + dn_T

the same two-pass shape in reverse (chunk sums of ``dden·q``, their suffix sums in PyTorch, then the
within-chunk reverse cumulative sum). Tensors are contiguous ``[B, H, T, ·]`` except ``o`` / ``do``
(``[B, T, H, V]``); everything is float32 inside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import chunk_tiles
from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def token_major(i_c, i_bh, T, o_v, H, V: tl.constexpr, BT: tl.constexpr):
    """Offsets and mask of the ``[BT, BV]`` tile of chunk ``i_c`` of head ``i_bh`` in a ``[B, T, H, V]`` tensor."""
    o_t = i_c * BT + tl.arange(0, BT)
    i_b, i_h = i_bh // H, i_bh % H
    rows = (i_b.to(tl.int64) * T + o_t) * H + i_h
    return rows[:, None] * V + o_v[None, :], (o_t < T)[:, None] & (o_v < V)[None, :]


@triton.jit
def chunk_sums_kernel(x, y, sums, T, NC, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, HAS_Y: tl.constexpr):
    """``sums [BH, NC, K]``: per chunk, ``Σ_t x_t`` (or ``Σ_t y_t x_t`` with ``y [BH, T]``). Grid ``(NC, BH)``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    p_k, m_k, _, _ = chunk_tiles(i_c, i_bh, T, o_k, o_k, K, K, BT)
    b_x = tl.load(x + p_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_Y:
        o_t = i_c * BT + tl.arange(0, BT)
        b_x *= tl.load(y + i_bh.to(tl.int64) * T + o_t, mask=o_t < T, other=0.0)[:, None]
    tl.store(sums + (i_bh.to(tl.int64) * NC + i_c) * K + o_k, tl.sum(b_x, 0), mask=o_k < K)


@triton.jit
def normalize_fwd_kernel(
    r, q, k, starts, o, den, T, NC, H, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """``r [BH, T, V]``, ``q, k [BH, T, K]``, ``starts [BH, NC, K]`` (``n`` before each chunk) -> ``o [B, T, H, V]``
    (its dtype) and ``den [BH, T]`` float32. Grid ``(NC, BH)``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p_k, m_k, p_v, m_v = chunk_tiles(i_c, i_bh, T, o_k, o_v, K, V, BT)
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_n0 = tl.load(starts + (i_bh.to(tl.int64) * NC + i_c) * K + o_k, mask=o_k < K, other=0.0)
    b_den = tl.sum(b_q * (b_n0[None, :] + tl.cumsum(b_k, 0)), 1)
    o_t = i_c * BT + tl.arange(0, BT)
    tl.store(den + i_bh.to(tl.int64) * T + o_t, b_den, mask=o_t < T)
    b_r = tl.load(r + p_v, mask=m_v, other=0.0).to(tl.float32)
    p_o, m_o = token_major(i_c, i_bh, T, o_v, H, V, BT)
    tl.store(o + p_o, (b_r / tl.maximum(b_den, eps)[:, None]).to(o.dtype.element_ty), mask=m_o)


@triton.jit
def normalize_dden_kernel(
    r, do, den, dden, T, H, eps, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """``dden [BH, T]`` = ``−(do_t·r_t) / m_t²`` where ``den_t > eps``, else 0. Grid ``(NC, BH)``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_v = tl.arange(0, BV)
    _, _, p_v, m_v = chunk_tiles(i_c, i_bh, T, o_v, o_v, V, V, BT)
    p_o, m_o = token_major(i_c, i_bh, T, o_v, H, V, BT)
    o_t = i_c * BT + tl.arange(0, BT)
    b_den = tl.load(den + i_bh.to(tl.int64) * T + o_t, mask=o_t < T, other=1.0)
    b_m = tl.maximum(b_den, eps)
    b_r = tl.load(r + p_v, mask=m_v, other=0.0).to(tl.float32)
    b_do = tl.load(do + p_o, mask=m_o, other=0.0).to(tl.float32)
    b_dden = tl.where(b_den > eps, -tl.sum(b_do * b_r, 1) / (b_m * b_m), 0.0)
    tl.store(dden + i_bh.to(tl.int64) * T + o_t, b_dden, mask=o_t < T)


@triton.jit
def normalize_bwd_kernel(
    q, k, do, den, dden, starts, later, dq, dk, dr, T, NC, H, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """``dq [BH, T, K]`` (``q``'s dtype), ``dk [BH, T, K]`` float32 and ``dr [BH, T, V]`` (its dtype) from ``dden``,
    ``starts`` and ``later [BH, NC, K]`` (``Σ dden·q`` over the later chunks, plus ``dn_T``). Grid ``(NC, BH)``."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p_k, m_k, p_v, m_v = chunk_tiles(i_c, i_bh, T, o_k, o_v, K, V, BT)
    o_t = i_c * BT + tl.arange(0, BT)
    p_t = i_bh.to(tl.int64) * T + o_t
    p_c = (i_bh.to(tl.int64) * NC + i_c) * K + o_k
    b_k = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_q = tl.load(q + p_k, mask=m_k, other=0.0).to(tl.float32)
    b_dden = tl.load(dden + p_t, mask=o_t < T, other=0.0)
    b_n = tl.load(starts + p_c, mask=o_k < K, other=0.0)[None, :] + tl.cumsum(b_k, 0)
    tl.store(dq + p_k, (b_dden[:, None] * b_n).to(dq.dtype.element_ty), mask=m_k)
    b_dn = b_dden[:, None] * b_q
    # Σ_{t>=s} within the chunk = chunk total − Σ_{t<s}
    b_dk = tl.sum(b_dn, 0)[None, :] - tl.cumsum(b_dn, 0) + b_dn
    b_dk += tl.load(later + p_c, mask=o_k < K, other=0.0)[None, :]
    tl.store(dk + p_k, b_dk, mask=m_k)
    b_m = tl.maximum(tl.load(den + p_t, mask=o_t < T, other=1.0), eps)
    p_o, m_o = token_major(i_c, i_bh, T, o_v, H, V, BT)
    b_do = tl.load(do + p_o, mask=m_o, other=0.0).to(tl.float32)
    tl.store(dr + p_v, (b_do / b_m[:, None]).to(dr.dtype.element_ty), mask=m_v)


def _dims(q: torch.Tensor, r: torch.Tensor, chunk_size: int) -> dict[str, int]:
    """Tile sizes, and eight warps past ``K = V = 64`` (the backward kernel spills at 128 on four)."""
    K, V = q.shape[-1], r.shape[-1]
    return dict(K=K, V=V, BK=block_dim(K), BV=block_dim(V), BT=chunk_size, num_warps=8 if max(K, V) > 64 else 4)


def _chunk_sums(x: torch.Tensor, y: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    B, H, T, K = x.shape
    NC = triton.cdiv(T, chunk_size)
    sums = torch.empty(B, H, NC, K, dtype=torch.float32, device=x.device)
    chunk_sums_kernel[(NC, B * H)](x, y, sums, T, NC, K=K, BK=block_dim(K), BT=chunk_size, HAS_Y=y is not None)
    return sums


def normalize_fwd_fn(
    r: torch.Tensor, q: torch.Tensor, k: torch.Tensor, n0: torch.Tensor, eps: float, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``r [B, H, T, V]``, ``q, k [B, H, T, K]`` contiguous, ``n0 [B, H, K]`` float32 ->
    ``(o [B, T, H, V] in r.dtype, n_T [B, H, K], den [B, H, T], starts [B, H, NC, K])``."""
    B, H, T, _ = k.shape
    sums = _chunk_sums(k, None, chunk_size)
    through = sums.cumsum(2)
    starts = (n0.float().unsqueeze(2) + through - sums).contiguous()
    n_end = n0.float() + through[:, :, -1] if T else n0.float()
    o = torch.empty(B, T, H, r.shape[-1], dtype=r.dtype, device=r.device)
    den = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    NC = starts.shape[2]
    normalize_fwd_kernel[(NC, B * H)](r, q, k, starts, o, den, T, NC, H, eps, **_dims(q, r, chunk_size))
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dr, dq, dk, dn0)``: ``dr`` like ``r``, ``dq`` like ``q``, ``dk`` and ``dn0`` float32; ``do [B, T, H, V]``
    contiguous, ``dn_end [B, H, K]`` or None."""
    B, H, T, _ = k.shape
    NC = starts.shape[2]
    dims = _dims(q, r, chunk_size)
    dden = torch.empty(B, H, T, dtype=torch.float32, device=r.device)
    normalize_dden_kernel[(NC, B * H)](r, do, den, dden, T, H, eps, V=dims["V"], BV=dims["BV"], BT=chunk_size)
    sums = _chunk_sums(q, dden, chunk_size)
    total = sums.sum(2)
    if dn_end is not None:
        total = total + dn_end.float()
    later = (total.unsqueeze(2) - sums.cumsum(2)).contiguous()  # later chunks and dn_T
    dq, dr = torch.empty_like(q), torch.empty_like(r)
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    normalize_bwd_kernel[(NC, B * H)](q, k, do, den, dden, starts, later, dq, dk, dr, T, NC, H, eps, **dims)
    return dr, dq, dk, total
