"""PaTH and PaTH-FoX attention (arXiv 2505.16381): position encoding by data-dependent Householder-like
transitions. The mathematics and the chunked algorithm are in ``README.md`` beside this file."""

from __future__ import annotations

import torch

from ..common.utils import segment_bounds
from ..common.validation import check_cu_seqlens, check_like, check_qkv, check_scalar, resolve_backend
from .decoding import path_carry_keys, path_decode_step, path_decode_step_
from .torch_impl import chunk_path_fwd

# "auto" takes the fused kernels on CUDA: they pass their GPU tests and outrun the PyTorch backend many times over
# (benchmarks/results/path_h200.md).
AUTO_TRITON = True
# Widest head dims the fused kernels are built for (above 128: 16-position chunks, and the backward's key side
# carries its key chunk instead of a K × K product).
TRITON_MAX_HEAD_DIM = 256

__all__ = ["path_attention", "path_backend", "path_carry_keys", "path_decode_step", "path_decode_step_"]


def path_backend(backend: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the backend :func:`path_attention` runs for queries ``q [B, T, HQ, K]`` and values
    ``v [B, T, H, V]`` when asked for ``backend`` (its errors, for a ``"triton"`` it cannot honour, too). Layers ask it
    whether to fuse their own glue around the attention."""
    dims = dict(head_dims=(q.shape[-1], v.shape[-1]), max_head_dim=TRITON_MAX_HEAD_DIM)
    return resolve_backend(
        backend, "path_attention", q.device, has_triton=True, auto_triton=AUTO_TRITON, dtype=q.dtype, **dims
    )


def path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal PaTH attention; PaTH-FoX when a log forget gate ``g`` is given.

    Logit for ``j <= i``: ``scale · k_jᵀ (H_{j+1} ··· H_i) q_i + G_i − G_j`` with ``H_s = I − beta_s w_s w_sᵀ``
    and ``G = cumsum(g)``, not multiplied by ``scale`` (FLA multiplies its gates by ``scale``: FLA given
    ``g / scale`` computes this function).

    Args:
        q: ``[B, T, HQ, K]`` queries.
        k: ``[B, T, H, K]`` keys, ``HQ % H == 0`` (GQA: query head ``h`` reads key head ``h // (HQ // H)``).
        v: ``[B, T, H, V]`` values.
        w: ``[B, T, H, K]`` transition directions (layers pass unit vectors), any float dtype.
        beta: ``[B, T, H]`` transition strengths (layers pass values in ``(0, 2)``), any float dtype.
        g: ``[B, T, HQ]`` log forget gates (``<= 0``), or None for PaTH without a gate.
        scale: multiplies the dot-product part of the logit; ``K ** -0.5`` by default.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (requires ``B == 1``).
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``;
            ``q, k, v`` float16 / bfloat16 / float32, head dims up to 256): the fused forward (UT transform per
            chunk, right-to-left scan over key chunks, online softmax) and backward (kernels only: the gradients
            between chunks and between superblocks, then the adjoint of the chunk- and superblock-local terms).
            ``"auto"`` takes them for CUDA tensors, the PyTorch backend otherwise.

    Returns:
        ``[B, T, HQ, V]`` in the dtype of ``v``.
    """
    check_qkv(q, k, v)
    B, T, HQ, K = q.shape
    H = k.shape[2]
    check_like("w", w, (B, T, H, K), q.device)
    check_like("beta", beta, (B, T, H), q.device)
    if g is not None:
        check_like("g", g, (B, T, HQ), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, q.device)
    use = path_backend(backend, q, v)
    if T == 0 or B == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        inputs = (q, k, v, w, beta) + (() if g is None else (g,))
        return v.new_zeros(B, T, HQ, v.shape[-1]) + sum(x.sum() for x in inputs).to(v.dtype)
    if use == "triton":
        # Imported here: Triton is a Linux-only dependency, and the PyTorch backend must import without it.
        from .parallel import path_fwd_op

        inputs = (q, k, v, w, beta) + (() if g is None else (g,))
        keep = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)  # the backward takes the UT solve
        return path_fwd_op(q, k, v, w, beta, g, cu_seqlens, float(scale), keep)[0]
    if cu_seqlens is None:
        return chunk_path_fwd(q, k, v, w, beta, g, scale)
    outs = []
    for bos, eos in segment_bounds(cu_seqlens, T):
        if eos > bos:
            sl = slice(bos, eos)
            gs = None if g is None else g[:, sl]
            outs.append(chunk_path_fwd(q[:, sl], k[:, sl], v[:, sl], w[:, sl], beta[:, sl], gs, scale))
    return torch.cat(outs, dim=1) if outs else v.new_zeros(B, T, HQ, v.shape[-1])
