"""Causal softmax attention, and the Forgetting Transformer (FoX) when a log forget gate is given."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnkit.ops.baselines.fox.torch_impl import fox_torch
from attnkit.ops.common.utils import compute_dtype, repeat_kv, segment_bounds
from attnkit.ops.common.validation import (
    check_cache_mask,
    check_cu_seqlens,
    check_decode_cache,
    check_like,
    check_qkv,
    check_real_slots,
    check_scalar,
    resolve_backend,
)


def _softmax_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention (no gate) of one dense batch through SDPA; ``q [B,T,HQ,K]``, ``k [B,T,H,K]``,
    ``v [B,T,H,V]``."""
    groups = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return o.transpose(1, 2)


# "auto" takes the FoX kernels for CUDA tensors: on an H200 their forward+backward took 1.5-1.6x SDPA at D = 64 and
# 1.2-1.35x at D = 128 (FLA's FoX kernel 2.3x / 1.55x; benchmarks/results/fox_h200.md), where the blockwise
# PyTorch backend made a FoX model train at 0.18x RoPE's tokens/s.
AUTO_TRITON = True
# Widest head dims the kernels are built for: one [BM, D] query tile, [BN, D] key and value tiles and a [BM, V]
# accumulator stay in registers up to 256 with the smaller blocks of ``fwd_config``.
TRITON_MAX_HEAD_DIM = 256


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal softmax attention with GQA; FoX (the Forgetting Transformer) when ``g`` is given.

    Logit for ``j <= i``: ``scale · q_iᵀ k_j + (G_i − G_j)`` with ``G = cumsum(g)`` within each sequence
    (the gate is not multiplied by ``scale``; FLA's ``parallel_forgetting_attn`` adds ``G_i − G_j`` unscaled
    too); without ``g`` the gate term is absent. No backend builds a ``T × T`` tensor when ``g`` is given.

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]`` with ``HQ % H == 0`` (query head ``h`` reads key/value head
            ``h // (HQ // H)``); v: ``[B, T, H, V]``; float32 / float16 / bfloat16 (float64 for tests).
        g: ``[B, T, HQ]`` log forget gate (``<= 0`` in FoX; not checked), any float dtype, or None. Its
            cumulative sum is taken in float32 (float64 for float64 inputs).
        scale: defaults to ``K ** -0.5``.
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (``B == 1``); gates restart at 0 in each.
        backend: ``"auto"`` (with ``g``, the kernels for CUDA tensors of 16/32-bit floats; the PyTorch backend
            otherwise: SDPA without ``g``),
            ``"torch"`` (SDPA without ``g``; with ``g`` a blockwise online softmax with a recomputing backward,
            never more than a ``128 × 128`` tile of logits per head, ``512 × 512`` on CUDA) or ``"triton"``
            (fused FlashAttention-style forward and backward kernels for CUDA tensors, or CPU tensors under
            ``TRITON_INTERPRET=1``; float16 / bfloat16 / float32, head dims up to 256; with or without ``g``).

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
    dims = dict(head_dims=(K, v.shape[-1]), max_head_dim=TRITON_MAX_HEAD_DIM)
    use = resolve_backend(
        backend,
        "softmax_attention",
        q.device,
        has_triton=True,
        dtype=q.dtype,
        **dims,
        # without a gate, SDPA (FlashAttention); the kernels' gate-free form has not run on a GPU
        auto_triton=AUTO_TRITON and g is not None,
    )
    if T == 0 or B == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        inputs = (q, k, v) + (() if g is None else (g,))
        return v.new_zeros(B, T, HQ, v.shape[-1]) + sum(x.sum() for x in inputs).to(v.dtype)
    if use == "triton":
        # Imported here: Triton is a Linux-only dependency, and the PyTorch backend must import without it.
        from attnkit.ops.baselines.fox.parallel import fox_fwd_op

        return fox_fwd_op(q, k, v, g, cu_seqlens, float(scale))[0]
    bounds = segment_bounds(cu_seqlens, T)
    if g is not None:
        return fox_torch(q, k, v, g, scale, bounds)
    outputs = [_softmax_sdpa(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], scale) for bos, eos in bounds if eos > bos]
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
