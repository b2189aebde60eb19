"""VLA's unit keys in kernels: ``k̂_t = k_t / ‖k_t‖`` row by row, and its backward
``dk_t = (dk̂_t − k̂_t (k̂_t·dk̂_t)) / ‖k_t‖`` (the Jacobian of the normalisation, a projection off ``k̂_t``).
With a floor ``eps`` and a ``scale`` the same kernels give ``scale · x / max(‖x‖, eps)`` (``F.normalize`` times a
constant: the layer's penalty directions ``u``), whose gradient is ``scale · dy / eps`` on rows at the floor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import block_dim

ROWS = 64  # rows a program


@triton.jit
def token_rows(i_r, R, T, H, sb, st, sh, sd, o_k, K: tl.constexpr, BR: tl.constexpr):
    """``(offsets, mask, rows)`` of the ``BR`` rows from ``i_r·BR`` of the ``R`` rows of a ``[B, T, H, K]`` tensor of
    strides ``(sb, st, sh, sd)``, counted in ``(b, t, h)`` order (64-bit)."""
    o_r = i_r.to(tl.int64) * BR + tl.arange(0, BR)
    i_h = o_r % H
    i_t = (o_r // H) % T
    i_b = o_r // H // T
    p = (i_b * sb + i_t * st + i_h * sh)[:, None] + o_k[None, :] * sd
    return p, (o_r < R)[:, None] & (o_k < K)[None, :], o_r


@triton.jit
def unit_rows_fwd_kernel(
    x, y, norm, R, T, H, sxb, sxt, sxh, sxd, eps, scale, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr
):  # fmt: skip
    """``x [B, T, H, K]`` (strided, any float dtype; ``R = B·T·H`` rows) -> ``y = x / max(‖x‖, eps) · scale`` row by
    row (``[B, T, H, K]`` contiguous, float32) and ``norm = ‖x‖ [B, T, H]``. Grid ``(⌈R / BR⌉,)``."""
    o_k = tl.arange(0, BK)
    p_x, m_x, o_r = token_rows(tl.program_id(0), R, T, H, sxb, sxt, sxh, sxd, o_k, K, BR)
    b_x = tl.load(x + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_n = tl.sqrt(tl.sum(b_x * b_x, 1))
    p_y = o_r[:, None] * K + o_k[None, :]
    tl.store(y + p_y, b_x / tl.maximum(b_n, eps)[:, None] * scale, mask=m_x)
    tl.store(norm + o_r, b_n, mask=o_r < R)


@triton.jit
def unit_rows_bwd_kernel(
    y, norm, dy, dx, R, eps, scale, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr
):  # fmt: skip
    """``dx = (dy − ŷ (ŷ·dy)) / ‖x‖ · scale`` row by row, ``ŷ = y / scale`` (``dx`` in its dtype; every tensor
    contiguous), ``dy / eps · scale`` on rows at the floor. Grid ``(⌈R / BR⌉,)``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    p_x = o_r[:, None] * K + o_k[None, :]
    m_x = (o_r < R)[:, None] & (o_k < K)[None, :]
    b_y = tl.load(y + p_x, mask=m_x, other=0.0)
    b_dy = tl.load(dy + p_x, mask=m_x, other=0.0).to(tl.float32)
    b_n = tl.load(norm + o_r, mask=o_r < R, other=1.0)
    b_proj = tl.where(b_n > eps, tl.sum(b_y * b_dy, 1) / (scale * scale), 0.0)
    b_dx = (b_dy - b_y * b_proj[:, None]) / tl.maximum(b_n, eps)[:, None] * scale
    tl.store(dx + p_x, b_dx.to(dx.dtype.element_ty), mask=m_x)


def unit_rows_fwd_fn(x: torch.Tensor, eps: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, T, H, K]`` (any strides) -> ``(x / max(‖x‖, eps) · scale [B, T, H, K]`` contiguous float32,
    ``‖x‖ [B, T, H]`` float32``)``."""
    B, T, H, K = x.shape
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    norm = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    R = B * T * H
    if R > 0:  # no empty launch (the layer's u of an empty batch comes here)
        unit_rows_fwd_kernel[(triton.cdiv(R, ROWS),)](
            x, y, norm, R, T, H, *x.stride(), eps, scale, K=K, BK=block_dim(K), BR=ROWS
        )  # fmt: skip
    return y, norm


def unit_rows_bwd_fn(
    y: torch.Tensor, norm: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, eps: float = 0.0, scale: float = 1.0
) -> torch.Tensor:
    """The gradient of ``x`` (``[B, T, H, K]`` contiguous, in ``dtype``) from the forward's ``y``, ``norm`` and
    ``dy`` (contiguous), ``eps`` and ``scale`` as the forward's."""
    K = y.shape[-1]
    R = y.numel() // max(K, 1)
    dx = torch.empty(y.shape, dtype=dtype, device=y.device)
    if R > 0:
        unit_rows_bwd_kernel[(triton.cdiv(R, ROWS),)](y, norm, dy, dx, R, eps, scale, K=K, BK=block_dim(K), BR=ROWS)
    return dx
