"""The Triton backend of TAPA as PyTorch operators: ``attnkit::tapa_fwd``, ``attnkit::tapa_bwd`` and
``attnkit::tapa_decode``.

``torch.library.custom_op`` with fake (meta) implementations and an autograd registration, so that
``torch.compile`` traces through the kernels instead of breaking the graph, and ``torch.library.opcheck``
can hold the registration to the kernels.
"""

from __future__ import annotations

import torch

from attnkit.ops.tapa.triton.backward import tapa_bwd_fn
from attnkit.ops.tapa.triton.decode import tapa_decode_fn
from attnkit.ops.tapa.triton.forward import tapa_fwd_fn


@torch.library.custom_op("attnkit::tapa_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def tapa_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    amp_dim: int,
    alpha: float,
    phase: str = "quadratic",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B,T,HQ,V], lse [HQ, B*T] float32)``; CPU tensors run through Triton's interpreter."""
    return tapa_fwd_fn(q.contiguous(), k.contiguous(), v.contiguous(), amp_dim, alpha, cu_seqlens, phase=phase)


@tapa_fwd_op.register_fake
def _(q, k, v, cu_seqlens, amp_dim, alpha, phase="quadratic"):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[-1], dtype=v.dtype), q.new_empty(HQ, B * T, dtype=torch.float32)


@torch.library.custom_op("attnkit::tapa_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def tapa_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    amp_dim: int,
    alpha: float,
    phase: str = "quadratic",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the forward's inputs, output and log-sum-exp."""
    q, k, v, o, do = (x.contiguous() for x in (q, k, v, o, do))
    return tapa_bwd_fn(q, k, v, o, lse, do, amp_dim, alpha, cu_seqlens, phase=phase)


@tapa_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, amp_dim, alpha, phase="quadratic"):
    # The kernels write contiguous gradients whatever the inputs' strides.
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, amp_dim, alpha, phase = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient stays None, not a zero fill
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.amp_dim, ctx.alpha, ctx.phase = amp_dim, alpha, phase


def _backward(ctx, do, dlse):
    if do is None:
        return (None,) * 7
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = tapa_bwd_op(do, q, k, v, o, lse, cu_seqlens, ctx.amp_dim, ctx.alpha, ctx.phase)
    return dq, dk, dv, None, None, None, None


tapa_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def tapa_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    amp_dim: int,
    alpha: float,
    cu_seqlens: torch.Tensor | None,
    phase: str = "quadratic",
) -> torch.Tensor:
    """TAPA through the Triton kernels on validated inputs (one float dtype, not float64); ``o [B,T,HQ,V]``."""
    return tapa_fwd_op(q, k, v, cu_seqlens, amp_dim, float(alpha), phase)[0]


@torch.library.custom_op("attnkit::tapa_decode", mutates_args=(), device_types=("cuda", "cpu"))
def tapa_decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_position: torch.Tensor,
    k_positions: torch.Tensor,
    cache_mask: torch.Tensor,
    amp_dim: int,
    alpha: float,
    phase: str = "quadratic",
) -> torch.Tensor:
    """One decoding step on validated inputs (see :func:`attnkit.ops.tapa.tapa_decode_step`); ``o [B,1,HQ,V]``.
    Inference only: no autograd formula is registered (the PyTorch backend has one)."""
    return tapa_decode_fn(q, k_cache, v_cache, q_position, k_positions, cache_mask, amp_dim, alpha, phase=phase)


@tapa_decode_op.register_fake
def _(q, k_cache, v_cache, q_position, k_positions, cache_mask, amp_dim, alpha, phase="quadratic"):
    B, _, HQ, _ = q.shape
    return q.new_empty(B, 1, HQ, v_cache.shape[-1], dtype=v_cache.dtype)
