"""VLA's Triton kernels as PyTorch operators: ``attnkit::vla_decode`` (the training-time ``S`` update is the
shared generalised delta rule, ``attnkit/ops/common/delta_parallel.py``)."""

from __future__ import annotations

import torch

from attnkit.ops.vla.triton.decode import vla_decode_fn


@torch.library.custom_op("attnkit::vla_decode", mutates_args=(), device_types=("cuda", "cpu"))
def vla_decode_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    S: torch.Tensor,
    A: torch.Tensor,
    n: torch.Tensor,
    eps: float,
    normalize_output: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step on validated inputs (see :func:`attnkit.ops.vla.vla_decode_step`); float32 states.
    Inference only: no autograd formula is registered (the PyTorch step has one)."""
    return vla_decode_fn(q, k, v, u, S, A, n, eps, normalize_output)


@vla_decode_op.register_fake
def _(q, k, v, u, S, A, n, eps, normalize_output):
    B, _, H, _ = k.shape
    return v.new_empty(B, 1, H, v.shape[-1]), S.new_empty(S.shape), A.new_empty(A.shape), n.new_empty(n.shape)
