"""Linear attention's Triton kernels as PyTorch operators: ``attnkit::linear_attn_fwd`` (with an autograd
registration) and ``attnkit::linear_attn_bwd`` (its backward formula).

``torch.library.custom_op`` with fake implementations, so that ``torch.compile`` traces through the kernels. The
kernels read ``q``, ``k``, ``v`` and ``dO`` through their strides: nothing here copies them.
"""

from __future__ import annotations

import torch

from attnkit.ops.baselines.linear_triton.backward import linear_bwd_fn
from attnkit.ops.baselines.linear_triton.forward import chunk_size, linear_fwd_fn


@torch.library.custom_op("attnkit::linear_attn_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def linear_attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    s0: torch.Tensor | None,
    n0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    normalize: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, S_T, n_T, hs, ns, z)`` (:func:`forward.linear_fwd_fn`) on validated inputs with ``T > 0``; CPU tensors
    run through Triton's interpreter."""
    s0, n0 = (None if x is None else x.contiguous() for x in (s0, n0))
    return linear_fwd_fn(q, k, v, s0, n0, cu_seqlens, normalize, eps)


@linear_attn_fwd_op.register_fake
def _(q, k, v, s0, n0, cu_seqlens, normalize, eps):
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NC = -(-T // chunk_size()) + (0 if cu_seqlens is None else N)
    f32 = dict(dtype=torch.float32)
    return (
        q.new_empty(B, T, HQ, V, dtype=v.dtype),
        q.new_empty(N, H, V, K, **f32),
        q.new_empty(N, H, K, **f32),
        q.new_empty(B, H, NC, K, V, **f32),
        q.new_empty(B, H, NC, K, **f32),
        q.new_empty(B, T, HQ, **f32) if normalize else q.new_empty(0, **f32),
    )


@torch.library.custom_op("attnkit::linear_attn_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def linear_attn_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    hs: torch.Tensor,
    ns: torch.Tensor,
    z: torch.Tensor,
    dst: torch.Tensor | None,
    dnt: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    normalize: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dS_0, dn_0)`` (:func:`backward.linear_bwd_fn`); ``dst``, ``dnt``: the final state's
    gradients or None."""
    dst, dnt = (None if x is None else x.contiguous() for x in (dst, dnt))
    return linear_bwd_fn(do, q, k, v, o, hs, ns, z, dst, dnt, cu_seqlens, normalize, eps)


@linear_attn_bwd_op.register_fake
def _(do, q, k, v, o, hs, ns, z, dst, dnt, cu_seqlens, normalize, eps):
    B, _, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # The kernels write contiguous gradients whatever the inputs' strides.
    f32 = dict(dtype=torch.float32)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        k.new_empty(N, H, V, K, **f32),
        k.new_empty(N, H, K, **f32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, s0, n0, cu_seqlens, normalize, eps = inputs
    o, _, _, hs, ns, z = output
    ctx.mark_non_differentiable(hs, ns, z)
    # Unused outputs get None, not zero fills (the chunk states would be a float32 fill of T·K·V / 64 a head).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, o, hs, ns, z, cu_seqlens)
    ctx.state_dtypes = None if s0 is None else (s0.dtype, n0.dtype)
    ctx.normalize, ctx.eps = normalize, eps


def _backward(ctx, do, dst, dnt, *_):
    if do is None and dst is None and dnt is None:
        return (None,) * 8
    q, k, v, o, hs, ns, z, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do
    dq, dk, dv, ds0, dn0 = linear_attn_bwd_op(
        do, q, k, v, o, hs, ns, z, dst, dnt, cu_seqlens, ctx.normalize, ctx.eps
    )  # fmt: skip
    if ctx.state_dtypes is None:
        return dq, dk, dv, None, None, None, None, None
    return dq, dk, dv, ds0.to(ctx.state_dtypes[0]), dn0.to(ctx.state_dtypes[1]), None, None, None


linear_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def linear_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    normalize: bool,
    eps: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`attnkit.ops.baselines.linear.linear_attention_chunk` through the kernels, inputs trusted (``T > 0``):
    ``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]`` (any strides), ``initial_state = (S [N,H,V,K], n [N,H,K])``
    or None, ``cu_seqlens [N + 1]`` packed sequences (``B == 1``) in one launch per kernel, no host sync. Returns
    ``o [B,T,HQ,V]`` in ``v.dtype`` and the final ``(S, n)`` in float32 (the initial state's dtype when given)."""
    s0, n0 = initial_state if initial_state is not None else (None, None)
    o, st, nt, *_ = linear_attn_fwd_op(q, k, v, s0, n0, cu_seqlens, normalize, eps)
    if initial_state is not None:
        st, nt = st.to(s0.dtype), nt.to(n0.dtype)
    return o, (st, nt)
