"""LayerNorm in Triton kernels as PyTorch operators (``attnkit::layer_norm`` / ``_bwd``, fake implementations and
an autograd registration) and :func:`layer_norm`, the public function: ``F.layer_norm`` over the last dim with its
output in a dtype of the caller's choosing.

Under autocast PyTorch runs ``layer_norm`` in float32 (a cast of a 16-bit ``x`` to float32, the norm, then the next
linear's cast back, and in the backward the incoming gradient's cast, ``layer_norm_grad_input``, the weight and bias
reductions and a cast back): here one kernel reads ``x`` in its dtype and writes ``y`` in the autocast dtype, and one
kernel (with a sum of its per-program partials) gives ``dx`` in ``x``'s dtype and the weight's and bias's gradients,
statistics and sums in float32 throughout.
"""

from __future__ import annotations

import torch

from attnkit.ops.common.triton.layer_norm import MAX_N, layer_norm_bwd_fn, layer_norm_fwd_fn


@torch.library.custom_op("attnkit::layer_norm", mutates_args=(), device_types=("cuda", "cpu"))
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, N]`` (any strides, any float dtype), ``weight [N]``, ``bias [N]`` or None -> ``(y [M, N]`` in
    ``out_dtype``, ``mean [M]``, ``rstd [M]`` float32``)``: ``y = (x − mean) · rstd · weight + bias``, ``rstd =
    1 / sqrt(var(x) + eps)`` (biased variance), as ``F.layer_norm(x, (N,), weight, bias, eps)``."""
    return layer_norm_fwd_fn(x, weight, bias, eps, out_dtype)


@layer_norm_op.register_fake
def _(x, weight, bias, eps, out_dtype):
    M, N = x.shape
    return x.new_empty(M, N, dtype=out_dtype), x.new_empty(M, dtype=torch.float32), x.new_empty(M, dtype=torch.float32)


@torch.library.custom_op("attnkit::layer_norm_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def layer_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [M, N]`` in ``x``'s dtype, ``dweight [N]``, ``dbias [N]`` in ``weight``'s``)`` from ``dy [M, N]`` (any
    strides and float dtype) and the forward's ``x``, ``mean``, ``rstd``, ``weight``."""
    return layer_norm_bwd_fn(dy, x, mean, rstd, weight)


@layer_norm_bwd_op.register_fake
def _(dy, x, mean, rstd, weight):
    N = x.shape[1]
    return x.new_empty(x.shape), weight.new_empty(N), weight.new_empty(N)


def _setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, mean, rstd, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, *_):
    if dy is None:
        return None, None, None, None, None
    x, mean, rstd, weight = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_bwd_op(dy, x, mean, rstd, weight)
    return dx, dweight, None if ctx.bias_dtype is None else dbias.to(ctx.bias_dtype), None, None


layer_norm_op.register_autograd(_backward, setup_context=_setup)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """``F.layer_norm(x, (N,), weight, bias, eps)`` of ``x [..., N]`` (any float dtype; rows read through their
    stride where ``x`` views as ``[M, N]``, copied otherwise) with the output ``[..., N]`` in ``out_dtype``, through
    the kernels (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``); ``weight, bias [N]`` (``bias`` or None), any
    float dtype, on ``x``'s device. Statistics in float32; ``N`` up to 16384."""
    N = x.shape[-1] if x.dim() else 0
    if not x.is_floating_point() or x.dim() == 0 or not 0 < N <= MAX_N:
        raise ValueError(f"x: expected a float tensor [..., N] with 0 < N <= {MAX_N}, got {x.dtype} {tuple(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.shape != (N,) or not p.is_floating_point() or p.device != x.device):
            raise ValueError(f"{name}: expected a float tensor [{N}] on {x.device}, got {p.dtype} {tuple(p.shape)}")
    if not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype: expected a float dtype, got {out_dtype}")
    return layer_norm_op(x.reshape(-1, N), weight, bias, float(eps), out_dtype)[0].view(x.shape)
