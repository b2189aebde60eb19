"""Linear attention's feature map ``φ(x) = elu(x) + 1`` of the queries and the keys in Triton kernels, as PyTorch
operators (``attnkit::elu_plus_one`` / ``_bwd``, fake implementations and an autograd registration) and
:func:`elu_plus_one`, the public function.

What it saves against ``F.elu(q) + 1, F.elu(k) + 1``: in the forward one launch for both tensors instead of an elu
and an add kernel each (four launches), each tensor read once and written once instead of twice each; in the backward
one launch instead of an ``elu_backward`` each, the same bytes (the gradient and the saved input read, the input's
gradient written). The saved tensors are the same: the inputs. Rounded once (PyTorch rounds ``elu(x)`` and then
``elu(x) + 1`` to a 16-bit dtype).
"""

from __future__ import annotations

import torch

from attnkit.ops.common.triton.feature_map import elu_plus_one_bwd_fn, elu_plus_one_fwd_fn


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


@torch.library.custom_op("attnkit::elu_plus_one", mutates_args=(), device_types=("cuda", "cpu"))
def elu_plus_one_op(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(elu(q) + 1, elu(k) + 1)`` of ``q`` and ``k`` (any shapes, strides and float dtypes), contiguous, each in
    its input's dtype."""
    return elu_plus_one_fwd_fn(_contiguous(q), _contiguous(k))


@elu_plus_one_op.register_fake
def _(q, k):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("attnkit::elu_plus_one_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def elu_plus_one_bwd_op(
    q: torch.Tensor, k: torch.Tensor, dfq: torch.Tensor, dfk: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)``, contiguous in the dtypes of ``q`` and ``k``, from the forward's inputs and its outputs'
    gradients ``dfq``, ``dfk`` (any strides and float dtypes)."""
    return elu_plus_one_bwd_fn(*(_contiguous(x) for x in (q, k, dfq, dfk)))


@elu_plus_one_bwd_op.register_fake
def _(q, k, dfq, dfk):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dfq, dfk):
    q, k = ctx.saved_tensors
    return elu_plus_one_bwd_op(q, k, dfq, dfk)


elu_plus_one_op.register_autograd(_backward, setup_context=_setup)


def elu_plus_one(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.elu(q) + 1, F.elu(k) + 1)`` through the kernels (CUDA tensors, or CPU under ``TRITON_INTERPRET=1``):
    ``q`` and ``k`` float tensors of any shapes on one device, each result in its input's shape and dtype, computed
    in float32 and rounded once."""
    for name, x in (("q", q), ("k", k)):
        if not x.is_floating_point() or x.device != q.device:
            raise ValueError(f"{name}: expected a float tensor on {q.device}, got {x.dtype} on {x.device}")
    return elu_plus_one_op(q, k)
