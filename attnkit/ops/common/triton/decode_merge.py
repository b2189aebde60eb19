"""The merge of split-KV decoding ("flash-decoding"): the float32 partials of each cache split combined.

Shared by the decode kernels of every softmax-type op (TAPA, PaTH): a split writes its unnormalised output
``acc``, its base-2 running max ``m`` and its sum ``l``, row ``(batch · HQ + query head) · S + split``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnkit.ops.common.triton_utils import interpreting, multiprocessors

# Slots per split when B·H alone leaves SMs idle. Measured on an H200 (bf16, D = 64 and 128, B·H from 8 to
# 128, caches of 4k to 128k): 1k-2k-slot splits are within 5% of the best split of every shape, while splits
# sized to "just fill the GPU" lose up to 40% to the tail of a partial second wave; many short splits keep
# that tail short. The merge reads B·HQ·(L/1024)·V floats, under 1% of the cache.
SPLIT_SIZE = 1024


@triton.jit
def decode_softmax_step(b_s, b_v, b_acc, b_m, b_l, PRECISION: tl.constexpr):
    """Fold one tile of base-2 logits ``b_s [BG, BN]`` (``-inf`` where invisible) and its values into the running
    ``(acc, max, sum)`` of a split. A split may have seen only invisible slots so far (left padding): the
    reference max stays finite so that ``exp2`` never sees ``(-inf) − (-inf)``."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_m_ref[:, None])
    b_rescale = tl.exp2(b_m - b_m_ref)
    b_l = b_l * b_rescale + tl.sum(b_p, 1)
    b_acc = b_acc * b_rescale[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_acc, b_m_new, b_l


@triton.jit
def decode_store(
    b_acc, b_m, b_l, o_part, m_part, l_part, p_o, m_o, row, m_g, o_v, V: tl.constexpr, SPLIT: tl.constexpr
):
    """The end of a split: its float32 partials at ``row · S + split`` (``row = batch · HQ + query head``), or,
    with one split, the normalised output at the pointers ``p_o``."""
    if SPLIT:
        o_row = row * tl.num_programs(1) + tl.program_id(1)
        tl.store(o_part + o_row[:, None] * V + o_v[None, :], b_acc, mask=m_o)
        tl.store(m_part + o_row, b_m, mask=m_g)
        tl.store(l_part + o_row, b_l, mask=m_g)
    else:
        tl.store(p_o, (b_acc / b_l[:, None]).to(p_o.dtype.element_ty), mask=m_o)


@triton.jit
def decode_merge_kernel(
    o_part, m_part, l_part, o, S, stride_ob, stride_oh, stride_od,
    HQ: tl.constexpr, V: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Softmax-weighted sum of the ``S`` split partials of one (batch, query head, channel block).
    Grid ``(cdiv(V, BV), HQ, B)``; writes ``o [B, 1, HQ, V]``."""
    i_v, i_hq, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_s = tl.arange(0, BS)
    o_v = i_v * BV + tl.arange(0, BV)
    m_s, m_v = o_s < S, o_v < V
    o_row = (i_b.to(tl.int64) * HQ + i_hq) * S + o_s
    b_m = tl.load(m_part + o_row, mask=m_s, other=float("-inf"))
    b_l = tl.load(l_part + o_row, mask=m_s, other=0.0)
    # A split that saw no visible slot has max -inf and weight 0 (some split always sees one).
    b_w = tl.exp2(b_m - tl.max(b_m, 0))
    b_acc = tl.load(o_part + o_row[:, None] * V + o_v[None, :], mask=m_s[:, None] & m_v[None, :], other=0.0)
    b_o = tl.sum(b_w[:, None] * b_acc, 0) / tl.sum(b_w * b_l, 0)
    p_o = o + i_b.to(tl.int64) * stride_ob + i_hq * stride_oh + o_v * stride_od
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_v)


def decode_split_size(batch_heads: int, length: int, device: torch.device) -> int:
    """Slots per split: the whole cache when ``B·H`` programs already cover every SM four times over,
    ``SPLIT_SIZE`` otherwise."""
    fill = max(1, multiprocessors(device))  # one under the interpreter: there is nothing to fill
    return max(length, 1) if batch_heads >= 4 * fill else SPLIT_SIZE


def split_partials(o: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o_part [B, HQ, S, V], m_part, l_part [B, HQ, S])`` float32 for ``S > 1`` splits of a decode step whose
    output is ``o [B, 1, HQ, V]``; with one split the kernel writes ``o`` itself and the partials are unused."""
    if splits == 1:
        return o, o, o
    B, _, HQ, V = o.shape
    f32 = dict(dtype=torch.float32, device=o.device)
    return torch.empty(B, HQ, splits, V, **f32), torch.empty(B, HQ, splits, **f32), torch.empty(B, HQ, splits, **f32)


def merge_splits(partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor], o: torch.Tensor, splits: int) -> None:
    """Write ``o [B, 1, HQ, V]`` from the partials of ``splits > 1`` splits (:func:`split_partials`)."""
    B, _, HQ, V = o.shape
    BS = triton.next_power_of_2(splits)
    # Keep the [BS, BV] merge tile within a few thousand registers' worth of values.
    BV = min(triton.next_power_of_2(V), max(16, 4096 // BS))
    decode_merge_kernel[(triton.cdiv(V, BV), HQ, B)](
        *partials, o, splits, o.stride(0), o.stride(2), o.stride(3),
        HQ=HQ, V=V, BS=BS, BV=BV, num_warps=1 if interpreting() else 4,
    )  # fmt: skip


def decode_config(head_dim: int, value_dim: int) -> tuple[int, int, int]:
    """``(BN, num_warps, num_stages)`` of a split-KV decode kernel. Measured on an H200 (TAPA, bf16, D = 64 and
    128): 64-slot tiles in three stages with four warps are the best or within 6% of it. Wider heads
    (unmeasured) halve the tile to keep three stages of keys and values in shared memory. The interpreter runs
    one program at a time, unstaged, on 16-slot tiles so that small tests cross tiles and splits."""
    if interpreting():
        return 16, 1, 1
    return (64 if max(head_dim, value_dim) <= 128 else 32), 4, 3


def split_plan(
    batch_heads: int, length: int, device: torch.device, tile: int, split_size: int | None = None
) -> tuple[int, int]:
    """``(slots per split, splits)`` of a cache of ``length`` slots: ``split_size`` (tests force it) or
    :func:`decode_split_size`, rounded up to whole tiles."""
    if split_size is None:
        split_size = decode_split_size(batch_heads, length, device)
    split_size = triton.cdiv(max(split_size, 1), tile) * tile
    return split_size, max(triton.cdiv(length, split_size), 1)
