"""FoX forward: FlashAttention-2's online softmax with the gate bias, one program per (query block, query head).

The logits run in base 2: ``s = log2(e)·(scale·qᵀk + G_i − G_j)``, the gate's cumulative sums pre-scaled by
``log2(e)`` (``ops/common/triton/scan.py``), so a logit is one FMA and one subtraction past the ``tl.dot``. Key blocks
wholly below the query block's first row need no mask; only the ones that cross the diagonal do. Saves the base-2
log-sum-exp for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.scan import segment_cumsum
from attnkit.ops.common.triton_seq import launch_grid, program_block
from attnkit.ops.common.triton_utils import LOG2E, block_dim, interpreting


@triton.jit
def query_tile(
    q, gc, i_b, i_hq, bos, L, T, start_m, sqb, sqt, sqh, sqd, o_k,
    HQ: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, HAS_GATE: tl.constexpr,
):  # fmt: skip
    """``(o_m, m_m, p_m, p_row, q, gq)`` of the query block ``[start_m, start_m + BM)`` of head ``i_hq``: positions,
    their mask, token offsets, entries of the ``[B, T, HQ]`` arrays, the query tile and the rows' gates (zeros
    without a gate)."""
    o_m = start_m + tl.arange(0, BM)
    m_m = o_m < L
    p_m = bos + o_m.to(tl.int64)
    p_q = q + i_b * sqb + i_hq * sqh + p_m[:, None] * sqt + o_k[None, :] * sqd
    b_q = tl.load(p_q, mask=m_m[:, None] & (o_k < K)[None, :], other=0.0)
    p_row = (i_b * T + p_m) * HQ + i_hq
    if HAS_GATE:
        b_gq = tl.load(gc + p_row, mask=m_m, other=0.0)
    else:
        b_gq = tl.zeros([BM], dtype=tl.float32)
    return o_m, m_m, p_m, p_row, b_q, b_gq


@triton.jit
def key_tile(
    b_q, b_gq, o_m, start_n, L, k, v, gc, p_gk0, stride_kt, stride_kd, stride_vt, stride_vd, bos, o_k, o_v, scale_log2,
    HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``(k, v, s)`` of the key block ``[start_n, start_n + BN)`` against a query block: its key and value tiles and
    the base-2 logits ``[BM, BN]``, ``-inf`` above the diagonal when ``CAUSAL`` (the forward's and dQ's shared
    step)."""
    o_n = start_n + tl.arange(0, BN)
    p_n = bos + o_n.to(tl.int64)
    m_k, m_v = (o_k < K)[None, :], (o_v < V)[None, :]
    if CAUSAL:
        # Only the blocks that cross the diagonal can run past the end of the sequence.
        m_n = o_n < L
        m_k, m_v = m_k & m_n[:, None], m_v & m_n[:, None]
    b_k = tl.load(k + p_n[:, None] * stride_kt + o_k[None, :] * stride_kd, mask=m_k, other=0.0)
    b_v = tl.load(v + p_n[:, None] * stride_vt + o_v[None, :] * stride_vd, mask=m_v, other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale_log2
    if HAS_GATE:
        if CAUSAL:
            b_gk = tl.load(gc + p_gk0 + p_n * HQ, mask=m_n, other=0.0)
        else:
            b_gk = tl.load(gc + p_gk0 + p_n * HQ)
        b_s += b_gq[:, None] - b_gk[None, :]
    if CAUSAL:
        b_s = tl.where(o_m[:, None] >= o_n[None, :], b_s, float("-inf"))
    return b_k, b_v, b_s


@triton.jit
def _fwd_block(
    b_acc, b_m, b_l, b_q, b_gq, o_m, start_n, L, k, v, gc, p_gk0, stride_kt, stride_kd, stride_vt, stride_vd,
    bos, o_k, o_v, scale_log2,
    HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key block folded into the running ``(acc, max, sum)`` of a query block."""
    _, b_v, b_s = key_tile(
        b_q, b_gq, o_m, start_n, L, k, v, gc, p_gk0, stride_kt, stride_kd, stride_vt, stride_vd, bos, o_k, o_v,
        scale_log2, HQ, K, V, BN, CAUSAL, HAS_GATE, PRECISION,
    )  # fmt: skip
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_rescale = tl.exp2(b_m - b_m_new)
    b_l = b_l * b_rescale + tl.sum(b_p, 1)
    b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_acc, b_m_new, b_l


@triton.jit
def fox_fwd_kernel(
    q, k, v, gc, o, lse, cu_seqlens, offsets, T, N, scale_log2,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]`` through their strides; ``gc [B,T,HQ]`` the gate's
    cumulative sums times ``log2(e)`` (float32), ``o [B,T,HQ,V]`` and ``lse [B,T,HQ]`` (float32, base 2)
    contiguous. Grid: ``triton_seq.launch_grid`` over query blocks of ``BM`` and the ``HQ`` heads."""
    i_b, i_hq, bos, L, i_m = program_block(cu_seqlens, offsets, N, T, HQ, LOG_N, IS_VARLEN)
    start_m = i_m * BM
    if start_m >= L:
        return
    i_h = i_hq // (HQ // H)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    o_m, m_m, p_m, p_row, b_q, b_gq = query_tile(
        q, gc, i_b, i_hq, bos, L, T, start_m, sqb, sqt, sqh, sqd, o_k, HQ, K, BM, HAS_GATE
    )
    p_gk0 = i_b * T * HQ + i_hq  # (i_b, 0, i_hq) of the [B, T, HQ] arrays

    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    k_h, v_h = k + i_b * skb + i_h * skh, v + i_b * svb + i_h * svh
    end_full = (start_m // BN) * BN  # key blocks before it end at or before the query block's first row
    for start_n in range(0, end_full, BN):
        b_acc, b_m, b_l = _fwd_block(
            b_acc, b_m, b_l, b_q, b_gq, o_m, start_n, L, k_h, v_h, gc, p_gk0, skt, skd, svt, svd, bos, o_k, o_v,
            scale_log2, HQ, K, V, BN, False, HAS_GATE, PRECISION,
        )  # fmt: skip
    for start_n in range(end_full, tl.minimum(start_m + BM, L), BN):
        b_acc, b_m, b_l = _fwd_block(
            b_acc, b_m, b_l, b_q, b_gq, o_m, start_n, L, k_h, v_h, gc, p_gk0, skt, skd, svt, svd, bos, o_k, o_v,
            scale_log2, HQ, K, V, BN, True, HAS_GATE, PRECISION,
        )  # fmt: skip

    b_o = b_acc / b_l[:, None]
    p_o = o + p_row[:, None] * V + o_v[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & (o_v < V)[None, :])
    tl.store(lse + p_row, b_m + tl.log2(b_l), mask=m_m)


def fwd_config(width: int) -> tuple[int, int, int, int]:
    """``(BM, BN, num_warps, num_stages)`` for the widest channel block; tiny under the interpreter.

    Up to 64 channels: 128 × 64 tiles on four warps, three stages, the fastest of ``benchmarks/fox_tune.py``'s rows on
    the H200 (fifteenth session, D = 64, T = 8k, bf16: 1.82 ms, 0.97× SDPA's flash forward, against 2.96 ms on eight
    warps and two stages, although ptxas reports 32 bytes of spills there). Up to 128: FlashAttention-2's tile shapes
    where Triton 3.6's sm_90 code does not spill (0 bytes with 128 × 64 tiles on eight warps, where four warps spill
    1460), not yet timed; 20 bytes at D = 256 with 32 × 32."""
    if interpreting():
        return 16, 16, 1, 1
    if width <= 64:
        return 128, 64, 4, 3
    if width <= 128:
        return 128, 64, 8, 2
    return 32, 32, 4, 2


# ``tl.dot``'s precision for float32 inputs on a GPU: "ieee" (exact, unrolled FMAs: no tensor cores) or "tf32x3"
# (three TF32 passes on the tensor cores). Not at a padded head dim of 128, where the default tiles in 3xTF32 want
# 262-328 KB of shared memory (Hopper's block has 227; exact: 165-180 KB; compiled for sm_90a with Triton 3.6,
# tests/ops/test_gpu_compile.py's fox_float32 group). On an H100 (Triton 3.6, T = 4k, D = 64) 3xTF32 took 33 ms
# forward+backward against exact's 156, its output 1.2e-5 from float64 as exact's; its gradients are not yet measured
# (benchmarks/results/fox_h200.md), so exact stays the default until a GPU test holds them.
FLOAT32_PRECISION = "ieee"


def precision(dtype: torch.dtype, width: int) -> str:
    """``tl.dot``'s precision for inputs of ``dtype`` at the padded head dim ``width`` (``max(BK, BV)``):
    ``FLOAT32_PRECISION`` for float32 inputs except at width 128 and under the interpreter (which has no TF32), where
    it is exact; the tensor cores' own for 16-bit ones."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if interpreting() or width == 128 else FLOAT32_PRECISION


def fox_fwd_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward. ``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]`` (any strides, one float dtype),
    ``g [B,T,HQ]`` or None. ``config`` overrides :func:`fwd_config`. Returns ``o [B,T,HQ,V]`` in ``v.dtype`` and
    ``lse [B,T,HQ]`` float32 (base 2, for the backward)."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    BK, BV = block_dim(K), block_dim(V)
    BM, BN, num_warps, num_stages = config or fwd_config(max(BK, BV))
    gc = None if g is None else segment_cumsum(g, cu_seqlens, LOG2E, False, torch.float32)
    o = torch.empty(B, T, HQ, V, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device)
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, HQ, BM)
    fox_fwd_kernel[grid](
        q, k, v, gc, o, lse, cu_seqlens, offsets, T, N, scale * LOG2E, *q.stride(), *k.stride(), *v.stride(),
        HQ=HQ, H=H, K=K, V=V, BK=BK, BV=BV, BM=BM, BN=BN, LOG_N=log_n, IS_VARLEN=cu_seqlens is not None,
        HAS_GATE=g is not None, PRECISION=precision(q.dtype, max(BK, BV)), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o, lse
