"""FoX backward: FlashAttention-2's, recomputing the probabilities from the saved base-2 log-sum-exp.

Kernels: ``delta = rowsum(dO ⊙ O)``; dK, dV and the gate's key-side sum ``dG_j = −Σ_i dS_ij`` per (key block,
key/value head), looping over the ``G`` query heads that share the head (the key and value tiles are read once) and
the query blocks that see the keys; dQ per (query block, query head) over its causal key prefix. dQ by a second
recomputation, not float32 atomics from the dK/dV kernel: a FoX logit costs one FMA and one exp2 to rebuild, so the
second pass is cheaper than ``HQ·D`` float32 atomics a query row and the buffer's cast, and it is deterministic.
The query-side gate sum ``Σ_j dS_ij`` is zero only up to the rounding of ``delta``, so the dQ kernel adds it to
``dG`` from its own ``dS`` and the error cancels as in autograd; ``dg`` is the suffix sum of ``dG`` within each
sequence (``ops/common/triton/scan.py``). Derivation: ``README.md`` of the op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.baselines.fox.triton.forward import key_tile, precision, query_tile
from attnkit.ops.common.triton.rowdot import output_delta
from attnkit.ops.common.triton.scan import segment_cumsum
from attnkit.ops.common.triton_seq import launch_grid, program_block
from attnkit.ops.common.triton_utils import LOG2E, block_dim, interpreting


@triton.jit
def grad_rows(
    do, lse, delta, i_b, i_hq, m_m, p_m, p_row, sdb, sdt, sdh, sdd, o_v, V: tl.constexpr
):  # fmt: skip
    """``(dO, lse, delta)`` of a query block's rows. Rows past the end get lse = +inf, hence P = 0: no row mask is
    needed on the tiles."""
    p_do = do + i_b * sdb + i_hq * sdh + p_m[:, None] * sdt + o_v[None, :] * sdd
    b_do = tl.load(p_do, mask=m_m[:, None] & (o_v < V)[None, :], other=0.0)
    b_lse = tl.load(lse + p_row, mask=m_m, other=float("inf"))
    b_delta = tl.load(delta + p_row, mask=m_m, other=0.0)
    return b_do, b_lse, b_delta


@triton.jit
def _dkdv_block(
    b_dk, b_dv, b_dg, b_k, b_v, b_gk, o_n, start_m, L, i_b, i_hq, bos, T,
    q, do, gc, lse, delta, sqb, sqt, sqh, sqd, sdb, sdt, sdh, sdd, o_k, o_v, scale_log2,
    HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One query block against the program's key block, in the transposed (keys × queries) orientation."""
    o_m, m_m, p_m, p_row, b_q, b_gq = query_tile(
        q, gc, i_b, i_hq, bos, L, T, start_m, sqb, sqt, sqh, sqd, o_k, HQ, K, BM, HAS_GATE
    )
    b_do, b_lse, b_delta = grad_rows(do, lse, delta, i_b, i_hq, m_m, p_m, p_row, sdb, sdt, sdh, sdd, o_v, V)
    b_st = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION) * scale_log2
    if HAS_GATE:
        b_st += b_gq[None, :] - b_gk[:, None]
    b_p = tl.exp2(b_st - b_lse[None, :])
    if CAUSAL:
        b_p = tl.where(o_m[None, :] >= o_n[:, None], b_p, 0.0)
    b_dv += tl.dot(b_p.to(b_do.dtype), b_do, input_precision=PRECISION)
    b_dp = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)
    b_ds = b_p * (b_dp - b_delta[None, :])
    b_dk += tl.dot(b_ds.to(b_q.dtype), b_q, input_precision=PRECISION)
    if HAS_GATE:
        b_dg += tl.sum(b_ds, 1)
    return b_dk, b_dv, b_dg


@triton.jit
def fox_bwd_dkdv_kernel(
    q, k, v, gc, do, lse, delta, dk, dv, dgc, cu_seqlens, offsets, T, N, scale_log2, scale,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dK, dV (``[B,T,H,·]`` contiguous, the inputs' dtypes) and ``dG [B,T,HQ]`` (float32, the gradient of the
    cumulative gate) of one key block of one key/value head. Grid ``triton_seq.launch_grid`` over key blocks of ``BN``
    and the ``H`` heads; ``BN`` is a multiple of ``BM``."""
    i_b, i_h, bos, L, i_nb = program_block(cu_seqlens, offsets, N, T, H, LOG_N, IS_VARLEN)
    start_n = i_nb * BN
    if start_n >= L:
        return
    G = HQ // H
    o_n = start_n + tl.arange(0, BN)
    m_n = o_n < L
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p_n = bos + o_n.to(tl.int64)
    m_k, m_v = m_n[:, None] & (o_k < K)[None, :], m_n[:, None] & (o_v < V)[None, :]
    b_k = tl.load(k + i_b * skb + i_h * skh + p_n[:, None] * skt + o_k[None, :] * skd, mask=m_k, other=0.0)
    b_v = tl.load(v + i_b * svb + i_h * svh + p_n[:, None] * svt + o_v[None, :] * svd, mask=m_v, other=0.0)
    b_dk = tl.zeros([BN, BK], dtype=tl.float32)
    b_dv = tl.zeros([BN, BV], dtype=tl.float32)
    for i_g in range(G):
        i_hq = i_h * G + i_g
        p_col = (i_b * T + p_n) * HQ + i_hq
        if HAS_GATE:
            b_gk = tl.load(gc + p_col, mask=m_n, other=0.0)
        else:
            b_gk = tl.zeros([BN], dtype=tl.float32)
        b_dg = tl.zeros([BN], dtype=tl.float32)
        # The query blocks that cross the diagonal need the causal mask; the rest see every key of the block.
        for start_m in range(start_n, tl.minimum(start_n + BN, L), BM):
            b_dk, b_dv, b_dg = _dkdv_block(
                b_dk, b_dv, b_dg, b_k, b_v, b_gk, o_n, start_m, L, i_b, i_hq, bos, T, q, do, gc, lse, delta,
                sqb, sqt, sqh, sqd, sdb, sdt, sdh, sdd, o_k, o_v, scale_log2, HQ, K, V, BM, True, HAS_GATE, PRECISION,
            )  # fmt: skip
        for start_m in range(start_n + BN, L, BM):
            b_dk, b_dv, b_dg = _dkdv_block(
                b_dk, b_dv, b_dg, b_k, b_v, b_gk, o_n, start_m, L, i_b, i_hq, bos, T, q, do, gc, lse, delta,
                sqb, sqt, sqh, sqd, sdb, sdt, sdh, sdd, o_k, o_v, scale_log2, HQ, K, V, BM, False, HAS_GATE, PRECISION,
            )  # fmt: skip
        if HAS_GATE:
            tl.store(dgc + p_col, -b_dg, mask=m_n)
    p_kv = (i_b * T + p_n) * H + i_h
    tl.store(dk + p_kv[:, None] * K + o_k[None, :], (b_dk * scale).to(dk.dtype.element_ty), mask=m_k)
    tl.store(dv + p_kv[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_v)


@triton.jit
def _dq_block(
    b_dq, b_dgr, b_q, b_do, b_gq, b_lse, b_delta, o_m, start_n, L, k, v, gc, p_gk0,
    stride_kt, stride_kd, stride_vt, stride_vd, bos, o_k, o_v, scale_log2,
    HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key block folded into the dQ of the program's query block, and into its rows' share of the gate's
    gradient (``Σ_j dS_ij``); the masked logits give P = 0."""
    b_k, b_v, b_s = key_tile(
        b_q, b_gq, o_m, start_n, L, k, v, gc, p_gk0, stride_kt, stride_kd, stride_vt, stride_vd, bos, o_k, o_v,
        scale_log2, HQ, K, V, BN, CAUSAL, HAS_GATE, PRECISION,
    )  # fmt: skip
    b_p = tl.exp2(b_s - b_lse[:, None])
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PRECISION)
    if HAS_GATE:
        b_dgr += tl.sum(b_ds, 1)
    return b_dq, b_dgr


@triton.jit
def fox_bwd_dq_kernel(
    q, k, v, gc, do, lse, delta, dq, dgc, cu_seqlens, offsets, T, N, scale_log2, scale,
    sqb, sqt, sqh, sqd, skb, skt, skh, skd, svb, svt, svh, svd, sdb, sdt, sdh, sdd,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_GATE: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ (``[B,T,HQ,K]`` contiguous, ``q``'s dtype) of one query block of one query head, and its rows' share of
    ``dG`` added to ``dgc``; grid as the forward's."""
    i_b, i_hq, bos, L, i_m = program_block(cu_seqlens, offsets, N, T, HQ, LOG_N, IS_VARLEN)
    start_m = i_m * BM
    if start_m >= L:
        return
    i_h = i_hq // (HQ // H)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    o_m, m_m, p_m, p_row, b_q, b_gq = query_tile(
        q, gc, i_b, i_hq, bos, L, T, start_m, sqb, sqt, sqh, sqd, o_k, HQ, K, BM, HAS_GATE
    )
    b_do, b_lse, b_delta = grad_rows(do, lse, delta, i_b, i_hq, m_m, p_m, p_row, sdb, sdt, sdh, sdd, o_v, V)
    p_gk0 = i_b * T * HQ + i_hq
    b_dq = tl.zeros([BM, BK], dtype=tl.float32)
    b_dgr = tl.zeros([BM], dtype=tl.float32)
    k_h, v_h = k + i_b * skb + i_h * skh, v + i_b * svb + i_h * svh
    end_full = (start_m // BN) * BN
    for start_n in range(0, end_full, BN):
        b_dq, b_dgr = _dq_block(
            b_dq, b_dgr, b_q, b_do, b_gq, b_lse, b_delta, o_m, start_n, L, k_h, v_h, gc, p_gk0, skt, skd, svt, svd, bos,
            o_k, o_v, scale_log2, HQ, K, V, BN, False, HAS_GATE, PRECISION,
        )  # fmt: skip
    for start_n in range(end_full, tl.minimum(start_m + BM, L), BN):
        b_dq, b_dgr = _dq_block(
            b_dq, b_dgr, b_q, b_do, b_gq, b_lse, b_delta, o_m, start_n, L, k_h, v_h, gc, p_gk0, skt, skd, svt, svd, bos,
            o_k, o_v, scale_log2, HQ, K, V, BN, True, HAS_GATE, PRECISION,
        )  # fmt: skip
    m_qk = m_m[:, None] & (o_k < K)[None, :]
    tl.store(dq + p_row[:, None] * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_qk)
    if HAS_GATE:
        # The rows' side of dG, after the dK/dV kernel stored the columns' side: this program owns these rows.
        tl.store(dgc + p_row, tl.load(dgc + p_row, mask=m_m, other=0.0) + b_dgr, mask=m_m)


def bwd_config(width: int) -> dict[str, tuple[int, int, int, int]]:
    """``(BM, BN, num_warps, num_stages)`` of the dK/dV and dQ kernels for the widest channel block; tiny under the
    interpreter.

    Up to 64 channels, timed (``benchmarks/fox_tune.py`` on the H200, fifteenth session, D = 64, T = 8k, bf16): dK/dV
    32 query rows against 64 keys and dQ 64 × 64, both on four warps with three stages, 7.16 ms against 8.51 with the
    spill-chosen launches below (forward+backward 1.24× SDPA's with the forward's timed tiles). Wider: chosen by the
    spills of Triton 3.6's sm_90 code (ptxas; not yet timed). dK/dV holds two ``[BN, D]`` float32 accumulators
    besides its key and value tiles: 32 query rows against 128 keys on eight warps spill 20 bytes at D = 64 and 160
    at D = 128 with one stage (64 × 128 spilled 564 and 1492), 32 × 32 spills 228 at D = 256. dQ: 128 × 64 (D = 64)
    and 128 × 32 (D = 128) on eight warps do not spill; 32 × 32 spills 268 at 256."""
    if interpreting():
        return {"dkdv": (16, 16, 1, 1), "dq": (16, 16, 1, 1)}
    if width <= 64:
        return {"dkdv": (32, 64, 4, 3), "dq": (64, 64, 4, 3)}
    if width <= 128:
        return {"dkdv": (32, 128, 8, 1), "dq": (128, 32, 8, 2)}
    return {"dkdv": (32, 32, 8, 2), "dq": (32, 32, 4, 2)}


def fox_bwd_fn(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    config: dict[str, tuple[int, int, int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv, dg)`` in the dtypes of ``(q, k, v, g)``, contiguous (``dg`` empty without a gate);
    inputs as :func:`forward.fox_fwd_fn` takes and returns them, ``do`` shaped like ``o`` (any strides). ``config``
    overrides :func:`bwd_config`."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    BK, BV = block_dim(K), block_dim(V)
    config = config or bwd_config(max(BK, BV))
    is_varlen, has_gate = cu_seqlens is not None, g is not None
    gc = segment_cumsum(g, cu_seqlens, LOG2E, False, torch.float32) if has_gate else None
    delta = output_delta(o, do)

    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    common = dict(
        HQ=HQ, H=H, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=is_varlen, HAS_GATE=has_gate,
        PRECISION=precision(q.dtype, max(BK, BV)),
    )  # fmt: skip
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    dgc = torch.empty(B, T, HQ, dtype=torch.float32, device=q.device) if has_gate else None
    BM, BN, num_warps, num_stages = config["dkdv"]
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, H, BN)
    fox_bwd_dkdv_kernel[grid](
        q, k, v, gc, do, lse, delta, dk, dv, dgc, cu_seqlens, offsets, T, N, scale * LOG2E, scale, *strides,
        BM=BM, BN=BN, LOG_N=log_n, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    BM, BN, num_warps, num_stages = config["dq"]
    grid, offsets, N, log_n = launch_grid(cu_seqlens, B, T, HQ, BM)
    fox_bwd_dq_kernel[grid](
        q, k, v, gc, do, lse, delta, dq, dgc, cu_seqlens, offsets, T, N, scale * LOG2E, scale, *strides,
        BM=BM, BN=BN, LOG_N=log_n, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    # G is a cumulative sum: g_t's gradient sums dG from t to the end of its sequence.
    dg = segment_cumsum(dgc, cu_seqlens, 1.0, True, g.dtype) if has_gate else q.new_empty(0)
    return dq, dk, dv, dg
