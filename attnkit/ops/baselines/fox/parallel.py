"""FoX's Triton kernels as PyTorch operators: ``attnkit::fox_fwd`` (with an autograd registration) and
``attnkit::fox_bwd`` (its backward formula).

``torch.library.custom_op`` with fake (meta) implementations, so that ``torch.compile`` traces through the kernels
instead of breaking the graph, and ``torch.library.opcheck`` can hold the registrations to the kernels. The
kernels read their inputs through strides: nothing here copies them.
"""

from __future__ import annotations

import torch

from attnkit.ops.baselines.fox.triton.backward import fox_bwd_fn
from attnkit.ops.baselines.fox.triton.forward import fox_fwd_fn


@torch.library.custom_op("attnkit::fox_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def fox_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B,T,HQ,V] in v.dtype, lse [B,T,HQ] float32, base 2)`` on validated inputs with ``B, T > 0``
    (softmax attention without ``g``); CPU tensors run through Triton's interpreter."""
    return fox_fwd_fn(q, k, v, g, cu_seqlens, scale)


@fox_fwd_op.register_fake
def _(q, k, v, g, cu_seqlens, scale):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[-1], dtype=v.dtype), q.new_empty(B, T, HQ, dtype=torch.float32)


@torch.library.custom_op("attnkit::fox_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def fox_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dg)`` in the inputs' dtypes from the forward's inputs, output and log-sum-exp (``dg`` empty
    without a gate)."""
    return fox_bwd_fn(do, q, k, v, g, o, lse, cu_seqlens, scale)


@fox_bwd_op.register_fake
def _(do, q, k, v, g, o, lse, cu_seqlens, scale):
    # The kernels write contiguous gradients whatever the inputs' strides.
    dg = q.new_empty(0) if g is None else g.new_empty(g.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg


def _setup_context(ctx, inputs, output):
    q, k, v, g, cu_seqlens, scale = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient stays None, not a zero fill
    ctx.save_for_backward(q, k, v, g, o, lse, cu_seqlens)
    ctx.scale = scale


def _backward(ctx, do, dlse):
    if do is None:
        return (None,) * 6
    q, k, v, g, o, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, dg = fox_bwd_op(do, q, k, v, g, o, lse, cu_seqlens, ctx.scale)
    return dq, dk, dv, None if g is None else dg, None, None


fox_fwd_op.register_autograd(_backward, setup_context=_setup_context)
