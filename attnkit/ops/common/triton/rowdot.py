"""``delta = rowsum(dO ⊙ O)``, the softmax backward's row term, in one kernel for every attention op's backward
(FlashAttention's preprocessing step): both tensors read through their strides, the products summed in float32,
``delta`` written token-major ``[B, T, HQ]`` or head-major ``[HQ, B·T]``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import block_dim


@triton.jit
def rowdot_kernel(
    o, do, delta, T, sob, sot, soh, sov, sdb, sdt, sdh, sdv, seb, set_, seh,
    HQ: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """``delta[b, t, h] = Σ_v o[b, t, h, v] · do[b, t, h, v]`` in float32, every tensor through its strides (``s·b``,
    ``s·t``, ``s·h``, ``s·v``; ``delta``'s ``seb``, ``set_``, ``seh``). Grid ``(cdiv(T, BT), B * HQ)``."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_hq = (i_bh // HQ).to(tl.int64), i_bh % HQ
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_v = tl.arange(0, BV)
    m_t = o_t < T
    mask = m_t[:, None] & (o_v < V)[None, :]
    p_o = o + i_b * sob + i_hq * soh + o_t[:, None] * sot + o_v[None, :] * sov
    p_do = do + i_b * sdb + i_hq * sdh + o_t[:, None] * sdt + o_v[None, :] * sdv
    b_o = tl.load(p_o, mask=mask, other=0.0).to(tl.float32)
    b_do = tl.load(p_do, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta + i_b * seb + i_hq * seh + o_t * set_, tl.sum(b_o * b_do, 1), mask=m_t)


def output_delta(o: torch.Tensor, do: torch.Tensor, head_major: bool = False) -> torch.Tensor:
    """``rowsum(dO ⊙ O)`` of ``o, do [B, T, HQ, V]`` (any strides) in float32: ``[B, T, HQ]``, or with ``head_major``
    ``[HQ, B·T]`` (row ``h``, column ``b·T + t``)."""
    B, T, HQ, V = o.shape
    if head_major:
        delta = torch.empty(HQ, B * T, dtype=torch.float32, device=o.device)
        strides = (T, 1, B * T)
    else:
        delta = torch.empty(B, T, HQ, dtype=torch.float32, device=o.device)
        strides = (T * HQ, HQ, 1)
    if delta.numel():
        BT = 64
        rowdot_kernel[(triton.cdiv(T, BT), B * HQ)](
            o, do, delta, T, *o.stride(), *do.stride(), *strides, HQ=HQ, V=V, BV=block_dim(V), BT=BT
        )
    return delta
