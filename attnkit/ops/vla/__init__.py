"""VLA: variational linear attention (arXiv 2605.11196), SPEC §4."""

from __future__ import annotations

import torch

from attnkit.ops.common.delta import TRITON_MAX_HEAD_DIM
from attnkit.ops.common.utils import run_segments
from attnkit.ops.common.validation import (
    check_cu_seqlens,
    check_like,
    check_qkv,
    check_scalar,
    check_state,
    resolve_backend,
)
from attnkit.ops.vla.decoding import VLAState, vla_decode_step
from attnkit.ops.vla.torch_impl import vla_chunk

__all__ = ["vla_attention", "vla_backend", "vla_decode_step", "VLAState"]


def vla_backend(backend: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the backend :func:`vla_attention` runs for queries ``q [B, T, H, K]`` and values
    ``v [B, T, H, V]`` when asked for ``backend`` (its errors, for a ``"triton"`` it cannot honour, too). Layers ask it
    whether to fuse their own glue around the attention."""
    dims = dict(head_dims=(q.shape[-1], v.shape[-1]), max_head_dim=TRITON_MAX_HEAD_DIM)
    return resolve_backend(backend, "vla_attention", q.device, has_triton=True, dtype=q.dtype, **dims)


def vla_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    *,
    lam0: float = 0.1,
    eps: float = 1e-4,
    normalize_output: bool = True,
    normalize_write: bool = True,
    initial_state: VLAState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, VLAState | None]:
    """Variational linear attention: a delta-rule memory written along ``α̂_t = a_t / ‖a_t‖``, ``a_t = A_t k̂_t``,
    where ``A_t = (lam0·I + Σ_{s<=t} u_s u_sᵀ)⁻¹``.

    Args:
        q, k: ``[B, T, H, K]``, already feature-mapped (layers use ``elu + 1``); k is unit-normalised inside.
        v: ``[B, T, H, V]``, same dtype as ``q`` and ``k``.
        u: ``[B, T, H, K]``, any float dtype; the directions that build the inverse penalty.
        lam0: ridge of the penalty at the start of every sequence, ``> 0``.
        eps: floor of the normaliser ``n_tᵀ q_t``, ``> 0``.
        normalize_output: divide ``S_t q_t`` by ``max(n_tᵀ q_t, eps)`` with ``n_t = Σ_{s<=t} k_s``.
        normalize_write: write along the unit ``α̂_t`` (the paper's VLA); false is the paper's ablation that
            writes along ``a_t = A_t k̂_t`` itself, ``S_t = S_{t-1} + (v_t − S_{t-1} k̂_t) a_tᵀ``, whose state then
            grows (like ``d_h / lam0``, by the paper): ``‖a_t‖ ≤ ‖A_t‖ ≤ 1 / lam0``.
        initial_state: ``(S [N, H, V, K], A [N, H, K, K], n [N, H, K])`` in float32 or float64, ``A``
            symmetric positive definite; ``None`` starts from ``(0, I / lam0, 0)``.
        output_final_state: return the state after the last token of every sequence.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences (``B == 1``); each restarts.
        backend: ``"auto"`` (Triton for CUDA tensors of float16 / bfloat16 / float32 and head dims up to 128,
            PyTorch otherwise), ``"torch"`` or ``"triton"``: fused kernels for the gates ``α̂`` (per chunk:
            the inverse penalty, the Sherman–Morrison vectors, the chunks' Gram prefix sums; forward and
            backward), for the ``S`` update (the generalised delta rule) and for the normaliser; packed sequences
            run in the same launches (no host sync).

    Returns:
        ``o [B, T, H, V]`` in ``v.dtype`` and the final ``(S, A, n)`` in float32 (float64 for float64
        inputs), or ``None`` when ``output_final_state`` is false.
    """
    check_qkv(q, k, v, same_heads=True)
    B, T, H, K = k.shape
    V = v.shape[-1]
    check_like("u", u, (B, T, H, K), q.device)
    lam0 = check_scalar("lam0", lam0, low=0.0)
    eps = check_scalar("eps", eps, low=0.0)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        initial_state = check_state("initial_state", initial_state, ((N, H, V, K), (N, H, K, K), (N, H, K)), q.device)
        if torch.linalg.cholesky_ex(initial_state[1] + initial_state[1].mT).info.any():
            raise ValueError("initial_state[1]: A must be symmetric positive definite")
    if vla_backend(backend, q, v) == "triton" and T > 0:
        # Imported here: Triton is a Linux-only dependency, and the PyTorch backend must import without it.
        from attnkit.ops.vla.parallel import vla_triton

        args = (lam0, eps, normalize_output, normalize_write, initial_state, cu_seqlens, output_final_state)
        return vla_triton(q, k, v, u, *args)

    def dense(q, k, v, u, state):
        return vla_chunk(q, k, v, u, lam0, eps, normalize_output, state, normalize_write=normalize_write)

    if cu_seqlens is None:
        o, state = dense(q, k, v, u, initial_state)
    else:
        o, state = run_segments(dense, (q, k, v, u), cu_seqlens, initial_state)
    return o, (state if output_final_state else None)
