"""What the FoX kernels share: which block of which sequence a program owns.

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
