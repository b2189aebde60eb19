"""TAPA by its definition (SPEC §3), one query position at a time. For tests only."""

from __future__ import annotations

import math

import torch

from attnkit.ops.common.utils import compute_dtype, repeat_kv


def tapa_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: float = 0.5,
    alpha: float = 0.1,
    phase: str = "quadratic",
) -> torch.Tensor:
    """Causal TAPA on one dense batch of sequences.

    Args:
        q: ``[B, T, HQ, D]``; k: ``[B, T, H, D]``; v: ``[B, T, H, V]``, with ``HQ % H == 0``.
        theta: the first ``dA = round(theta * D)`` channels (Python's ``round``) are the amplitude part.
        alpha: exponent of the distance; ``0 ** alpha`` is taken as 0, also for ``alpha = 0``.
        phase: ``"quadratic"``, ``φ = (q_P·k_P)/sqrt(dP)``, or ``"linear"``, ``φ = (Σ q_P − Σ k_P)/sqrt(2·dP)``.

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype``, computed in float64 for float64 inputs and float32 otherwise.
    """
    B, T, HQ, D = q.shape
    amp_dim = round(theta * D)
    phase_dim = D - amp_dim
    out_dtype, dtype = v.dtype, compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k = repeat_kv(k, HQ // k.shape[2])
    v = repeat_kv(v, HQ // v.shape[2])
    if T == 0:
        return v.new_zeros(B, 0, HQ, v.shape[-1], dtype=out_dtype)
    outputs = []
    for m in range(T):
        dist = m - torch.arange(m + 1, device=q.device, dtype=dtype)
        power = torch.where(dist > 0, dist.pow(alpha), torch.zeros_like(dist))
        amp = torch.einsum("bhd,bnhd->bhn", q[:, m, :, :amp_dim], k[:, : m + 1, :, :amp_dim])
        if phase == "quadratic":
            phi = torch.einsum("bhd,bnhd->bhn", q[:, m, :, amp_dim:], k[:, : m + 1, :, amp_dim:]) / math.sqrt(phase_dim)
        else:
            k_sums = k[:, : m + 1, :, amp_dim:].sum(-1).transpose(1, 2)  # [B, HQ, m + 1]
            phi = (q[:, m, :, amp_dim:].sum(-1)[..., None] - k_sums) / math.sqrt(2 * phase_dim)
        logits = amp / math.sqrt(amp_dim) * torch.cos(2 * math.pi * power * phi)
        outputs.append(torch.einsum("bhn,bnhv->bhv", logits.softmax(-1), v[:, : m + 1]))
    return torch.stack(outputs, dim=1).to(out_dtype)
