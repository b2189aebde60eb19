"""Blockwise stick-breaking attention in PyTorch: forward and backward, one query block × key block at a time.

``README.md`` beside this file derives both passes. Inside, the query heads are grouped by key/value head:
``q [B, H, G, T, K]``, ``k [B, H, 1, T, K]``, ``v [B, H, 1, T, V]``, so GQA broadcasts without copying keys.
No tensor larger than ``[B, H, G, BT, BS]`` (a block of weights) or ``[B, H, G, T, ·]`` (the inputs) is formed,
and the backward recomputes the weights block by block instead of saving them: memory is linear in ``T``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from attnkit.ops.common.utils import autocast_off, compute_dtype

BLOCK_SIZE = 64


def logsigmoid(x: torch.Tensor) -> torch.Tensor:
    """``log sigmoid(x) = min(x, 0) − log1p(exp(−|x|))``: exact at ``±inf`` (−inf and 0).

    Not ``F.logsigmoid``: on CPU (torch 2.13) it enters an OpenMP parallel region at every call whatever the size,
    which costs milliseconds on busy cores (20 ms a call measured on 2 loaded cores, against microseconds here), and
    the scan calls it twice a block."""
    return x.clamp(max=0) - torch.log1p(torch.exp(-x.abs()))


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``y[..., j] = Σ_{l >= j} x[..., l]`` along the last dim (keys to the right of ``j``, ``j`` included)."""
    return x.flip(-1).cumsum(-1).flip(-1)


def stick_log_weights(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``z [..., L]`` (−inf for keys not seen) of one query against keys in order -> ``log A [..., L]``, with
    ``log A_j = log beta_j + Σ_{l > j} log(1 − beta_l)`` (the stick that the keys right of ``j`` left over), and
    ``Σ_l log(1 − beta_l)`` ``[...]``, the stick all of them leave over."""
    log_keep = logsigmoid(-z)  # log(1 − beta); 0 for an unseen key, which breaks nothing off
    keep = _suffix_sum(log_keep)
    after = F.pad(keep[..., 1:], (0, 1))
    return logsigmoid(z) + after, keep[..., 0]


def key_blocks(i0: int, i1: int, attend_current: bool, block_size: int) -> list[tuple[int, int]]:
    """The key blocks ``(j0, j1)`` that queries ``i0 .. i1-1`` read, from the diagonal leftwards.

    Blocks are aligned on the last visible key (``i1 - 1``, or ``i1 - 2`` when a query does not read itself), so
    only the first block meets the causal mask."""
    end = i1 if attend_current else i1 - 1
    return [(max(j1 - block_size, 0), j1) for j1 in range(end, 0, -block_size)]


def block_weights(
    qb: torch.Tensor,
    kb: torch.Tensor,
    i0: int,
    j0: int,
    scale: float,
    attend_current: bool,
    survival: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stick-breaking weights of queries ``i0 ..`` against keys ``j0 ..``, given the log of the stick the keys to
    the right of the block left over (``survival [B, H, G, BT]``, ``Σ_l log(1 − beta_il)``).

    Returns ``(A, z, keep)``: the weights ``A = exp(log beta_ij + Σ_{l > j in block} log(1 − beta_il) + survival)``
    ``[B, H, G, BT, BS]`` (0 for keys a query does not see), the masked logits ``z`` (−inf there) and the block's
    own ``Σ_l log(1 − beta_il)`` ``[B, H, G, BT]`` to add to ``survival``. Everything stays in log space up to the
    last ``exp``, whose argument is ``<= 0``.
    """
    z = scale * (qb @ kb.transpose(-1, -2))
    BT, BS = z.shape[-2:]
    if j0 + BS - 1 >= i0 + attend_current:  # the block's last key is hidden from its first query
        i = torch.arange(i0, i0 + BT, device=z.device)[:, None]
        j = torch.arange(j0, j0 + BS, device=z.device)[None, :]
        visible = j <= i if attend_current else j < i
        z = z.masked_fill(~visible, float("-inf"))
    log_A, keep = stick_log_weights(z)
    return torch.exp(log_A + survival[..., None]), z, keep


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
    """``[B, T, HQ, K]``, ``[B, T, H, ·]`` -> ``q [B, H, G, T, K]``, ``k, v [B, H, 1, T, ·]`` in ``dtype``."""
    B, T, HQ, K = q.shape
    H = k.shape[2]
    q = q.to(dtype).reshape(B, T, H, HQ // H, K).permute(0, 2, 3, 1, 4)
    k, v = (x.to(dtype).transpose(1, 2).unsqueeze(2) for x in (k, v))
    return q, k, v


@autocast_off
def stickbreaking_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attend_current: bool, block_size: int
) -> torch.Tensor:
    """Grouped ``q [B, H, G, T, K]``, ``k [B, H, 1, T, K]``, ``v [B, H, 1, T, V]`` (one dtype) -> ``o [B, H, G, T, V]``.

    Per query block, the key blocks from the diagonal leftwards, carrying each query's log-survival sum."""
    T = q.shape[3]
    o = q.new_zeros(*q.shape[:-1], v.shape[-1])
    for i0 in range(0, T, block_size):
        i1 = min(i0 + block_size, T)
        qb = q[..., i0:i1, :]
        survival = q.new_zeros(qb.shape[:-1])
        for j0, j1 in key_blocks(i0, i1, attend_current, block_size):
            A, _, keep = block_weights(qb, k[..., j0:j1, :], i0, j0, scale, attend_current, survival)
            o[..., i0:i1, :] += A @ v[..., j0:j1, :]
            survival = survival + keep
    return o


@autocast_off
def stickbreaking_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    scale: float,
    attend_current: bool,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [B, H, G, T, K], dk [B, H, T, K], dv [B, H, T, V])`` of the grouped forward, from ``do`` and the
    forward's ``o`` (both ``[B, H, G, T, V]``), recomputing the weights block by block in the forward's order.

    With ``P_ij = A_ij (do_i·v_j)``: ``dz_ij = P_ij (1 − beta_ij) − beta_ij Σ_{l < j} P_il``, where the sum over the
    keys left of ``j`` is ``do_i·o_i`` minus the keys from ``j`` rightwards (the scan's running sum)."""
    T = q.shape[3]
    dq = torch.zeros_like(q)
    dk = k.new_zeros(k.shape[0], k.shape[1], *k.shape[3:])
    dv = v.new_zeros(v.shape[0], v.shape[1], *v.shape[3:])
    total = (do * o).sum(-1)  # Σ_j P_ij
    for i0 in range(0, T, block_size):
        i1 = min(i0 + block_size, T)
        qb, dob = q[..., i0:i1, :], do[..., i0:i1, :]
        survival = q.new_zeros(qb.shape[:-1])
        right = torch.zeros_like(survival)  # Σ P_il over the keys of the blocks already scanned
        for j0, j1 in key_blocks(i0, i1, attend_current, block_size):
            kb, vb = k[..., j0:j1, :], v[..., j0:j1, :]
            A, z, keep = block_weights(qb, kb, i0, j0, scale, attend_current, survival)
            P = A * (dob @ vb.transpose(-1, -2))
            P_from = _suffix_sum(P)
            left = total[..., i0:i1, None] - right[..., None] - P_from  # Σ_{l < j} P_il
            beta = torch.sigmoid(z)  # 0 for unseen keys, where P is 0 too: dz is 0 there
            dz = P * (1 - beta) - beta * left
            dq[..., i0:i1, :] += scale * (dz @ kb)
            dk[..., j0:j1, :] += scale * (dz.transpose(-1, -2) @ qb).sum(2)
            dv[..., j0:j1, :] += (A.transpose(-1, -2) @ dob).sum(2)
            survival = survival + keep
            right = right + P_from[..., 0]
    return dq, dk, dv


class StickBreakingFunction(torch.autograd.Function):
    """Dense stick-breaking attention with the blockwise backward: saves ``q, k, v`` and ``o``, never the weights."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, attend_current: bool, block_size: int):
        B, T, HQ, _ = q.shape
        qg, kg, vg = _grouped(q, k, v, compute_dtype(q, k, v))
        o = stickbreaking_fwd(qg, kg, vg, scale, attend_current, block_size)
        ctx.save_for_backward(q, k, v, o)
        ctx.options = (scale, attend_current, block_size)
        return o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        q, k, v, o = ctx.saved_tensors
        B, T, HQ, K = q.shape
        H = k.shape[2]
        qg, kg, vg = _grouped(q, k, v, o.dtype)
        dog = do.to(o.dtype).reshape(B, T, H, HQ // H, -1).permute(0, 2, 3, 1, 4)
        dq, dk, dv = stickbreaking_bwd(dog, qg, kg, vg, o, *ctx.options)
        dq = dq.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, K).to(q.dtype)
        return dq, dk.transpose(1, 2).to(k.dtype), dv.transpose(1, 2).to(v.dtype), None, None, None


def stickbreaking_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attend_current: bool,
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Stick-breaking attention of one dense batch (inputs trusted): ``q [B, T, HQ, K]``, ``k [B, T, H, K]``,
    ``v [B, T, H, V]`` -> ``o [B, T, HQ, V]`` in ``v.dtype``; float32 inside (float64 for float64 inputs)."""
    return StickBreakingFunction.apply(q, k, v, scale, attend_current, block_size)
