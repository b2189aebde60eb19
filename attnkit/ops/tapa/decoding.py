"""TAPA decoding: one new query against a cache of raw keys, values and the absolute position of each slot.

The logit depends on the distance ``m − n`` only through ``(m − n)^alpha``, so the cache keeps raw keys and
each slot's position in its sequence; left padding is handled by ``cache_mask``. On CUDA the step runs as
one fused split-KV kernel (``triton/decode.py``); the PyTorch path below is the CPU backend and its oracle.
"""

from __future__ import annotations

import math

import torch

from attnkit.ops.common.utils import compute_dtype, repeat_kv
from attnkit.ops.common.validation import (
    check_cache_mask,
    check_decode_cache,
    check_positions,
    check_rows_have_slots,
    reads_data,
    resolve_backend,
)
from attnkit.ops.tapa.torch_impl import check_alpha, check_phase, check_theta, phase_variance, tapa_split


def _check_preconditions(
    q_position: torch.Tensor, k_positions: torch.Tensor, cache_mask: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, float]:
    """The step's preconditions on its data, read from the device at once: positions ``>= 0`` (masked slots may
    hold anything), a real slot in every row, and one at or before the query, and the distance power of
    :func:`check_alpha` (not under ``torch.compile``: :func:`reads_data`). Returns the ``[B, L]`` visible slots and
    ``alpha``."""
    visible = cache_mask & (k_positions <= q_position[:, None])
    if not reads_data():
        return visible, check_alpha(alpha, 0)
    if not cache_mask.shape[0] * cache_mask.shape[1]:
        check_rows_have_slots("cache_mask", cache_mask.shape[0])
        return visible, check_alpha(alpha, 0)
    distance = (q_position[:, None] - k_positions).masked_fill(~visible, 0)
    stats = (
        q_position.min(),
        k_positions.masked_fill(~cache_mask, 0).min(),
        (~cache_mask.any(-1)).sum(),
        (~visible.any(-1)).sum(),
        distance.max(),
    )
    low_q, low_k, no_real, no_visible, far = torch.stack([x.long() for x in stats]).tolist()
    if low_q < 0:
        raise ValueError(f"q_position: positions count tokens from 0, got {low_q}")
    if low_k < 0:
        raise ValueError(f"k_positions: the positions of real slots count tokens from 0, got {low_k}")
    check_rows_have_slots("cache_mask", no_real)
    check_rows_have_slots("k_positions", no_visible, "real slot at or before q_position")
    return visible, check_alpha(alpha, far)


def tapa_decode_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_position: torch.Tensor,
    k_positions: torch.Tensor,
    cache_mask: torch.Tensor,
    *,
    theta: float = 0.5,
    alpha: float = 0.1,
    backend: str = "auto",
    phase: str = "quadratic",
) -> torch.Tensor:
    """One decoding step of TAPA: the logit of slot ``n`` is
    ``(q_A·k_A)/sqrt(dA) · cos(2π · (m−n)^alpha · φ(q, k_n))`` with ``m = q_position``, ``n = k_positions``,
    ``0^alpha = 0`` and the phase function ``φ`` of ``phase``, as in :func:`attnkit.ops.tapa_attention`.

    The preconditions on positions and the mask are data: they are read from the device once a step (a
    synchronisation on CUDA; not under ``torch.compile``, which trusts them), and a step that breaks one is a
    ``ValueError`` naming the argument.

    Args:
        q: ``[B, 1, HQ, D]`` the query of the new token.
        k_cache: ``[B, L, H, D]`` raw keys, the new token's included; ``HQ`` a positive multiple of ``H``.
        v_cache: ``[B, L, H, V]``.
        q_position: ``[B]`` int, the position of the query within its sequence, ``>= 0``.
        k_positions: ``[B, L]`` int, the position of every slot within its sequence, ``>= 0`` for real slots
            (masked slots may hold anything).
        cache_mask: ``[B, L]`` bool, True for real slots; slots after ``q_position`` are excluded as well.
            Every row needs a real slot at or before ``q_position`` (its own token's).
        theta, alpha, phase: as in :func:`attnkit.ops.tapa_attention`; the distance power bound applies to the
            largest distance ``q_position − k_positions`` of a visible slot.

        backend: ``"auto"`` (the Triton kernel for CUDA tensors, PyTorch otherwise), ``"torch"`` or
            ``"triton"``. The kernel takes float32 / float16 / bfloat16; float64 inputs stay on PyTorch under
            ``"auto"`` and are refused by ``"triton"``.

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``; the distance power, phase and cosine in float32 (float64
        for float64 inputs on the PyTorch backend).
    """
    B, L, HQ, H, D = check_decode_cache(q, k_cache, v_cache)
    check_positions("q_position", q_position, (B,), q.device)
    check_positions("k_positions", k_positions, (B, L), q.device)
    check_cache_mask(cache_mask, (B, L), q.device)
    theta = check_theta(theta, D)
    phase = check_phase(phase)
    amp_dim, phase_dim = tapa_split(theta, D)
    visible, alpha = _check_preconditions(q_position, k_positions, cache_mask, alpha)
    dtype = compute_dtype(q, k_cache, v_cache)
    if resolve_backend(backend, "tapa_decode_step", q.device, has_triton=True, dtype=dtype) == "triton":
        # Imported here: triton is a Linux-only dependency, and the CPU path must import without it.
        from attnkit.ops.tapa.parallel import tapa_decode_op

        args = (q, k_cache, v_cache, q_position, k_positions, cache_mask, amp_dim, float(alpha), phase)
        return tapa_decode_op(*args)

    groups = HQ // H
    qh, kh = q[:, 0].to(dtype), repeat_kv(k_cache, groups).to(dtype)
    amp = torch.einsum("bhd,bnhd->bhn", qh[..., :amp_dim], kh[..., :amp_dim]) / math.sqrt(amp_dim)
    if phase == "quadratic":
        products = torch.einsum("bhd,bnhd->bhn", qh[..., amp_dim:], kh[..., amp_dim:])
    else:
        products = qh[..., amp_dim:].sum(-1)[..., None] - kh[..., amp_dim:].sum(-1).transpose(1, 2)
    # 2π·d^alpha/sqrt(variance) per slot, built in float64 and rounded once, as the prefill's table is
    dist = (q_position[:, None] - k_positions).to(torch.float64)  # [B, L]
    power = torch.where(dist > 0, dist.clamp_min(1.0).pow(alpha), torch.zeros_like(dist))
    phase_scale = (power * (2 * math.pi / math.sqrt(phase_variance(phase, phase_dim)))).to(dtype)
    logits = amp * torch.cos(products * phase_scale[:, None])
    logits = logits.masked_fill(~visible[:, None], -math.inf)
    o = torch.einsum("bhn,bnhv->bhv", logits.softmax(-1), repeat_kv(v_cache, groups).to(dtype))
    return o[:, None].to(v_cache.dtype)
