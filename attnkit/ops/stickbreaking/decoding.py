"""Stick-breaking decoding: one new query against a cache of raw keys and values (no position encoding)."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import compute_dtype
from attnkit.ops.common.validation import check_cache_mask, check_decode_cache, check_scalar
from attnkit.ops.stickbreaking.torch_impl import stick_log_weights


def check_attend_current(attend_current: object) -> bool:
    if not isinstance(attend_current, bool):
        raise ValueError(f"attend_current: expected a bool, got {attend_current!r}")
    return attend_current


def stickbreaking_decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    attend_current: bool = False,
) -> torch.Tensor:
    """One decoding step of stick-breaking attention over a (left-padded) cache that holds the new token last.

    Slot ``j`` gets ``A_j = beta_j Π_{l > j} (1 − beta_l)`` with ``beta_j = sigmoid(scale · qᵀk_j)``, the product
    over the visible slots after ``j``; slots with ``cache_mask`` False and, without ``attend_current``, the new
    token's own slot (the last) are not visible.

    Args:
        q: ``[B, 1, HQ, K]`` the query of the new token.
        k_cache: ``[B, L, H, K]`` keys, the new token's included (last); ``HQ % H == 0``.
        v_cache: ``[B, L, H, V]``.
        cache_mask: ``[B, L]`` bool, True for real slots, or None when all are real.
        scale: defaults to ``K ** -0.5``.
        attend_current: whether the new token reads its own key, as in :func:`stickbreaking_attention`.

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``; computed in float32 (float64 for float64 inputs).
    """
    B, L, HQ, H, K = check_decode_cache(q, k_cache, v_cache)
    if cache_mask is not None:
        check_cache_mask(cache_mask, (B, L), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale, low=0.0)
    check_attend_current(attend_current)
    dtype = compute_dtype(q, k_cache, v_cache)
    qg = q.to(dtype).reshape(B, H, HQ // H, K)
    z = scale * torch.einsum("bhgk,blhk->bhgl", qg, k_cache.to(dtype))
    visible = torch.ones(B, L, dtype=torch.bool, device=q.device) if cache_mask is None else cache_mask.clone()
    if not attend_current and L:
        visible[:, -1] = False
    z = z.masked_fill(~visible[:, None, None, :], float("-inf"))
    A = torch.exp(stick_log_weights(z)[0])
    o = torch.einsum("bhgl,blhv->bhgv", A, v_cache.to(dtype))
    return o.reshape(B, 1, HQ, -1).to(v_cache.dtype)
