"""DeltaNet (Yang et al. 2024), chunk-parallel PyTorch through the shared generalised delta rule."""

from __future__ import annotations

import torch

from attnkit.ops.common.delta import TRITON_MAX_HEAD_DIM, chunk_generalized_delta_rule
from attnkit.ops.common.utils import compute_dtype, run_segments
from attnkit.ops.common.validation import (
    check_cu_seqlens,
    check_like,
    check_qkv,
    check_scalar,
    check_state,
    check_step_qkv,
    resolve_backend,
)

CHUNK_SIZE = 64
# "auto" takes the fused kernels for CUDA tensors: they pass their real-size GPU tests (T = 4k at K = 64 and 128, packed
# 8k; test_vla_triton.py::test_deltanet_real_sizes_on_gpu, on an H200 in the ninth session), and the PyTorch backend
# is the CPU path.
AUTO_TRITON = True

__all__ = ["delta_rule"]


def delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: tuple[torch.Tensor] | None,
    chunk_size: int = CHUNK_SIZE,
    use_triton: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
    """Dense DeltaNet (inputs trusted, see ``delta_rule``): ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``beta [B, T, H]``, ``initial_state = (S [N, H, V, K],)`` or ``None``. Returns ``o [B, T, H, V]`` in
    ``v.dtype`` and ``(S,)`` in float32 (float64 for float64 inputs). ``cu_seqlens`` (kernels only, ``T > 0``):
    packed sequences in one launch per kernel."""
    S0 = None if initial_state is None else initial_state[0]
    if use_triton and q.shape[1] > 0:
        # Imported here: Triton is a Linux-only dependency, and the PyTorch path must import without it.
        from attnkit.ops.common.delta_parallel import delta_rule_triton

        # The kernels read q, k, v and beta as given and form scale·q and beta·k as they load them.
        o, S = delta_rule_triton(q, k, v, None, S0, False, cu_seqlens, beta=beta, scale=scale)
        return o, (S.to(compute_dtype(q, k, v, beta, S0)),)  # float32 inside; float64 for a float64 state
    dtype = compute_dtype(q, k, v, beta, *(initial_state or ()))
    out_dtype = v.dtype
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    beta = beta.to(dtype).transpose(1, 2).unsqueeze(-1)
    o, S = chunk_generalized_delta_rule(q * scale, k, v, beta * k, None if S0 is None else S0.to(dtype), chunk_size)
    return o.transpose(1, 2).to(out_dtype), (S,)


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeltaNet: ``S_t = S_{t-1} + β_t (v_t - S_{t-1} k_t) k_tᵀ``, ``o_t = S_t (scale · q_t)``
    (FLA's ``chunk_delta_rule`` convention: keys are used as given, the caller normalises them).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; one dtype.
        beta: ``[B, T, H]``, any float dtype; ``(0, 2)`` keeps the transition ``I - β k kᵀ`` non-expansive
            for unit keys.
        scale: query scale, ``> 0``; defaults to ``K ** -0.5``.
        initial_state: ``S [N, H, V, K]`` in float32 or float64, or ``None`` (zeros).
        output_final_state: return ``S`` after the last token of every sequence.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences (``B == 1``).
        backend: ``"auto"`` (the kernels for CUDA tensors, PyTorch otherwise), ``"torch"`` or ``"triton"`` (the
            fused generalised delta rule shared with VLA; float16 / bfloat16 / float32, head dims up to 128).

    Returns:
        ``o [B, T, H, V]`` in ``v.dtype`` and ``S [N, H, V, K]`` in float32 (float64 for float64 inputs)
        or ``None``.
    """
    check_qkv(q, k, v, same_heads=True)
    B, T, H, K = k.shape
    V = v.shape[-1]
    check_like("beta", beta, (B, T, H), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale, low=0.0)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        initial_state = check_state("initial_state", initial_state, ((N, H, V, K),), q.device)
    dims = dict(head_dims=(K, V), max_head_dim=TRITON_MAX_HEAD_DIM)
    backend = resolve_backend(
        backend, "delta_rule", q.device, has_triton=True, auto_triton=AUTO_TRITON, dtype=q.dtype, **dims
    )
    use_triton = backend == "triton"

    def dense(q, k, v, beta, state, cu_seqlens=None):
        return delta_rule_chunk(q, k, v, beta, scale, state, use_triton=use_triton, cu_seqlens=cu_seqlens)

    if cu_seqlens is None or (use_triton and T > 0):  # the kernels take packed sequences in one launch
        o, (S,) = dense(q, k, v, beta, initial_state, cu_seqlens)
    else:
        o, (S,) = run_segments(dense, (q, k, v, beta), cu_seqlens, initial_state)
    return o, (S if output_final_state else None)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of DeltaNet, the decode step of :func:`delta_rule`: ``S ← S + β (v − S k) kᵀ``, ``o = S (scale · q)``.

    q, k ``[B, 1, H, K]``, v ``[B, 1, H, V]`` (one dtype), beta ``[B, 1, H]`` (any float dtype), ``S [B, H, V, K]``
    in float32 or float64 (its dtype is the compute dtype), ``scale > 0`` -> ``(o [B, 1, H, V] in v.dtype, S)``, all
    on one device; a shape that would broadcast is refused. ``S`` is read once: ``S_new q = S q + Δ (kᵀq)``.
    """
    B, _, H, K, V = check_step_qkv(q, k, v, same_heads=True)
    check_like("beta", beta, (B, 1, H), q.device)
    (S,) = check_state("S", S, ((B, H, V, K),), q.device)
    scale = check_scalar("scale", scale, low=0.0)
    dtype, out_dtype = S.dtype, v.dtype
    q, k, v = (x[:, 0].to(dtype) for x in (q, k, v))
    Sk, Sq = (S @ torch.stack([k, q], -1)).unbind(-1)
    delta = beta[:, 0, :, None].to(dtype) * (v - Sk)
    S = S + delta[..., :, None] * k[..., None, :]
    o = (Sq + delta * (k * q).sum(-1, keepdim=True)) * scale
    return o[:, None].to(out_dtype), S
