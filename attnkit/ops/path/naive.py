"""Definitional PaTH: explicit loops over query and key positions. For tests only."""

from __future__ import annotations

import torch


def path_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """PaTH(-FoX) attention of one dense batch, exactly as SPEC §2 writes it.

    ``s_ij = scale · k_jᵀ (H_{j+1} ··· H_i) q_i + G_i − G_j`` with ``H_s = I − beta_s w_s w_sᵀ``: the
    query is walked from position ``i`` back to ``j``, one transition at a time. Computes in the dtype of
    the inputs (use float64 for a reference); shapes as ``path_attention`` without ``cu_seqlens``.
    """
    B, T, HQ, K = q.shape
    groups = HQ // k.shape[2]
    scale = K**-0.5 if scale is None else scale
    kq, vq, wq = (x.repeat_interleave(groups, dim=2) for x in (k, v, w))
    bq = beta.repeat_interleave(groups, dim=2)
    G = torch.zeros(B, T, HQ, dtype=q.dtype) if g is None else g.to(q.dtype).cumsum(1)
    out = []
    for i in range(T):
        x = q[:, i]  # [B, HQ, K], walked back across H_i, H_{i-1}, ...
        logits = [None] * (i + 1)
        for j in range(i, -1, -1):
            logits[j] = scale * (kq[:, j] * x).sum(-1) + G[:, i] - G[:, j]
            x = x - (bq[:, j] * (wq[:, j] * x).sum(-1))[..., None] * wq[:, j]
        p = torch.softmax(torch.stack(logits, dim=-1), dim=-1)  # [B, HQ, i+1]
        out.append(torch.einsum("bhj,bjhv->bhv", p, vq[:, : i + 1].to(p.dtype)))
    return torch.stack(out, dim=1).to(v.dtype)
