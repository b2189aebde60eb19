"""Cumulative sums along each sequence of a dense batch or of packed sequences, in one launch: the gates'
prefix sums (``G_i = Σ_{j<=i} g_j``) and, in the backward, their gradient's suffix sums (the sums from each token to
its sequence's end). ``x [B, T, H]`` is read through its strides; float32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_seq import seq_bounds


@triton.jit
def segment_cumsum_kernel(
    x, y, cu_seqlens, T, scale, sxb, sxt, sxh,
    HQ: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """``y = scale · cumsum(x)`` along each sequence (``REVERSE``: the sums from each token to the sequence's end),
    float32 accumulation; ``x [B, T, HQ]`` through its strides, ``y [B, T, HQ]`` contiguous in its own dtype.
    Grid ``(N, cdiv(HQ, BH))``: one program scans one sequence for ``BH`` heads, ``BT`` tokens a step."""
    i_n, i_hb = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        bos, L = seq_bounds(cu_seqlens, i_n, T, True)
        i_b = 0
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


# The tile a program scans a step: at most TILE_ELEMENTS numbers, BH heads by BT tokens. A program's steps run one
# after another (each waits for its loads), so a scan takes about cdiv(T, BT) load latencies whatever the GPU: the
# first version's fixed [64, 16] tile made a [4, 4096, 16] scan 64 dependent steps on 4 programs, about 80 µs a call
# on the H200 (twelve calls a PaTH-FoX training step: 0.97 ms of its 72.8, train_throughput_profile_session10_h200).
# Fewer heads a program (MAX_HEADS) make the tile longer in T and the programs more. Timed on an H100 (thirty-fifth
# session, benchmarks/scan_tune.py, µs, the [64, 16] tile -> 4 heads by 2048 -> 2 heads by 4096 tokens): [4, 4096, 16]
# 71.7 -> 14.2 -> 12.4; [8, 4096, 16] 71.0 -> 15.0 -> 12.5; [1, 32768, 16] 514 -> 78.4 -> 57.7, packed into 8
# sequences 232 -> 40.5 -> 30.0 (one head by 8192: 56.6 / 27.8, but 14.9 at [8, 4096, 16]).
TILE_ELEMENTS = 8192
MAX_HEADS = 2
NUM_WARPS = 4


def launch_config(T: int, HQ: int) -> dict[str, int]:
    """``BH`` (heads a program), ``BT`` (tokens a step) and ``num_warps`` of :func:`segment_cumsum_kernel` for
    ``[*, T, HQ]``: ``BT`` a power of two bucketed on ``T`` (at least 16, at most ``TILE_ELEMENTS // BH``)."""
    BH = min(triton.next_power_of_2(HQ), MAX_HEADS)
    BT = max(16, min(triton.next_power_of_2(max(T, 1)), TILE_ELEMENTS // BH))
    return dict(BH=BH, BT=BT, num_warps=NUM_WARPS)


def segment_cumsum(
    x: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, reverse: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``scale ·`` the cumulative (``reverse``: suffix) sums of ``x [B, T, HQ]`` within each sequence, contiguous
    ``[B, T, HQ]`` in ``dtype``. One launch of ``N × ⌈HQ / BH⌉`` programs (:func:`launch_config`)."""
    B, T, HQ = x.shape
    y = torch.empty(B, T, HQ, dtype=dtype, device=x.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    config = launch_config(T, HQ)
    segment_cumsum_kernel[(N, triton.cdiv(HQ, config["BH"]))](
        x, y, cu_seqlens, T, scale, *x.stride(), HQ=HQ, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None, **config
    )  # fmt: skip
    return y
