"""PaTH's Triton kernels as PyTorch operators: ``attnkit::path_decode_`` (the in-place fused decode step)."""

from __future__ import annotations

import torch

from attnkit.ops.path.triton.decode import path_decode_fn


@torch.library.custom_op("attnkit::path_decode_", mutates_args=("k_cache",), device_types=("cuda", "cpu"))
def path_decode_op(
    q: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    t: int,
    g_cache: torch.Tensor | None,
    cache_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One fused step on validated inputs (see :func:`attnkit.ops.path.path_decode_step_`); carries
    ``k_cache[:, :t]`` in place and returns ``o [B, 1, HQ, V]``. Inference only (no autograd formula)."""
    return path_decode_fn(q, w, beta, k_cache, v_cache, t, g_cache, cache_mask, scale)


@path_decode_op.register_fake
def _(q, w, beta, k_cache, v_cache, t, g_cache, cache_mask, scale):
    B, _, HQ, _ = q.shape
    return q.new_empty(B, 1, HQ, v_cache.shape[-1], dtype=v_cache.dtype)
