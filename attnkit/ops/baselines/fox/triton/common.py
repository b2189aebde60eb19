"""What the FoX kernels share: which block of which sequence a program owns, and the gate's cumulative sums.

A dense batch launches ``(cdiv(T, BLOCK), B * heads)`` programs, the last blocks first (they see the most keys);
packed sequences launch ``(cdiv(T, BLOCK) + N, heads)`` and find their sequence by binary search over the
sequences' first blocks (``block_offsets``, computed on the device), so no launch reads a length on the host.
Tensors are addressed through their strides: ``[B, T, H, D]`` inputs need not be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import block_offsets, locate_block


@triton.jit
def program_block(cu_seqlens, offsets, N, T, HEADS: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(i_b, i_head, bos, L, i_blk)`` of the program: its batch row (int64), head, the token offset of its
    sequence within the row (int64), the sequence's length (0 for programs past the last block) and the block's
    index in the sequence."""
    if IS_VARLEN:
        i_n, i_blk = locate_block(offsets, tl.num_programs(0) - 1 - tl.program_id(0), N, LOG_N)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + tl.minimum(i_n + 1, N)) - bos).to(tl.int32)
        i_b, i_head = bos * 0, tl.program_id(1)
    else:
        i_bh = tl.program_id(1)
        i_blk = tl.num_programs(0) - 1 - tl.program_id(0)
        i_b, i_head, L = (i_bh // HEADS).to(tl.int64), i_bh % HEADS, T
        bos = i_b * 0
    return i_b, i_head, bos, L, i_blk


def launch_grid(cu_seqlens: torch.Tensor | None, B: int, T: int, heads: int, block: int):
    """``(grid, offsets, N, LOG_N)`` of a launch over the blocks of ``block`` positions of every sequence."""
    if cu_seqlens is None:
        return (triton.cdiv(T, block), B * heads), None, B, 1
    N = cu_seqlens.numel() - 1
    return (triton.cdiv(T, block) + N, heads), block_offsets(cu_seqlens, block), N, N.bit_length()


@triton.jit
def gate_cumsum_kernel(
    x, y, cu_seqlens, T, scale, sxb, sxt, sxh,
    HQ: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``y = scale · cumsum(x)`` along each sequence (``REVERSE``: the sums from each token to the sequence's end),
    float32 accumulation; ``x [B, T, HQ]`` through its strides, ``y [B, T, HQ]`` contiguous in its own dtype.
    Grid ``(N, cdiv(HQ, BH))``: one program scans one sequence for ``BH`` heads, ``BT`` tokens a step."""
    i_n, i_hb = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        i_b = 0
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        L = (tl.load(cu_seqlens + i_n + 1) - bos).to(tl.int32)
    else:
        i_b, bos, L = i_n.to(tl.int64), 0, T
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < HQ
    b_carry = tl.zeros([BH], dtype=tl.float32)
    for start in range(0, L, BT):
        # In reverse, the rows run from the end: a forward scan over them is the suffix sum.
        o_t = L - 1 - start - tl.arange(0, BT) if REVERSE else start + tl.arange(0, BT)
        mask = ((o_t >= 0) & (o_t < L))[:, None] & m_h[None, :]
        p_t = bos + o_t.to(tl.int64)
        b_x = tl.load(x + i_b * sxb + p_t[:, None] * sxt + o_h[None, :] * sxh, mask=mask, other=0.0).to(tl.float32)
        b_y = tl.cumsum(b_x, 0) + b_carry[None, :]
        tl.store(y + (i_b * T + p_t)[:, None] * HQ + o_h[None, :], (b_y * scale).to(y.dtype.element_ty), mask=mask)
        b_carry += tl.sum(b_x, 0)


def gate_cumsum(
    x: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, reverse: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``scale ·`` the cumulative (``reverse``: suffix) sums of ``x [B, T, HQ]`` within each sequence, contiguous
    ``[B, T, HQ]`` in ``dtype``."""
    B, T, HQ = x.shape
    y = torch.empty(B, T, HQ, dtype=dtype, device=x.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    BH = min(triton.next_power_of_2(HQ), 16)
    gate_cumsum_kernel[(N, triton.cdiv(HQ, BH))](
        x, y, cu_seqlens, T, scale, *x.stride(), HQ=HQ, BT=64, BH=BH, REVERSE=reverse,
        IS_VARLEN=cu_seqlens is not None,
    )  # fmt: skip
    return y
