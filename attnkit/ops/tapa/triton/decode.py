"""TAPA decode step: one query token against a cache of raw keys with absolute positions (split-KV).

Decoding reads the whole cache to produce one token, so it is bound by memory bandwidth: one program
handles the ``G = HQ // H`` query heads of one key/value head over one split of the cache, so every key and
value is read once (GQA/MQA for free), and the splits make ``B·H·splits`` programs enough to fill the GPU
when ``B·H`` alone would not ("flash-decoding"). The ``G`` query rows are padded to 16 for ``tl.dot``; the
padded rows are zero and never stored, and their share of the logit arithmetic hides under the loads.

A slot's distance ``d = m − n`` comes from the positions the cache records (left padding, garbage in
masked slots), so ``d^alpha`` is computed in the kernel per slot (one value per slot, shared by the ``G``
query rows). Splits keep a float32 online-softmax partial (``max``, ``sum``, unnormalised ``acc``) that
``attnkit/ops/common/triton/decode_merge.py`` merges; with one split the first kernel writes the output itself.
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
from attnkit.ops.tapa.torch_impl import phase_variance
from attnkit.ops.tapa.triton.common import cos_cycles, phase_cycles


@triton.jit
def tapa_decode_kernel(
    q, k, v, q_pos, k_pos, cache_mask, o, o_part, m_part, l_part,
    L, split_size, alpha, amp_scale, phase_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_pb, stride_pn, stride_cb, stride_cn,
    stride_ob, stride_oh, stride_od,
    G: tl.constexpr, DA: tl.constexpr, DP: tl.constexpr, V: tl.constexpr,
    BG: tl.constexpr, BDA: tl.constexpr, BDP: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, LINEAR: tl.constexpr,
):  # fmt: skip
    """``q [B, 1, HQ, DA+DP]``, ``k [B, L, H, DA+DP]``, ``v [B, L, H, V]`` (any strides), ``q_pos [B]``,
        ``k_pos [B, L]`` int32/int64, ``cache_mask [B, L]`` bool. Grid ``(H, S, B)`` with ``S`` splits of
        ``split_size`` slots. With ``SPLIT`` writes float32 partials ``o_part [B, HQ, S, V]`` (unnormalised),
        ``m_part``, ``l_part [B, HQ, S]`` (base-2 max and sum); otherwise ``o [B, 1, HQ, V]`` directly. ``LINEAR``: the
    linear phase ``Σ q_P − Σ k_P`` instead of ``q_P·k_P``."""
    # Heads vary fastest so the programs of one (batch, split) run together and share the positions and
    # mask they all read through L2.
    i_h, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    o_g = tl.arange(0, BG)
    o_da, o_dp, o_v = tl.arange(0, BDA), tl.arange(0, BDP), tl.arange(0, BV)
    m_g = o_g < G
    m_da, m_dp, m_v = o_da < DA, o_dp < DP, o_v < V

    # The query is cast to the keys' dtype: tl.dot takes one dtype, and the cache is what was stored.
    p_q = q + i_b64 * stride_qb + (i_h * G + o_g)[:, None] * stride_qh
    b_qa = tl.load(p_q + o_da[None, :] * stride_qd, mask=m_g[:, None] & m_da[None, :], other=0.0)
    b_qp = tl.load(p_q + (DA + o_dp)[None, :] * stride_qd, mask=m_g[:, None] & m_dp[None, :], other=0.0)
    if LINEAR:
        b_u = tl.sum(b_qp.to(tl.float32), 1)
    b_qa, b_qp = b_qa.to(k.dtype.element_ty), b_qp.to(k.dtype.element_ty)
    b_pos = tl.load(q_pos + i_b)

    start = i_s * split_size
    end = tl.minimum(start + split_size, L)
    # Offsets within a tile are loop-invariant int32; only the tiles' base pointers move (64-bit).
    p_k = k + i_b64 * stride_kb + i_h * stride_kh + start.to(tl.int64) * stride_kn
    p_v = v + i_b64 * stride_vb + i_h * stride_vh + start.to(tl.int64) * stride_vn
    p_pos = k_pos + i_b64 * stride_pb + start.to(tl.int64) * stride_pn
    p_mask = cache_mask + i_b64 * stride_cb + start.to(tl.int64) * stride_cn
    o_t = tl.arange(0, BN)
    o_ka = o_t[:, None] * stride_kn + o_da[None, :] * stride_kd
    o_kp = o_t[:, None] * stride_kn + (DA + o_dp)[None, :] * stride_kd
    o_vt = o_t[:, None] * stride_vn + o_v[None, :] * stride_vd

    b_acc = tl.zeros([BG, BV], dtype=tl.float32)
    b_m = tl.full([BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BG], dtype=tl.float32)
    for start_n in range(start, end, BN):
        o_n = start_n + o_t
        m_n = o_n < end
        # Keys and values are masked by the bounds alone, not by the slots' visibility: a load that waited
        # on the position and mask loads could not be issued stages ahead by the pipeliner. Invisible
        # slots get probability 0 (their values must be finite, as on the PyTorch path).
        b_ka = tl.load(p_k + o_ka, mask=m_n[:, None] & m_da[None, :], other=0.0)
        b_kp = tl.load(p_k + o_kp, mask=m_n[:, None] & m_dp[None, :], other=0.0)
        b_v = tl.load(p_v + o_vt, mask=m_n[:, None] & m_v[None, :], other=0.0)
        b_kpos = tl.load(p_pos + o_t * stride_pn, mask=m_n, other=0)
        b_real = tl.load(p_mask + o_t * stride_cn, mask=m_n, other=0) != 0
        b_dist = b_pos - b_kpos
        m_vis = m_n & b_real & (b_dist >= 0)
        b_d = b_dist.to(tl.float32)
        # d^alpha/sqrt(dP) in cycles per unit q_P·k_P; 0^alpha = 0, also for alpha = 0 (log2(0) avoided).
        b_r = tl.where(b_d > 0, tl.exp2(alpha * tl.log2(tl.maximum(b_d, 1.0))), 0.0) * phase_scale

        b_amp = tl.dot(b_qa, tl.trans(b_ka), input_precision=PRECISION)
        if LINEAR:
            b_phase = b_u[:, None] - tl.sum(b_kp.to(tl.float32), 1)[None, :]
        else:
            b_phase = tl.dot(b_qp, tl.trans(b_kp), input_precision=PRECISION)
        b_logit = b_amp * cos_cycles(phase_cycles(b_phase, b_r[None, :]), False) * amp_scale
        b_logit = tl.where(m_vis[None, :], b_logit, float("-inf"))

        b_acc, b_m, b_l = decode_softmax_step(b_logit, b_v, b_acc, b_m, b_l, PRECISION)
        p_k, p_v = p_k + BN * stride_kn, p_v + BN * stride_vn
        p_pos, p_mask = p_pos + BN * stride_pn, p_mask + BN * stride_cn

    o_hq = i_h * G + o_g
    p_o = o + i_b64 * stride_ob + o_hq[:, None] * stride_oh + o_v[None, :] * stride_od
    m_o = m_g[:, None] & m_v[None, :]
    row = i_b64 * (G * tl.num_programs(0)) + o_hq
    decode_store(b_acc, b_m, b_l, o_part, m_part, l_part, p_o, m_o, row, m_g, o_v, V, SPLIT)


def tapa_decode_fn(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_position: torch.Tensor,
    k_positions: torch.Tensor,
    cache_mask: torch.Tensor,
    amp_dim: int,
    alpha: float,
    split_size: int | None = None,
    phase: str = "quadratic",
) -> torch.Tensor:
    """Launch the decode step on trusted inputs.

    Args:
        q: ``[B, 1, HQ, D]`` float32 / float16 / bfloat16 (cast to ``k_cache.dtype`` for the products).
        k_cache: ``[B, L, H, D]``, ``HQ % H == 0``; any strides (a slice of a preallocated cache is fine).
        v_cache: ``[B, L, H, V]``.
        q_position: ``[B]`` int32/int64; k_positions: ``[B, L]`` int32/int64; cache_mask: ``[B, L]`` bool.
        amp_dim: ``dA``, the amplitude channels; ``dP = D − dA``.
        alpha: exponent of the distance.
        split_size: slots per split, rounded up to a multiple of the tile; by default chosen from ``B·H``
            and the SM count (:func:`decode_split_size`). Tests force small splits to run the merge.
        phase: ``"quadratic"`` or ``"linear"``, as in :func:`attnkit.ops.tapa.tapa_attention`.

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``.
    """
    B, L, H, D = k_cache.shape
    HQ, V = q.shape[2], v_cache.shape[-1]
    G, DA, DP = HQ // H, amp_dim, D - amp_dim
    BN, num_warps, num_stages = decode_config(D, V)
    split_size, S = split_plan(B * H, L, q.device, BN, split_size)
    o = torch.empty(B, 1, HQ, V, dtype=v_cache.dtype, device=q.device)
    o_part, m_part, l_part = partials = split_partials(o, S)
    tapa_decode_kernel[(H, S, B)](
        q, k_cache, v_cache, q_position, k_positions, cache_mask, o, o_part, m_part, l_part,
        L, split_size, float(alpha), DA**-0.5 * LOG2E, phase_variance(phase, DP) ** -0.5,
        q.stride(0), q.stride(2), q.stride(3),
        *k_cache.stride(), *v_cache.stride(), *k_positions.stride(), *cache_mask.stride(),
        o.stride(0), o.stride(2), o.stride(3),
        G=G, DA=DA, DP=DP, V=V, BG=block_dim(G), BDA=block_dim(DA), BDP=block_dim(DP), BV=block_dim(V), BN=BN,
        SPLIT=S > 1, PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32", LINEAR=phase == "linear",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if S > 1:
        merge_splits(partials, o, S)
    return o
