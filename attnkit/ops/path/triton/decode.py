"""PaTH decode step in one pass over a preallocated cache: carry every cached key across the new transition
(``k_j ← k_j − β_t (w_t·k_j) w_t``, written back in place) and read the softmax with the carried keys.

Split-KV like the TAPA decode kernel: one program per (key/value head, cache split, sequence) serves the
``G`` query heads of the group, so the cache is read once, written once (keys) and read once (values);
an SDPA decode step reads it twice. The splits' float32 partials are merged by
``attnkit/ops/common/triton/decode_merge.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton.decode_merge import (
    decode_config,
    decode_softmax_step,
    decode_store,
    merge_splits,
    split_partials,
    split_plan,
)
from attnkit.ops.common.triton_utils import LOG2E, block_dim


@triton.jit
def path_decode_kernel(
    q, k_cache, v_cache, w, beta, g_cache, cache_mask, o, o_part, m_part, l_part,
    t, split_size, scale_log2, CAP, MASK_STRIDE,
    HQ: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BG: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    USE_G: tl.constexpr, USE_MASK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """``q [B, HQ, K]``, caches ``k_cache [B, CAP, H, K]`` (updated in place), ``v_cache [B, CAP, H, V]``,
    ``w [B, H, K]``, ``beta [B, H]``, ``g_cache [B, CAP, HQ]`` float32 cumulative gates, ``cache_mask [B, M]``
    (``t < M ≤ CAP``, row stride ``MASK_STRIDE``).
    Slots ``[0, t)`` are carried across the new transition; slot ``t`` (the new token, already written) is not.
    Grid ``(H, splits, B)``."""
    i_h, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    G = HQ // H
    o_g = tl.arange(0, BG)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_g, m_k, m_v = o_g < G, o_k < K, o_v < V
    o_hq = i_h * G + o_g
    b_q = tl.load(q + (i_b64 * HQ + o_hq)[:, None] * K + o_k[None, :], mask=m_g[:, None] & m_k[None, :], other=0.0)
    b_q = b_q.to(k_cache.dtype.element_ty)
    b_w = tl.load(w + (i_b64 * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_b64 * H + i_h).to(tl.float32)
    if USE_G:
        b_gq = tl.load(g_cache + (i_b64 * CAP + t) * HQ + o_hq, mask=m_g, other=0.0)

    start = i_s * split_size
    end = tl.minimum(start + split_size, t + 1)
    b_acc = tl.zeros([BG, BV], dtype=tl.float32)
    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    for start_n in range(start, end, BN):
        o_n = start_n + tl.arange(0, BN)
        m_n = o_n < end
        p_kn = (i_b64 * CAP + o_n)[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_k = tl.load(k_cache + p_kn, mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        # k ← H_t k for the old slots; the new token's own key is not carried.
        m_old = o_n < t
        b_kw = tl.sum(b_k * b_w[None, :], 1)
        b_k = tl.where(m_old[:, None], b_k - (b_beta * b_kw)[:, None] * b_w[None, :], b_k)
        b_k = b_k.to(k_cache.dtype.element_ty)
        tl.store(k_cache + p_kn, b_k, mask=m_old[:, None] & m_k[None, :])
        p_vn = (i_b64 * CAP + o_n)[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v_cache + p_vn, mask=m_n[:, None] & m_v[None, :], other=0.0)

        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale_log2
        if USE_G:
            p_gk = g_cache + (i_b64 * CAP + o_n)[None, :] * HQ + o_hq[:, None]
            b_gk = tl.load(p_gk, mask=m_g[:, None] & m_n[None, :], other=0.0)
            b_s += (b_gq[:, None] - b_gk) * 1.4426950408889634
        m_vis = m_n
        if USE_MASK:
            m_vis = m_vis & (tl.load(cache_mask + i_b64 * MASK_STRIDE + o_n, mask=m_n, other=0) != 0)
        b_s = tl.where(m_vis[None, :], b_s, float("-inf"))
        b_acc, b_m, b_l = decode_softmax_step(b_s, b_v, b_acc, b_m, b_l, PRECISION)

    p_o = o + (i_b64 * HQ + o_hq)[:, None] * V + o_v[None, :]
    m_o = m_g[:, None] & m_v[None, :]
    decode_store(b_acc, b_m, b_l, o_part, m_part, l_part, p_o, m_o, i_b64 * HQ + o_hq, m_g, o_v, V, SPLIT)


def path_decode_fn(
    q: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    t: int,
    g_cache: torch.Tensor | None,
    cache_mask: torch.Tensor | None,
    scale: float,
    split_size: int | None = None,
) -> torch.Tensor:
    """Launch on trusted inputs: ``q [B, 1, HQ, K]``, ``w [B, 1, H, K]``, ``beta [B, 1, H]``, contiguous caches
    whose slot ``t`` already holds the new token, ``cache_mask [B, M]`` with unit column stride or None. Updates
    ``k_cache[:, :t]`` in place; returns ``o [B, 1, HQ, V]`` in ``v_cache.dtype``. ``split_size`` forces the slots
    per split (tests)."""
    B, CAP, H, K = k_cache.shape
    HQ, V = q.shape[2], v_cache.shape[-1]
    BN, num_warps, num_stages = decode_config(K, V)
    split_size, S = split_plan(B * H, t + 1, q.device, BN, split_size)
    o = torch.empty(B, 1, HQ, V, dtype=v_cache.dtype, device=q.device)
    o_part, m_part, l_part = partials = split_partials(o, S)
    path_decode_kernel[(H, S, B)](
        q.contiguous(), k_cache, v_cache, w.contiguous(), beta.contiguous(), g_cache, cache_mask, o, o_part, m_part,
        l_part, t, split_size, scale * LOG2E, CAP, 0 if cache_mask is None else cache_mask.stride(0),
        HQ=HQ, H=H, K=K, V=V, BG=block_dim(HQ // H), BK=block_dim(K), BV=block_dim(V), BN=BN,
        USE_G=g_cache is not None, USE_MASK=cache_mask is not None, SPLIT=S > 1,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if S > 1:
        merge_splits(partials, o, S)
    return o
