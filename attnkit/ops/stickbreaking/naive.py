"""Definitional stick-breaking attention: explicit loops over query and key positions. For tests only."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import compute_dtype, repeat_kv


def stickbreaking_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    attend_current: bool = False,
) -> torch.Tensor:
    """Stick-breaking attention of one dense batch, exactly as arXiv 2410.17980 (Eq. 1) writes it.

    For query ``i``, the visible keys are ``j < i`` (``j <= i`` with ``attend_current``). Walking from the nearest
    visible key leftwards, key ``j`` takes the share ``beta_ij = sigmoid(scale · q_i·k_j)`` of what the keys nearer
    to ``i`` left of the stick: ``A_ij = beta_ij · Π_{j < l visible} (1 − beta_il)``; ``o_i = Σ_j A_ij v_j`` (the
    rest of the stick is dropped). Computes the products directly, not in log space.

    Shapes as :func:`attnkit.ops.stickbreaking_attention` without ``cu_seqlens``; returns ``o [B, T, HQ, V]`` in
    ``v.dtype``, computed in float64 for float64 inputs and float32 otherwise.
    """
    B, T, HQ, K = q.shape
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(q, k, v)
    groups = HQ // k.shape[2]
    q, k, v = q.to(dtype), repeat_kv(k.to(dtype), groups), repeat_kv(v.to(dtype), groups)
    o = v.new_zeros(B, T, HQ, v.shape[-1])
    for i in range(T):
        stick = q.new_ones(B, HQ)  # what is left of the stick for query i
        last = i if attend_current else i - 1
        for j in range(last, -1, -1):
            beta = torch.sigmoid(scale * (q[:, i] * k[:, j]).sum(-1))
            o[:, i] += (stick * beta)[..., None] * v[:, j]
            stick = stick * (1 - beta)
    return o.to(out_dtype)
