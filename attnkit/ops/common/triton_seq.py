"""Packed-sequence bookkeeping shared by the Triton kernels (imports Triton: only kernel modules import this).

A launch covers ``N`` sequences: the ``B`` rows of a dense batch, or the segments of ``cu_seqlens`` packed
along ``T`` (``B == 1``). Kernels index tokens by ``bos + position`` with 64-bit offsets. A launch over blocks of
positions (:func:`launch_grid`, :func:`program_block`) runs a dense batch as ``(cdiv(T, BLOCK), B * heads)``
programs, the last blocks first (they see the most keys in causal attention), and packed sequences as
``(cdiv(T, BLOCK) + N, heads)`` programs that find their sequence by binary search over the sequences' first
blocks, computed on the device: no launch reads a length on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def seq_layout(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> tuple[int, int]:
    """``(N, longest)``: the number of sequences and the longest one (a host sync with ``cu_seqlens``)."""
    if cu_seqlens is None:
        return batch, seq_len
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return lengths.numel(), int(lengths.max().item()) if lengths.numel() else 0


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """``(bos, length)`` of sequence ``i_n``: the token offset of its first row (int64) and its length."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        return bos, (eos - bos).to(tl.int32)
    return i_n.to(tl.int64) * T, T


@triton.jit
def block_offsets_kernel(cu_seqlens, offsets, N, BLOCK: tl.constexpr, BN: tl.constexpr):
    """``offsets [N + 1]`` int32: the first block of each packed sequence in blocks of ``BLOCK`` positions (the last
    entry the total), in one program that walks the sequences ``BN`` at a time. Grid ``(1,)``."""
    carry = tl.zeros([], dtype=tl.int32)
    tl.store(offsets, carry)
    for start in range(0, N, BN):
        o_n = start + tl.arange(0, BN)
        m_n = o_n < N
        lengths = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0) - tl.load(cu_seqlens + o_n, mask=m_n, other=0)
        counts = tl.where(m_n, (lengths.to(tl.int32) + BLOCK - 1) // BLOCK, 0)
        tl.store(offsets + o_n + 1, carry + tl.cumsum(counts, 0), mask=m_n)
        carry += tl.sum(counts, 0)


def block_offsets(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    """The first block of each packed sequence cut into blocks of ``block`` positions, ``[N+1]`` int32 (the last
    entry the total), computed on the device by one kernel (no host sync, no tensor ops). A launch over
    ``cdiv(T, block) + N`` programs covers every block of every sequence; :func:`locate_block` maps a program to its
    block."""
    N = cu_seqlens.numel() - 1
    offsets = torch.empty(N + 1, dtype=torch.int32, device=cu_seqlens.device)
    block_offsets_kernel[(1,)](cu_seqlens, offsets, N, BLOCK=block, BN=1024)
    return offsets


@triton.jit
def locate_block(offsets, i_p, N, LOG_N: tl.constexpr):
    """The sequence of global block ``i_p`` and the block's index in it, by binary search over ``offsets``
    (:func:`block_offsets`; ``LOG_N = N.bit_length()`` steps): the last ``n`` with ``offsets[n] <= i_p``, which
    skips empty sequences. Blocks past the total give ``n = N``."""
    lo = i_p * 0
    hi = lo + N
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi + 1) // 2
        below = tl.load(offsets + mid) <= i_p
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo, i_p - tl.load(offsets + lo)


@triton.jit
def program_block(cu_seqlens, offsets, N, T, HEADS: tl.constexpr, LOG_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """``(i_b, i_head, bos, L, i_blk)`` of a program of a :func:`launch_grid` launch: its batch row (int64), head,
    the token offset of its sequence within the row (int64), the sequence's length (0 for programs past the last
    block) and the block's index in the sequence."""
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
