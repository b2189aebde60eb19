"""LayerNorm over the last dim of a ``[M, N]`` matrix in two kernels: the forward reads ``x`` in its dtype through
its strides, takes each row's statistics in float32 and writes ``y = (x − μ) · rstd · w + b`` directly in the
dtype asked for (an autocast dtype, say: no float32 copy of ``x`` and no cast of ``y`` around it), keeping ``μ``
and ``rstd`` for the backward. The backward writes ``dx = rstd · (w·dy − x̂ · mean(x̂ · w·dy) − mean(w·dy))`` row by
row, ``x̂ = (x − μ) · rstd``, and each program's float32 partial sums of ``dy · x̂`` and ``dy`` over the blocks of
rows it walks (``dw`` and ``db``, summed over the programs afterwards)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import block_dim, multiprocessors

MAX_N = 16384  # a row is one block: the widest the kernels hold in registers
ELEMENTS = 4096  # a block's elements at the least: rows a block = ELEMENTS // BN for narrow rows


def block_shape(N: int) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)``: the rows and columns of a block (``BN`` covers ``N``) and its warps, about 16
    elements a thread."""
    BN = block_dim(N, 1)
    BM = max(1, ELEMENTS // BN)
    return BM, BN, max(4, min(16, BM * BN // 512))


@triton.jit
def layer_norm_fwd_kernel(
    x, w, b, y, mean, rstd, M, sxm, sxn, eps, N: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """``x [M, N]`` (strides ``sxm, sxn``, any float dtype), ``w, b [N]`` -> ``y [M, N]`` contiguous in its dtype,
    ``mean, rstd [M]`` float32. Grid ``(⌈M / BM⌉,)``."""
    o_m = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    m_x = m_m[:, None] & m_n[None, :]
    b_x = tl.load(x + o_m[:, None] * sxm + o_n[None, :] * sxn, mask=m_x, other=0.0).to(tl.float32)
    b_mean = tl.sum(b_x, 1) / N
    b_xc = tl.where(m_x, b_x - b_mean[:, None], 0.0)
    b_rstd = tl.rsqrt(tl.sum(b_xc * b_xc, 1) / N + eps)
    b_w = tl.load(w + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_y = b_xc * b_rstd[:, None] * b_w[None, :]
    if HAS_BIAS:
        b_y += tl.load(b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y + o_m[:, None] * N + o_n[None, :], b_y.to(y.dtype.element_ty), mask=m_x)
    tl.store(mean + o_m, b_mean, mask=m_m)
    tl.store(rstd + o_m, b_rstd, mask=m_m)


@triton.jit
def layer_norm_bwd_kernel(
    x, w, dy, mean, rstd, dx, dw, db, M, sxm, sxn, sdm, sdn, N: tl.constexpr, BN: tl.constexpr,
    BM: tl.constexpr,
):  # fmt: skip
    """``dx [M, N]`` contiguous in its dtype from ``x`` and ``dy`` (their strides, any float dtypes), ``mean``,
    ``rstd``, ``w``; ``dw, db [P, N]`` float32: program ``p``'s sums over the blocks ``p, p + P, …`` of ``BM`` rows.
    Grid ``(P,)``."""
    i_p, n_p = tl.program_id(0), tl.num_programs(0)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    b_w = tl.load(w + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BM, BN], dtype=tl.float32)
    b_db = tl.zeros([BM, BN], dtype=tl.float32)
    for i_m in range(i_p, tl.cdiv(M, BM), n_p):
        o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)  # M < 2³¹: the offsets' products in 64 bits
        m_m = o_m < M
        m_x = m_m[:, None] & m_n[None, :]
        b_x = tl.load(x + o_m[:, None] * sxm + o_n[None, :] * sxn, mask=m_x, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + o_m[:, None] * sdm + o_n[None, :] * sdn, mask=m_x, other=0.0).to(tl.float32)
        b_mean = tl.load(mean + o_m, mask=m_m, other=0.0)
        b_rstd = tl.load(rstd + o_m, mask=m_m, other=0.0)
        b_xhat = tl.where(m_x, (b_x - b_mean[:, None]) * b_rstd[:, None], 0.0)
        b_wdy = b_w[None, :] * b_dy
        b_c1 = tl.sum(b_xhat * b_wdy, 1) / N
        b_c2 = tl.sum(b_wdy, 1) / N
        b_dx = (b_wdy - b_xhat * b_c1[:, None] - b_c2[:, None]) * b_rstd[:, None]
        tl.store(dx + o_m[:, None] * N + o_n[None, :], b_dx.to(dx.dtype.element_ty), mask=m_x)
        b_dw += b_dy * b_xhat
        b_db += b_dy
    tl.store(dw + i_p * N + o_n, tl.sum(b_dw, 0), mask=m_n)
    tl.store(db + i_p * N + o_n, tl.sum(b_db, 0), mask=m_n)


def layer_norm_fwd_fn(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, N]`` (any strides, any float dtype), ``weight, bias [N]`` (``bias`` or None) -> ``(y [M, N]``
    contiguous in ``out_dtype``, ``mean [M]``, ``rstd [M]`` float32``)``."""
    M, N = x.shape
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M > 0:
        BM, BN, warps = block_shape(N)
        layer_norm_fwd_kernel[(triton.cdiv(M, BM),)](
            x, weight, weight if bias is None else bias, y, mean, rstd, M, *x.stride(), eps, N=N, BN=BN, BM=BM,
            HAS_BIAS=bias is not None, num_warps=warps,
        )  # fmt: skip
    return y, mean, rstd


def layer_norm_bwd_fn(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [M, N]`` contiguous in ``x``'s dtype, ``dweight [N]``, ``dbias [N]`` in ``weight``'s``)`` from ``dy``
    and ``x`` (any strides and float dtypes) and the forward's ``mean``, ``rstd``; zeros for ``dweight`` and
    ``dbias`` when ``M = 0``. Two programs a multiprocessor each walk every ``P``-th block of rows (two under the
    interpreter, so that tests cross programs)."""
    M, N = x.shape
    BM, BN, warps = block_shape(N)
    P = min(triton.cdiv(M, BM), 2 * max(multiprocessors(x.device), 1))
    dx = torch.empty(M, N, dtype=x.dtype, device=x.device)
    dw = torch.empty(P, N, dtype=torch.float32, device=x.device)
    db = torch.empty(P, N, dtype=torch.float32, device=x.device)
    if P > 0:
        layer_norm_bwd_kernel[(P,)](
            x, weight, dy, mean, rstd, dx, dw, db, M, *x.stride(), *dy.stride(), N=N, BN=BN, BM=BM, num_warps=warps
        )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype)
