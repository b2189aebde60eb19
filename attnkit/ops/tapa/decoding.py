"""TAPA decoding: one new query against a cache of raw keys, values and the absolute position of each slot.

The logit depends on the distance ``m − n`` only through ``(m − n)^alpha``, so the cache keeps raw keys and
each slot's position in its sequence; left padding is handled by ``cache_mask``. On CUDA the step runs as
one fused split-KV kernel (``triton/decode.py``); the PyTorch path below is the CPU backend and its oracle.
"""

from __future__ import annotations

import math

import torch

from attnkit.ops.common.utils import compute_dtype, repeat_kv
from attnkit.ops.common.validation import check_cache_mask, check_decode_cache, check_scalar, resolve_backend
from attnkit.ops.tapa.torch_impl import check_theta, tapa_split


def _check_positions(name: str, x: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32/int64 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    return x


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
) -> torch.Tensor:
    """One decoding step of TAPA: the logit of slot ``n`` is
    ``(q_A·k_A)/sqrt(dA) · cos(2π · (m−n)^alpha · (q_P·k_P)/sqrt(dP))`` with ``m = q_position``,
    ``n = k_positions`` and ``0^alpha = 0``, as in :func:`attnkit.ops.tapa_attention`.

    Args:
        q: ``[B, 1, HQ, D]`` the query of the new token.
        k_cache: ``[B, L, H, D]`` raw keys, the new token's included; ``HQ % H == 0``.
        v_cache: ``[B, L, H, V]``.
        q_position: ``[B]`` int, the position of the query within its sequence.
        k_positions: ``[B, L]`` int, the position of every slot within its sequence.
        cache_mask: ``[B, L]`` bool, True for real slots; slots after ``q_position`` are excluded as well.
            Every row needs one visible slot.
        theta, alpha: as in :func:`attnkit.ops.tapa_attention`.
        backend: ``"auto"`` (the Triton kernel for CUDA tensors, PyTorch otherwise), ``"torch"`` or
            ``"triton"``. The kernel takes float32 / float16 / bfloat16; float64 inputs stay on PyTorch under
            ``"auto"`` and are refused by ``"triton"``.

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``; the distance power, phase and cosine in float32 (float64
        for float64 inputs on the PyTorch backend).
    """
    B, L, HQ, H, D = check_decode_cache(q, k_cache, v_cache)
    _check_positions("q_position", q_position, (B,), q.device)
    _check_positions("k_positions", k_positions, (B, L), q.device)
    check_cache_mask(cache_mask, (B, L), q.device)
    theta = check_theta(theta, D)
    amp_dim, phase_dim = tapa_split(theta, D)
    alpha = check_scalar("alpha", alpha, low=0.0, strict=False)
    dtype = compute_dtype(q, k_cache, v_cache)
    if resolve_backend(backend, "tapa_decode_step", q.device, has_triton=True, dtype=dtype) == "triton":
        # Imported here: triton is a Linux-only dependency, and the CPU path must import without it.
        from attnkit.ops.tapa.parallel import tapa_decode_op

        return tapa_decode_op(q, k_cache, v_cache, q_position, k_positions, cache_mask, amp_dim, float(alpha))

    groups = HQ // H
    qh, kh = q[:, 0].to(dtype), repeat_kv(k_cache, groups).to(dtype)
    amp = torch.einsum("bhd,bnhd->bhn", qh[..., :amp_dim], kh[..., :amp_dim]) / math.sqrt(amp_dim)
    phase = torch.einsum("bhd,bnhd->bhn", qh[..., amp_dim:], kh[..., amp_dim:])
    # 2π·d^alpha/sqrt(dP) per slot, built in float64 and rounded once, as the prefill's table is
    dist = (q_position[:, None] - k_positions).to(torch.float64)  # [B, L]
    power = torch.where(dist > 0, dist.clamp_min(1.0).pow(alpha), torch.zeros_like(dist))
    phase_scale = (power * (2 * math.pi / math.sqrt(phase_dim))).to(dtype)
    logits = amp * torch.cos(phase * phase_scale[:, None])
    visible = cache_mask & (k_positions <= q_position[:, None])
    logits = logits.masked_fill(~visible[:, None], -math.inf)
    o = torch.einsum("bhn,bnhv->bhv", logits.softmax(-1), repeat_kv(v_cache, groups).to(dtype))
    return o[:, None].to(v_cache.dtype)
