"""VLA decode step in one kernel: the recurrence of SPEC §4 for one token, one program per (sequence, head).

The same arithmetic as the PyTorch step (``attnkit/ops/vla/decoding.py``): ``z = A u``, ``A k̂`` and
``a = A k̂ − z (zᵀk̂)/(1 + uᵀz)`` from one read of ``A``; ``S k̂``, ``S q`` from one read of ``S``; the new ``A``,
``S`` and ``n`` written once. A step reads and writes the state once, so it is bound by memory bandwidth:
``(K² + V·K) · 4`` bytes each way per head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def vla_decode_kernel(
    q, k, v, u, s_in, a_in, n_in, o, s_out, a_out, n_out, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NORMALIZE: tl.constexpr,
    NORMALIZE_WRITE: tl.constexpr,
):  # fmt: skip
    """``q, k, u [BH, K]``, ``v [BH, V]``, states ``S [BH, V, K]``, ``A [BH, K, K]``, ``n [BH, K]`` float32 ->
    ``o [BH, V]`` and the new states (float32). Grid ``(BH,)``."""
    i_bh = tl.program_id(0).to(tl.int64)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_u = tl.load(u + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    m_kk = m_k[:, None] & m_k[None, :]
    p_a = i_bh * K * K + o_k[:, None] * K + o_k[None, :]
    b_a = tl.load(a_in + p_a, mask=m_kk, other=0.0)
    m_vk = m_v[:, None] & m_k[None, :]
    p_s = i_bh * V * K + o_v[:, None] * K + o_k[None, :]
    b_s = tl.load(s_in + p_s, mask=m_vk, other=0.0)

    b_kh = b_k / tl.sqrt(tl.sum(b_k * b_k, 0))
    # A is symmetric, so A x is a column sum as well as a row sum: reduce along axis 0 to get row-indexed
    # vectors laid out like the columns, the layout every later product needs.
    b_z = tl.sum(b_a * b_u[:, None], 0)
    b_ak = tl.sum(b_a * b_kh[:, None], 0)
    b_c = 1.0 + tl.sum(b_u * b_z, 0)
    b_alpha = b_ak - b_z * (tl.sum(b_kh * b_z, 0) / b_c)
    if NORMALIZE_WRITE:
        b_alpha = b_alpha / tl.sqrt(tl.sum(b_alpha * b_alpha, 0))
    b_zs = b_z / tl.sqrt(b_c)
    tl.store(a_out + p_a, b_a - b_zs[:, None] * b_zs[None, :], mask=m_kk)

    b_sk = tl.sum(b_s * b_kh[None, :], 1)
    b_sq = tl.sum(b_s * b_q[None, :], 1)
    b_delta = b_v - b_sk
    tl.store(s_out + p_s, b_s + b_delta[:, None] * b_alpha[None, :], mask=m_vk)
    b_o = b_sq + b_delta * tl.sum(b_alpha * b_q, 0)
    b_n = tl.load(n_in + i_bh * K + o_k, mask=m_k, other=0.0) + b_k
    tl.store(n_out + i_bh * K + o_k, b_n, mask=m_k)
    if NORMALIZE:
        b_o = b_o / tl.maximum(tl.sum(b_n * b_q, 0), eps)
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def vla_decode_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    S: torch.Tensor,
    A: torch.Tensor,
    n: torch.Tensor,
    eps: float,
    normalize_output: bool,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, u [B, 1, H, K]``, ``v [B, 1, H, V]``, float32 states ``S [B,H,V,K]``, ``A [B,H,K,K]``,
    ``n [B,H,K]`` -> ``(o [B, 1, H, V] in v.dtype, S, A, n)`` (new float32 tensors); ``normalize_write``: the
    write direction is ``a / ‖a‖`` (else ``a``)."""
    B, _, H, K = k.shape
    V = v.shape[-1]
    q, k, v, u = (x.contiguous() for x in (q, k, v, u))
    S, A, n = (x.contiguous() for x in (S, A, n))
    o = torch.empty(B, 1, H, V, dtype=v.dtype, device=v.device)
    s_out, a_out, n_out = torch.empty_like(S), torch.empty_like(A), torch.empty_like(n)
    BK, BV = block_dim(K), block_dim(V)
    vla_decode_kernel[(B * H,)](
        q, k, v, u, S, A, n, o, s_out, a_out, n_out, eps,
        K=K, V=V, BK=BK, BV=BV, NORMALIZE=normalize_output,
        NORMALIZE_WRITE=normalize_write, num_warps=4 if max(BK, BV) <= 64 else 8,
    )  # fmt: skip
    return o, s_out, a_out, n_out
