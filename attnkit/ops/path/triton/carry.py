"""PaTH decoding prefill: every key carried to the end of its sequence, ``H_T ··· H_{j+1} k_j``, in one reverse
pass over chunks (linear in ``T``).

With ``K̃`` the keys carried to their chunk's end and ``M`` the chunk's UT matrix (``prepare.py``), chunk ``c``'s
output is ``K̃_c Σ`` where ``Σ = P_{c+1} ··· P_N`` is the suffix product of the later chunks' transitions
``P = I − Wᵀ Mᵀ W``; the pass then updates ``Σ ← Σ − W_cᵀ (M_cᵀ (W_c Σ))``. The columns of ``Σ`` evolve
independently, so programs split them (``[K, 64]`` blocks stay in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds, seq_layout
from attnkit.ops.common.triton_utils import block_dim
from attnkit.ops.path.triton.forward import chunk_size, launch_config
from attnkit.ops.path.triton.prepare import chunk_offsets_of, first_chunk, path_prepare_kernel, precisions


@triton.jit
def path_carry_kernel(
    w, kt, m, out, cu_seqlens, chunk_offsets, T, NC,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``w, kt [*, H, K]``, ``m [chunks, H, BT, BT]`` float32 -> ``out [*, H, K]`` (columns ``[i_k·BC, (i_k+1)·BC)``).
    Grid ``(column blocks, N * H)``."""
    i_kc, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    chunk0 = first_chunk(chunk_offsets, i_n, NC, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_c = i_kc * BC + tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BT)[None, :]
    b_sigma = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)  # [BK, BC] columns of the identity
    n_chunks = tl.cdiv(L, BT)
    for i_back in range(0, n_chunks):
        i_c = n_chunks - 1 - i_back
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


def path_carry_fn(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor | None
) -> torch.Tensor:
    """``k, w [B, T, H, K]``, ``beta [B, T, H]`` contiguous -> the keys carried to the end of their sequences,
    ``[B, T, H, K]`` in ``k.dtype``."""
    B, T, H, K = k.shape
    BT = chunk_size(K)
    BK = block_dim(K)
    BC = min(BK, 64)
    N, longest = seq_layout(cu_seqlens, B, T)
    offsets, chunks = chunk_offsets_of(cu_seqlens, BT)
    NC = triton.cdiv(T, BT)
    if cu_seqlens is None:
        chunks = B * NC
    out = torch.empty_like(k)
    if longest == 0:
        return out
    carry = precisions(k.dtype)[1]
    launch = launch_config()
    m = torch.empty(chunks, H, BT, BT, dtype=torch.float32, device=k.device)
    kt = torch.empty_like(k)
    is_varlen = cu_seqlens is not None
    path_prepare_kernel[(triton.cdiv(longest, BT), N * H)](
        k, w, beta, m, kt, None, cu_seqlens, offsets, T, NC, H=H, K=K, BK=BK, BT=BT, IS_VARLEN=is_varlen,
        PRECISION=carry, WRITE_MW=False, **launch,
    )  # fmt: skip
    path_carry_kernel[(triton.cdiv(K, BC), N * H)](
        w, kt, m, out, cu_seqlens, offsets, T, NC, H=H, K=K, BK=BK, BC=BC, BT=BT, IS_VARLEN=is_varlen,
        PRECISION=carry, **launch,
    )  # fmt: skip
    return out
