"""PaTH keys carried to the end of their span: to the end of the sequence (the decoding prefill) or of their
superblock (the forward's and backward's scan between superblocks), in one reverse pass over chunks.

With ``K̃`` the keys carried to their chunk's end and ``M`` the chunk's UT matrix (``prepare.py``), chunk ``c``'s
output is ``K̃_c Σ`` where ``Σ = P_{c+1} ··· P_last`` is the suffix product of the span's later transitions
``P = I − Wᵀ Mᵀ W``; the pass then updates ``Σ ← Σ − W_cᵀ (M_cᵀ (W_c Σ))``. At the span's start ``Σ`` is the
product of all the span's transitions, which the scan between superblocks uses as one dense carry. The columns of
``Σ`` evolve independently, so programs split them (``[K, 64]`` blocks stay in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds, seq_layout
from attnkit.ops.common.triton_utils import block_dim
from attnkit.ops.path.triton.prepare import (
    chunk_offsets,
    chunk_offsets_of,
    chunk_size,
    first_chunk,
    launch_config,
    path_prepare_kernel,
    precisions,
    solve_batched,
    solve_rows,
)


@triton.jit
def path_carry_kernel(
    w, kt, m, out, sig, cu_seqlens, chunk_offsets, sb_offsets, T, NC, NSB, SPAN,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, WRITE_SIG: tl.constexpr,
):  # fmt: skip
    """``w, kt [*, H, K]``, ``m [chunks, H, BT, BT]`` float32 -> ``out [*, H, K]`` (columns
    ``[i_kc·BC, (i_kc+1)·BC)``), the keys carried to the end of their span of ``SPAN`` chunks, and with
    ``WRITE_SIG`` each span's product ``sig [spans, H, BK, BK]`` float32 (span ``s`` of sequence ``n`` at row
    ``sb_offsets[n] + s``, or ``n * NSB + s`` for a dense batch). Grid ``(spans of the longest sequence, column
    blocks, N * H)``."""
    i_s, i_kc, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n_chunks = tl.cdiv(L, BT)
    c_lo = i_s * SPAN
    if c_lo >= n_chunks:
        return
    c_hi = tl.minimum(c_lo + SPAN, n_chunks)
    chunk0 = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_c = i_kc * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_sigma = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)  # [BK, BC] columns of the identity
    for i_back in range(0, c_hi - c_lo):
        i_c = c_hi - 1 - i_back
        o_i = i_c * BT + o_t
        m_i = o_i < L
        p_i = bos + o_i.to(tl.int64)
        p_kv = p_i[:, None] * (H * K) + i_h * K
        m_ik = m_i[:, None] & (o_k < K)[None, :]
        b_kt = tl.load(kt + p_kv + o_k[None, :], mask=m_ik, other=0.0).to(tl.float32)
        b_w = tl.load(w + p_kv + o_k[None, :], mask=m_ik, other=0.0).to(tl.float32)
        b_m = tl.load(m + ((chunk0 + i_c) * H + i_h) * (BT * BT) + rows * BT + cols)
        b_out = tl.dot(b_kt, b_sigma, input_precision=PRECISION)
        tl.store(out + p_kv + o_c[None, :], b_out.to(out.dtype.element_ty), mask=m_i[:, None] & (o_c < K)[None, :])
        b_ws = tl.dot(b_w, b_sigma, input_precision=PRECISION)  # [BT, BC]
        b_mws = tl.dot(tl.trans(b_m), b_ws, input_precision=PRECISION)
        b_sigma = b_sigma - tl.dot(tl.trans(b_w), b_mws, input_precision=PRECISION)
    if WRITE_SIG:
        row = first_chunk(sb_offsets, i_n, NSB, IS_VARLEN) + i_s
        tl.store(sig + (row * H + i_h) * (BK * BK) + o_k[:, None] * BK + o_c[None, :], b_sigma)


def carry_keys_fn(
    w: torch.Tensor,
    kt: torch.Tensor,
    m: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    span: int,
    out_dtype: torch.dtype,
    write_sig: bool,
    precision: str,
    launch: dict[str, int],
    longest: int | None = None,
    offsets: torch.Tensor | None = None,
    sb_offsets: torch.Tensor | None = None,
    returned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The prepare kernel's ``K̃`` (``kt [B,T,H,K]``) and ``M`` carried to the end of spans of ``span`` chunks:
    ``(keys [B,T,H,K] in out_dtype, sig [spans,H,BK,BK] float32 or None, span offsets [N+1] int32 or None)``
    (``sig``: each span's product of transitions; the offsets index its rows per packed sequence). ``precision``:
    the carries' ``input_precision``; ``launch``: warps and stages. ``longest``: a bound on the sequences' lengths
    (``T`` will do), which spares the host syncs of measuring them; ``sig`` then has rows for every span the bound
    allows. ``offsets``, ``sb_offsets``: ``chunk_offsets`` of ``cu_seqlens`` by chunks and by spans, where the caller
    has them. ``returned``: ``sig`` leaves the op (the forward keeps it for the backward), so the rows the packed
    sequences leave unused are zeros rather than uninitialised."""
    B, T, H, K = kt.shape
    BT = m.shape[-1]
    BK = block_dim(K)
    BC = min(BK, 64)
    NC, NSB = triton.cdiv(T, BT), triton.cdiv(T, BT * span)
    if offsets is None:
        offsets = chunk_offsets(cu_seqlens, BT)
    if longest is None:
        N, longest = seq_layout(cu_seqlens, B, T)
        sb_offsets, spans = chunk_offsets_of(cu_seqlens, BT * span)
    else:
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        sb_offsets = chunk_offsets(cu_seqlens, BT * span) if sb_offsets is None else sb_offsets
        spans = NSB + N
    if cu_seqlens is None:
        spans = B * NSB
    out = torch.empty(kt.shape, dtype=out_dtype, device=kt.device)
    alloc = torch.zeros if returned and cu_seqlens is not None else torch.empty
    sig = alloc(spans, H, BK, BK, dtype=torch.float32, device=kt.device) if write_sig else None
    if longest == 0:
        return out, sig, sb_offsets
    path_carry_kernel[(triton.cdiv(longest, BT * span), triton.cdiv(K, BC), N * H)](
        w, kt, m, out, sig, cu_seqlens, offsets, sb_offsets, T, NC, NSB, span, H=H, K=K, BK=BK, BC=BC, BT=BT,
        IS_VARLEN=cu_seqlens is not None, PRECISION=precision, WRITE_SIG=write_sig, **launch,
    )  # fmt: skip
    return out, sig, sb_offsets


def path_carry_fn(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """``k, w [B, T, H, K]``, ``beta [B, T, H]`` contiguous -> the keys carried to the end of their sequences,
    ``[B, T, H, K]`` in ``k.dtype``."""
    B, T, H, K = k.shape
    BT = chunk_size(K)
    N, longest = seq_layout(cu_seqlens, B, T)
    if longest == 0:
        return torch.empty_like(k)
    offsets, chunks = chunk_offsets_of(cu_seqlens, BT)
    NC = triton.cdiv(T, BT)
    if cu_seqlens is None:
        chunks = B * NC
    m = torch.empty(chunks, H, BT, BT, dtype=torch.float32, device=k.device)
    kt = torch.empty_like(k)
    carry = precisions(k.dtype, K)[1]
    path_prepare_kernel[(triton.cdiv(longest, BT), N * H)](
        k, w, beta, m, kt, None, cu_seqlens, offsets, T, NC, H=H, K=K, BK=block_dim(K), BT=BT,
        IS_VARLEN=cu_seqlens is not None, PRECISION=carry, WRITE_MW=False, SB=solve_rows(BT), BATCHED=solve_batched(),
        **launch_config(),
    )  # fmt: skip
    return carry_keys_fn(w, kt, m, cu_seqlens, triton.cdiv(longest, BT), k.dtype, False, carry, launch_config())[0]
