"""Packed-sequence bookkeeping shared by the Triton kernels (imports Triton: only kernel modules import this).

A launch covers ``N`` sequences: the ``B`` rows of a dense batch, or the segments of ``cu_seqlens`` packed
along ``T`` (``B == 1``). Kernels index tokens by ``bos + position`` with 64-bit offsets.
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
