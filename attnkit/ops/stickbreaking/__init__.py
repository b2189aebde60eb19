"""Stick-breaking attention (Tan et al., arXiv 2410.17980): the baseline the PaTH paper compares with.

The mathematics and the blockwise algorithm are in ``README.md`` beside this file."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import segment_bounds
from attnkit.ops.common.validation import check_cu_seqlens, check_qkv, check_scalar, resolve_backend
from attnkit.ops.stickbreaking.decoding import check_attend_current, stickbreaking_decode_step
from attnkit.ops.stickbreaking.torch_impl import BLOCK_SIZE, stickbreaking_dense

__all__ = ["BLOCK_SIZE", "check_attend_current", "stickbreaking_attention", "stickbreaking_decode_step"]


def stickbreaking_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    attend_current: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = BLOCK_SIZE,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal stick-breaking attention with GQA: no softmax and no position encoding.

    For query ``i`` the visible keys are ``j < i`` (the paper's Eq. 1), or ``j <= i`` with ``attend_current``.
    Each visible key breaks off the share ``beta_ij = sigmoid(scale · q_iᵀk_j)`` of the stick the nearer keys left:
    ``A_ij = beta_ij Π_{j < l visible} (1 − beta_il)``, ``o_i = Σ_j A_ij v_j``; the rest of the stick
    (``Π_j (1 − beta_ij)``) is dropped, so a query that sees no key gets 0.

    Computed in log space, blockwise: no tensor larger than one ``block_size × block_size`` block of weights per
    head, and the backward recomputes the weights, so memory is linear in ``T`` (``README.md``).

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]`` with ``HQ % H == 0``; v: ``[B, T, H, V]``; float16 / bfloat16 /
            float32 (float64 for tests), one dtype.
        scale: multiplies ``q_iᵀk_j``; ``K ** -0.5`` by default.
        attend_current: let a query read its own key (the authors' code's option; off in the paper).
        cu_seqlens: ``[N+1]`` int32/int64 offsets of packed sequences (``B == 1``); each restarts.
        block_size: positions per query block and per key block, ``>= 1``.
        backend: ``"auto"`` or ``"torch"`` (blockwise PyTorch); ``"triton"`` raises ``NotImplementedError``:
            stick-breaking attention has no kernel.

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype``; float32 inside (float64 for float64 inputs).
    """
    check_qkv(q, k, v)
    B, T, HQ, K = q.shape
    scale = K**-0.5 if scale is None else check_scalar("scale", scale, low=0.0)
    check_attend_current(attend_current)
    resolve_backend(backend, "stickbreaking_attention", q.device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected an integer >= 1, got {block_size!r}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    if T == 0 or B == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        return v.new_zeros(B, T, HQ, v.shape[-1]) + sum(x.sum() for x in (q, k, v)).to(v.dtype)
    outputs = [
        stickbreaking_dense(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], scale, attend_current, block_size)
        for bos, eos in segment_bounds(cu_seqlens, T)
        if eos > bos
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
