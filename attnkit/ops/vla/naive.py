"""Definitional VLA loop (SPEC §4), token by token, for tests only."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import compute_dtype


def vla_gates_naive(
    k: torch.Tensor,
    u: torch.Tensor,
    lam0: float = 0.1,
    A_init: torch.Tensor | None = None,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sherman–Morrison recursion for the gates.

    Args:
        k, u: ``[B, T, H, K]``; A_init: ``[B, H, K, K]`` or ``None`` for ``I / lam0``.
        normalize_write: write along ``α̂_t = a_t / ‖a_t‖`` (the paper's VLA) or, when false, along
            ``a_t = A_t k̂_t`` itself (the no-normalisation ablation).

    Returns:
        ``k̂ [B, T, H, K]``, the write directions ``[B, T, H, K]`` and the final ``A [B, H, K, K]``, in the
        compute dtype.
    """
    dtype = compute_dtype(k, u, A_init)
    B, T, H, K = k.shape
    k, u = k.to(dtype), u.to(dtype)
    if A_init is None:
        A = torch.eye(K, dtype=dtype, device=k.device).repeat(B, H, 1, 1) / lam0
    else:
        # Only the symmetric part of A_0 is meaningful; using it keeps gradients comparable with torch_impl.
        A = 0.5 * (A_init + A_init.transpose(-1, -2)).to(dtype)
    k_hats, alphas = [], []
    for t in range(T):
        k_hat = k[:, t] / k[:, t].norm(dim=-1, keepdim=True)
        z = (A @ u[:, t, :, :, None]).squeeze(-1)
        A = A - z[..., :, None] * z[..., None, :] / (1 + (u[:, t] * z).sum(-1))[..., None, None]
        a = (A @ k_hat[..., None]).squeeze(-1)
        k_hats.append(k_hat)
        alphas.append(a / a.norm(dim=-1, keepdim=True) if normalize_write else a)
    empty = k.new_zeros(B, 0, H, K)
    k_hat = torch.stack(k_hats, 1) if T else empty
    alpha = torch.stack(alphas, 1) if T else empty
    return k_hat, alpha, A


def vla_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    lam0: float = 0.1,
    eps: float = 1e-4,
    normalize_output: bool = True,
    initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    normalize_write: bool = True,
):
    """VLA by its recurrence. ``q, k, u [B, T, H, K]``, ``v [B, T, H, V]``,
    ``initial_state = (S [B, H, V, K], A [B, H, K, K], n [B, H, K])``. Returns ``(o [B, T, H, V], state)``
    with ``o`` in ``v.dtype`` and the state (or ``None``) in the compute dtype."""
    dtype = compute_dtype(q, k, v, u, *(initial_state or ()))
    B, T, H, K = k.shape
    V, out_dtype = v.shape[-1], v.dtype
    q, k, v, u = (x.to(dtype) for x in (q, k, v, u))
    if initial_state is None:
        S, A_init, n = q.new_zeros(B, H, V, K), None, q.new_zeros(B, H, K)
    else:
        S, A_init, n = (s.to(dtype) for s in initial_state)
    k_hat, alpha, A = vla_gates_naive(k, u, lam0, A_init, normalize_write)
    outputs = []
    for t in range(T):
        Sk = (S @ k_hat[:, t, :, :, None]).squeeze(-1)
        S = S + (v[:, t] - Sk)[..., :, None] * alpha[:, t, :, None, :]
        n = n + k[:, t]
        o = (S @ q[:, t, :, :, None]).squeeze(-1)
        if normalize_output:
            o = o / (n * q[:, t]).sum(-1, keepdim=True).clamp_min(eps)
        outputs.append(o)
    o = torch.stack(outputs, 1) if T else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), ((S, A, n) if output_final_state else None)
