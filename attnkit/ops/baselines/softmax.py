"""Causal softmax attention, and the Forgetting Transformer (FoX) when a log forget gate is given."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnkit.ops.common.utils import compute_dtype, repeat_kv, segment_bounds
from attnkit.ops.common.validation import (
    check_cache_mask,
    check_cu_seqlens,
    check_decode_cache,
    check_like,
    check_qkv,
    check_real_slots,
    check_scalar,
)


def _softmax_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One dense batch; ``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]``, ``g [B,T,HQ]`` or None."""
    groups = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if g is None:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return o.transpose(1, 2)
    # FoX: the gate enters as an additive mask G_i − G_j. It is formed in float32 (float64 for float64
    # inputs) because the cumulative sums grow with T and a half-precision difference would lose them.
    dtype = compute_dtype(q, k, v)
    T = q.shape[1]
    gate = g.to(dtype).cumsum(1).transpose(1, 2)
    bias = gate[..., :, None] - gate[..., None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    bias = bias.masked_fill(~causal, -math.inf)
    o = F.scaled_dot_product_attention(
        q.to(dtype).transpose(1, 2),
        k.to(dtype).transpose(1, 2),
        v.to(dtype).transpose(1, 2),
        attn_mask=bias,
        scale=scale,
    )
    return o.transpose(1, 2).to(v.dtype)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention with GQA; FoX when ``g`` is given.

    Logit for ``j <= i``: ``scale · q_iᵀ k_j + (G_i − G_j)`` with ``G = cumsum(g)`` within each sequence
    (the gate is not multiplied by ``scale``); without ``g`` the gate term is absent.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]`` with ``HQ % H == 0``; v: ``[B, T, H, V]``.
        g: ``[B, T, HQ]`` log forget gate (``<= 0`` in FoX; not checked), any float dtype, or None.
        scale: defaults to ``K ** -0.5``.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (``B == 1``).

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype``.
    """
    check_qkv(q, k, v)
    B, T, HQ, K = q.shape
    if g is not None:
        check_like("g", g, (B, T, HQ), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale, low=0.0)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    if T == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        inputs = (q, k, v) + (() if g is None else (g,))
        return v.new_zeros(B, 0, HQ, v.shape[-1]) + sum(x.sum() for x in inputs).to(v.dtype)
    outputs = [
        _softmax_dense(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], None if g is None else g[:, bos:eos], scale)
        for bos, eos in segment_bounds(cu_seqlens, T)
        if eos > bos
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


def softmax_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Reference for tests: one query position at a time, on one dense batch (shapes as above)."""
    B, T, HQ, K = q.shape
    scale = K**-0.5 if scale is None else scale
    out_dtype, dtype = v.dtype, compute_dtype(q, k, v)
    groups = HQ // k.shape[2]
    q, k, v = q.to(dtype), repeat_kv(k.to(dtype), groups), repeat_kv(v.to(dtype), groups)
    gate = None if g is None else g.to(dtype).cumsum(1)
    outputs = []
    for i in range(T):
        logits = scale * torch.einsum("bhk,bjhk->bhj", q[:, i], k[:, : i + 1])
        if gate is not None:
            logits = logits + (gate[:, i, :, None] - gate[:, : i + 1].transpose(1, 2))
        outputs.append(torch.einsum("bhj,bjhv->bhv", logits.softmax(-1), v[:, : i + 1]))
    if T == 0:
        return v.new_zeros(B, 0, HQ, v.shape[-1], dtype=out_dtype)
    return torch.stack(outputs, dim=1).to(out_dtype)


def softmax_decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_mask: torch.Tensor | None,
    g_cache: torch.Tensor | None = None,
    g_t: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """One decoding step of softmax / FoX attention over a (left-padded) cache that holds the new token.

    Logit of cache slot ``j``: ``scale · qᵀ k_j + (g_t − G_j)``; slots with ``cache_mask`` False get −inf.

    Args:
        q: ``[B, 1, HQ, K]`` the query of the new token.
        k_cache: ``[B, L, H, K]`` keys (RoPE already applied), the new token's included; ``HQ`` a positive
            multiple of ``H``. The caches may be kept in another float dtype than ``q``.
        v_cache: ``[B, L, H, V]``.
        cache_mask: ``[B, L]`` bool, True for real slots, or None when all are real. Every row needs a real slot:
            a row without one is a ``ValueError`` (the one check that reads the device; trusted under
            ``torch.compile``).
        g_cache: ``[B, L, HQ]`` cumulative log forget gates ``G_j`` of the slots, or None (no gate).
        g_t: ``[B, HQ]`` the cumulative gate of the query position (``G`` of the new token); with ``g_cache``.
        scale: defaults to ``K ** -0.5``.

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``; computed in float32 (float64 for float64 inputs).
    """
    B, L, HQ, H, K = check_decode_cache(q, k_cache, v_cache)
    if cache_mask is not None:
        check_real_slots(check_cache_mask(cache_mask, (B, L), q.device))
    elif B and L == 0:
        raise ValueError("k_cache: an empty cache has no slot to attend to (it must hold the new token)")
    if (g_cache is None) != (g_t is None):
        raise ValueError("g_cache: pass both g_cache and g_t, or neither")
    if g_cache is not None:
        check_like("g_cache", g_cache, (B, L, HQ), q.device)
        check_like("g_t", g_t, (B, HQ), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale, low=0.0)

    dtype = compute_dtype(q, k_cache, v_cache)
    bias = None
    if g_cache is not None:
        bias = (g_t.to(dtype)[:, :, None] - g_cache.to(dtype).transpose(1, 2))[:, :, None, :]  # [B, HQ, 1, L]
    if cache_mask is not None:
        keep = cache_mask[:, None, None, :]
        bias = keep if bias is None else bias.masked_fill(~keep, -math.inf)
    # SDPA reads the cache in place (GQA without copies); about 4x faster than einsums at one query
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2).to(dtype),
        k_cache.transpose(1, 2).to(dtype),
        v_cache.transpose(1, 2).to(dtype),
        attn_mask=bias,
        scale=scale,
        enable_gqa=HQ != H,
    )
    return o.transpose(1, 2).to(v_cache.dtype)
