"""PaTH's Triton kernels as PyTorch operators: ``attnkit::path_fwd`` (the fused forward, with an autograd
registration) and ``attnkit::path_decode_`` (the in-place fused decode step).

``torch.library.custom_op`` with fake (meta) implementations, so that ``torch.compile`` traces through the kernels
and ``torch.library.opcheck`` can hold the registrations to them. The backward of ``attnkit::path_fwd`` is, for
now, autograd through the PyTorch backend (the fused O(T)-memory backward is the
open part of issue 3; ``README.md`` beside this file has its design).
"""

from __future__ import annotations

import torch

from attnkit.ops.path.triton.decode import path_decode_fn
from attnkit.ops.path.triton.forward import path_fwd_fn


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


@torch.library.custom_op("attnkit::path_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def path_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``o [B,T,HQ,V]`` in ``v.dtype`` through the fused forward (validated inputs; CPU tensors run through
    Triton's interpreter)."""
    q, k, v, w, beta = (x.contiguous() for x in (q, k, v, w, beta))
    return path_fwd_fn(q, k, v, w, beta, None if g is None else g.contiguous(), scale, cu_seqlens)


@path_fwd_op.register_fake
def _(q, k, v, w, beta, g, cu_seqlens, scale):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[-1], dtype=v.dtype)


def _setup_fwd(ctx, inputs, output):
    q, k, v, w, beta, g, cu_seqlens, scale = inputs
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, w, beta, g, cu_seqlens)
    ctx.scale = scale


def _fwd_backward(ctx, do):
    """The interim backward of ``backend="triton"`` until the fused one lands (issue 3): autograd through the
    PyTorch backend, recomputing the forward. Exact, with the PyTorch backend's time and memory. It runs in the
    autograd engine rather than as an operator, because autograd does not record inside an operator's kernel."""
    if do is None:
        return (None,) * 8
    from attnkit.ops.path import path_attention

    q, k, v, w, beta, g, cu_seqlens = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (q, k, v, w, beta)]
        gate = None if g is None else g.detach().requires_grad_()
        o = path_attention(*leaves, gate, scale=ctx.scale, cu_seqlens=cu_seqlens, backend="torch")
        grads = torch.autograd.grad(o, leaves + ([] if gate is None else [gate]), do)
    return *grads[:5], (grads[5] if gate is not None else None), None, None


path_fwd_op.register_autograd(_fwd_backward, setup_context=_setup_fwd)
