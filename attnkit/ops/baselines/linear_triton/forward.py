"""Linear attention forward: the state pass (sequential over chunks) and the output (parallel over chunks).

With ``h = Sᵀ`` (``[K, V]``) and ``n`` the state and normaliser at a chunk's start, a chunk of ``BT`` tokens gives
``U = Q h + tril(Q Kᵀ) V``, ``z = Q n + rowsum(tril(Q Kᵀ))`` and ``O = U / max(z, eps)`` (``U`` without
``normalize``); the chunk moves the state to ``h + Kᵀ V``, ``n + Σ k``. Derivation: ``README.md`` beside this file.
Inputs ``[B, T, H, D]`` are read through their strides; packed sequences (``cu_seqlens``, ``B == 1``) run in the
same launches, each chunk within one sequence, its slot found on the device (``delta_fwd.chunk_layout``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.delta_fwd import chunk_layout, chunk_site, row_tile, seq_site
from attnkit.ops.common.triton_utils import block_dim, float32_dots, interpreting


@triton.jit
def state_offsets(i_slot, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Offsets and mask of the ``[K, V]`` tile of chunk slot ``i_slot`` (int64) in ``[·, NC, K, V]`` states, and of
    its ``[K]`` normaliser in ``[·, NC, K]``."""
    p_h = i_slot * K * V + o_k[:, None] * V + o_v[None, :]
    return p_h, (o_k < K)[:, None] & (o_v < V)[None, :], i_slot * K + o_k


@triton.jit
def linear_fwd_state_kernel(
    k, v, s0, n0, hs, ns, st, nt, cu_seqlens, offsets, T, NC, H,
    skb, skt, skh, skd, svb, svt, svh, svd,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    USE_S0: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``k [B,T,H,K]``, ``v [B,T,H,V]`` (strided), ``s0 [N,H,V,K]``, ``n0 [N,H,K]`` -> ``hs [B,H,NC,K,V]`` and
    ``ns [B,H,NC,K]`` (``Sᵀ`` and ``n`` at each chunk's start), ``st [N,H,V,K]``, ``nt [N,H,K]`` (after the last
    token), all float32. Grid ``(value blocks, N·H)``; the first value block writes the normalisers."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, bos, L, c0 = seq_site(cu_seqlens, offsets, i_nh, H, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    m_n = (o_k < K) & (o_k * 0 + i_v == 0)
    p_s = i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]  # [K, V] view of a [V, K] state
    p_n = i_nh.to(tl.int64) * K + o_k
    if USE_S0:
        b_h = tl.load(s0 + p_s, mask=m_kv, other=0.0).to(tl.float32)
        b_n = tl.load(n0 + p_n, mask=o_k < K, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_n = tl.zeros([BK], dtype=tl.float32)
    slot0 = (i_b * H + i_h) * NC + c0
    for i_c in range(0, tl.cdiv(L, BT)):
        p_h, _, p_ns = state_offsets(slot0 + i_c, o_k, o_v, K, V)
        tl.store(hs + p_h, b_h, mask=m_kv)
        tl.store(ns + p_ns, b_n, mask=m_n)
        b_k, _, _ = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
        b_v, _, _ = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)
        b_h += tl.dot(tl.trans(b_k), b_v, input_precision=PRECISION)
        b_n += tl.sum(b_k.to(tl.float32), 0)
    tl.store(st + p_s, b_h, mask=m_kv)
    tl.store(nt + p_n, b_n, mask=m_n)


@triton.jit
def linear_fwd_output_kernel(
    q, k, v, hs, ns, o, z, cu_seqlens, offsets, T, NC, N, eps,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, NORMALIZE: tl.constexpr, PRECISION: tl.constexpr, IS_VARLEN: tl.constexpr,
    LOG_N: tl.constexpr,
):  # fmt: skip
    """``o [B,T,HQ,V]`` (contiguous, ``v``'s dtype) of one chunk of one query head and value block, and the
    normaliser ``z = nᵀq [B,T,HQ]`` (float32, before the clamp; the first value block writes it). Grid
    ``(chunk slots, B·HQ, value blocks)``."""
    i_p, i_v = tl.program_id(0), tl.program_id(2)
    i_b, i_hq, bos, L, i_c = chunk_site(cu_seqlens, offsets, i_p, tl.program_id(1), T, N, HQ, IS_VARLEN, LOG_N)
    if i_c * BT >= L:
        return
    i_h = i_hq // (HQ // H)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    b_q, o_t, m_t = row_tile(q, i_b, i_hq, bos, i_c, L, sqb, sqt, sqh, sqd, o_k, K, BT)
    b_k, _, _ = row_tile(k, i_b, i_h, bos, i_c, L, skb, skt, skh, skd, o_k, K, BT)
    b_v, _, _ = row_tile(v, i_b, i_h, bos, i_c, L, svb, svt, svh, svd, o_v, V, BT)
    p_h, m_kv, p_ns = state_offsets((i_b * H + i_h) * NC + i_p, o_k, o_v, K, V)
    b_h = tl.load(hs + p_h, mask=m_kv, other=0.0)
    b_a = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION)
    b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a, 0.0)
    b_qf = b_q.to(tl.float32)
    # The state and the chunk's scores are float32: their products run in float32 (tf32 on the tensor cores).
    b_u = tl.dot(b_qf, b_h, input_precision=PRECISION)
    b_u += tl.dot(b_a, b_v.to(tl.float32), input_precision=PRECISION)
    p_row = (i_b * T + bos + o_t) * HQ + i_hq
    if NORMALIZE:
        b_n = tl.load(ns + p_ns, mask=o_k < K, other=0.0)
        b_z = tl.sum(b_qf * b_n[None, :], 1) + tl.sum(b_a, 1)
        b_u = b_u / tl.maximum(b_z, eps)[:, None]
        tl.store(z + p_row, b_z, mask=m_t & (o_t * 0 + i_v == 0))
    tl.store(o + p_row[:, None] * V + o_v[None, :], b_u.to(o.dtype.element_ty), mask=m_t[:, None] & (o_v < V)[None, :])


def chunk_size() -> int:
    """Tokens per chunk: 64 on the GPU, 16 under the interpreter (small tests then cross several chunks)."""
    return 16 if interpreting() else 64


def state_block(V: int) -> int:
    """The value-block width of the state passes and the output kernel: at most 64, so that a ``[K, V]`` float32
    state tile of ``K = 128`` stays within registers, and a batch of few heads still spreads over the SMs."""
    return min(block_dim(V), 64)


def num_warps(K: int, V: int) -> int:
    """Four warps up to 64 channels, eight above (not yet timed on a GPU). Every launch takes one pipeline stage:
    compiled for sm_90a (Triton 3.6), Triton's default three made the dK/dV kernel want 329 KB of shared memory at
    K = V = 128 with float32 inputs, over the 227 KB a block has. Float32 inputs take 3xTF32 dots
    (``triton_utils.float32_dots``): exact products spilled 24–28 KB a thread there."""
    return 4 if max(K, V) <= 64 else 8


def linear_fwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor | None,
    n0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    normalize: bool,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    """Launch the forward. ``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]`` (any strides, one float dtype,
    ``T > 0``), ``s0 [N,H,V,K]`` and ``n0 [N,H,K]`` (both or neither, float32 or float64, contiguous). Returns
    ``o [B,T,HQ,V]`` in ``v.dtype``, the final ``S [N,H,V,K]`` and ``n [N,H,K]``, and for the backward the chunk
    states ``hs [B,H,NC,K,V]``, ``ns [B,H,NC,K]`` and the normaliser ``z [B,T,HQ]`` (empty without ``normalize``),
    all float32; with ``cu_seqlens`` the chunk slots past each sequence's last chunk are left unwritten."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    BT = chunk_size()
    _, NC, varlen = chunk_layout(cu_seqlens, B, T, BT)
    N = varlen["N"]
    BK, BV = block_dim(K), state_block(V)
    f32 = dict(dtype=torch.float32, device=q.device)
    hs = torch.empty(B, H, NC, K, V, **f32)
    ns = torch.empty(B, H, NC, K, **f32)
    st = torch.empty(N, H, V, K, **f32)
    nt = torch.empty(N, H, K, **f32)
    o = torch.empty(B, T, HQ, V, dtype=v.dtype, device=q.device)
    z = torch.empty(B, T, HQ, **f32) if normalize else torch.empty(0, **f32)
    dims = dict(K=K, V=V, BK=BK, BV=BV, BT=BT, PRECISION=float32_dots(q.dtype), num_warps=num_warps(K, V))
    linear_fwd_state_kernel[(triton.cdiv(V, BV), N * H)](
        k, v, s0, n0, hs, ns, st, nt, varlen["cu_seqlens"], varlen["offsets"], T, NC, H, *k.stride(), *v.stride(),
        USE_S0=s0 is not None, IS_VARLEN=varlen["IS_VARLEN"], num_stages=1, **dims,
    )  # fmt: skip
    linear_fwd_output_kernel[(NC, (1 if cu_seqlens is not None else B) * HQ, triton.cdiv(V, BV))](
        q, k, v, hs, ns, o, z, T=T, NC=NC, eps=eps, HQ=HQ, H=H, NORMALIZE=normalize, **varlen,
        sqb=q.stride(0), sqt=q.stride(1), sqh=q.stride(2), sqd=q.stride(3),
        skb=k.stride(0), skt=k.stride(1), skh=k.stride(2), skd=k.stride(3),
        svb=v.stride(0), svt=v.stride(1), svh=v.stride(2), svd=v.stride(3), num_stages=1, **dims,
    )  # fmt: skip
    return o, st, nt, hs, ns, z
