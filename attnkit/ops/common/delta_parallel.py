"""The generalised delta rule's Triton kernels as PyTorch operators (``attnkit::delta_rule_fwd`` / ``_bwd``).

Same function and interface as :func:`attnkit.ops.common.delta.chunk_generalized_delta_rule`, with fake
implementations and an autograd registration, so ``torch.compile`` traces through and
``torch.library.opcheck`` holds the registration to the kernels.
"""

from __future__ import annotations

import torch

from attnkit.ops.common.triton.delta_bwd import delta_bwd_fn
from attnkit.ops.common.triton.delta_fwd import delta_fwd_fn
from attnkit.ops.common.triton_utils import float32_dots, interpreting


def _chunk_size() -> int:
    """Tokens per chunk: 64 on the GPU; 32 under the interpreter, so that small tests cross chunks and each chunk
    has two 16-row blocks of the prepare kernel's triangular inverse."""
    return 32 if interpreting() else 64


def _precision(dtype: torch.dtype, single_pass: bool) -> str:
    """float32 inputs get float32-accurate dots: IEEE in the interpreter, 3xTF32 on the tensor cores (the state
    is a running sum over the whole sequence, where single TF32 rounding would accumulate), unless
    ``single_pass``: the caller's own inputs were 16-bit and were widened to float32 on the way (VLA's write
    directions), so one TF32 pass (10-bit mantissa, finer than the inputs' 7 or 10) loses nothing they had."""
    return "tf32" if single_pass else float32_dots(dtype)


def _last_unit(x: torch.Tensor | None) -> torch.Tensor | None:
    """``x`` itself when its channels are adjacent (the kernels take any other strides), else a contiguous copy."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("attnkit::delta_rule_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def delta_rule_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    single_pass: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, S_T, w, hs, u_new, tm)``: the output, the final state, and what the backward reuses. ``a`` None:
    ``a = β k`` from ``beta``. ``cu_seqlens``: packed sequences, all in one launch per kernel (``initial_state`` and
    ``S_T`` then one per sequence)."""
    q, k, v, a, beta = (_last_unit(x) for x in (q, k, v, a, beta))
    state = None if initial_state is None else initial_state.contiguous()
    precision = _precision(k.dtype, single_pass)
    o, ht, saved = delta_fwd_fn(q, k, v, a, state, _chunk_size(), precision, cu_seqlens, beta, scale)
    return o, ht, saved["w"], saved["hs"], saved["u_new"], saved["tm"]


@delta_rule_fwd_op.register_fake
def _(q, k, v, a, initial_state, single_pass=False, cu_seqlens=None, beta=None, scale=1.0):
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NC = -(-T // _chunk_size()) + (0 if cu_seqlens is None else N)
    f32 = dict(dtype=torch.float32)
    return (
        v.new_empty(B, T, H, V),
        k.new_empty(N, H, V, K, **f32),
        k.new_empty(B, H, T, K, **f32),
        k.new_empty(B, H, NC, K, V, **f32),
        k.new_empty(B, H, T, V, **f32),
        k.new_empty(B, H, T, _chunk_size(), **f32),
    )


@torch.library.custom_op("attnkit::delta_rule_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def delta_rule_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    w: torch.Tensor,
    hs: torch.Tensor,
    u_new: torch.Tensor,
    tm: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    single_pass: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, da, dS_0)``, ``da`` the gradient of ``beta`` when ``a`` is None."""
    saved = {"w": w, "hs": hs, "u_new": u_new, "tm": tm}
    q, k, v, a, beta, do = (_last_unit(x) for x in (q, k, v, a, beta, do))
    dht = None if dht is None else dht.contiguous()
    precision = _precision(k.dtype, single_pass)
    return delta_bwd_fn(q, k, v, a, saved, do, dht, _chunk_size(), precision, cu_seqlens, beta, scale)


@delta_rule_bwd_op.register_fake
def _(q, k, v, a, w, hs, u_new, tm, do, dht, single_pass=False, cu_seqlens=None, beta=None, scale=1.0):
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    # The kernels write contiguous gradients whatever the inputs' strides.
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
        a.new_empty(a.shape) if beta is None else beta.new_empty(beta.shape),
        k.new_empty(N, H, V, K, dtype=torch.float32),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, a, initial_state, single_pass, cu_seqlens, beta, scale = (list(inputs) + [False, None, None, 1.0])[:9]
    ctx.single_pass, ctx.cu_seqlens, ctx.scale = bool(single_pass), cu_seqlens, scale
    _, _, w, hs, u_new, tm = output
    ctx.mark_non_differentiable(w, hs, u_new, tm)
    # Unused outputs get None, not zero tensors (hs, w, u_new, tm would be four T-long float32 fills a step).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, a, beta, w, hs, u_new, tm)
    ctx.state_dtype = None if initial_state is None else initial_state.dtype


def _backward(ctx, do, dht, *_):
    if do is None and dht is None:
        return (None,) * 9
    q, k, v, a, beta, w, hs, u_new, tm = ctx.saved_tensors
    do = v.new_zeros(v.shape) if do is None else do  # the output has v's shape and dtype
    dq, dk, dv, da, dh0 = delta_rule_bwd_op(
        q, k, v, a, w, hs, u_new, tm, do, dht, ctx.single_pass, ctx.cu_seqlens, beta, ctx.scale
    )
    dh0 = None if ctx.state_dtype is None else dh0.to(ctx.state_dtype)
    if beta is None:
        return dq, dk, dv, da, dh0, None, None, None, None
    return dq, dk, dv, None, dh0, None, None, da, None


delta_rule_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    single_pass: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attnkit.ops.common.delta.chunk_generalized_delta_rule` through the kernels, in the caller's layout:
    ``q, k, a [B, T, H, K]``, ``v [B, T, H, V]`` (any strides, each in its own float dtype; ``a`` None for
    ``a = β k`` with ``beta [B, T, H]``, DeltaNet), ``initial_state [N, H, V, K]`` or None ->
    ``(o [B, T, H, V] in v.dtype, S_T [N, H, V, K] float32)``, the queries scaled by ``scale`` inside the kernels.
    ``single_pass``: one TF32 pass per dot for float32 tensors that carry 16-bit information (see ``_precision``).
    ``cu_seqlens [N + 1]``: packed sequences (``B == 1``), each its own recurrence from its row of
    ``initial_state``, in one launch per kernel (no host sync)."""
    o, ht, *_ = delta_rule_fwd_op(q, k, v, a, initial_state, single_pass, cu_seqlens, beta, scale)
    return o, ht
