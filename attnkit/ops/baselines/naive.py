"""Definitional loops of the recurrent baselines, token by token, for tests only."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import compute_dtype


def linear_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    normalize: bool = True,
    eps: float = 1e-4,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
):
    """``q [B, T, HQ, K]``, ``k [B, T, H, K]``, ``v [B, T, H, V]``, state ``(S [B, H, V, K], n [B, H, K])``.
    Returns ``(o [B, T, HQ, V] in v.dtype, state or None)``."""
    dtype = compute_dtype(q, k, v, *(initial_state or ()))
    B, T, HQ, K = q.shape
    H, V, out_dtype = k.shape[2], v.shape[-1], v.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if initial_state is None:
        S, n = q.new_zeros(B, H, V, K), q.new_zeros(B, H, K)
    else:
        S, n = (s.to(dtype) for s in initial_state)
    outputs = []
    for t in range(T):
        S = S + v[:, t, :, :, None] * k[:, t, :, None, :]
        n = n + k[:, t]
        # Query head h reads key/value head h // (HQ // H).
        o = (S.repeat_interleave(HQ // H, 1) @ q[:, t, :, :, None]).squeeze(-1)
        if normalize:
            den = (n.repeat_interleave(HQ // H, 1) * q[:, t]).sum(-1, keepdim=True)
            o = o / den.clamp_min(eps)
        outputs.append(o)
    o = torch.stack(outputs, 1) if T else v.new_zeros(B, 0, HQ, V)
    return o.to(out_dtype), ((S, n) if output_final_state else None)


def delta_rule_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
):
    """``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, state ``S [B, H, V, K]``.
    Returns ``(o [B, T, H, V] in v.dtype, S or None)``."""
    dtype = compute_dtype(q, k, v, beta, initial_state)
    B, T, H, K = q.shape
    V, out_dtype = v.shape[-1], v.dtype
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    S = q.new_zeros(B, H, V, K) if initial_state is None else initial_state.to(dtype)
    outputs = []
    for t in range(T):
        Sk = (S @ k[:, t, :, :, None]).squeeze(-1)
        S = S + beta[:, t, :, None, None] * (v[:, t] - Sk)[..., :, None] * k[:, t, :, None, :]
        outputs.append((S @ (scale * q[:, t])[..., None]).squeeze(-1))
    o = torch.stack(outputs, 1) if T else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
