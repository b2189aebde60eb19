"""Chunk-parallel PyTorch backend of VLA (derivation in README.md beside this file).

Gates: every chunk's starting inverse penalty ``A0`` comes from one batched inverse of the prefix sums of
``Uᵀ U`` over chunks; inside a chunk, the Cholesky factor of ``N = I + U A0 Uᵀ`` yields all the
Sherman–Morrison vectors ``r_t`` at once (``A_t = A0 - Σ_{s<=t} r_s r_sᵀ``). The ``S`` update is the
generalised delta rule of ``attnkit.ops.common.delta``; only its state carry loops, over chunks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnkit.ops.common.delta import chunk_generalized_delta_rule
from attnkit.ops.common.utils import autocast_off, compute_dtype

CHUNK_SIZE = 64


@autocast_off
def vla_chunk_gates(
    k_hat: torch.Tensor,
    u: torch.Tensor,
    lam0: float,
    A_init: torch.Tensor | None,
    chunk_size: int,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The write directions ``α̂_t = A_t k̂_t / ‖A_t k̂_t‖`` of a whole sequence, chunk-parallel (``a_t = A_t k̂_t``
    unnormalised when ``normalize_write`` is false).

    Args:
        k_hat, u: ``[B, H, NC * C, K]``, padded to whole chunks (padding rows of ``u`` must be zero and
            those of ``k_hat`` non-zero; their ``α̂`` rows are meaningless and must be masked by the caller).
        A_init: ``A_0`` as ``[B, H, K, K]`` (SPD; its symmetric part is used), or ``None`` for ``I / lam0``.

    Returns:
        ``α̂ [B, H, NC * C, K]`` and the final inverse penalty ``A [B, H, K, K]``, in the dtype of the inputs
        (autocast does not apply).
    """
    B, H, TP, K = k_hat.shape
    C = chunk_size
    NC = TP // C
    eye_k = torch.eye(K, dtype=u.dtype, device=u.device)
    eye_c = torch.eye(C, dtype=u.dtype, device=u.device)
    U = u.reshape(B, H, NC, C, K)
    KH = k_hat.reshape(B, H, NC, C, K)

    # P_c = Σ_{chunks before c} Uᵀ U for c = 0..NC; A at the start of chunk c is (A_init⁻¹ + P_c)⁻¹.
    gram = U.transpose(-1, -2) @ U
    prefix = torch.cat([gram.new_zeros(B, H, 1, K, K), gram.cumsum(2)], 2)
    # With A_init = Cf Cfᵀ, (A_init⁻¹ + P)⁻¹ = Cf (I + Cfᵀ P Cf)⁻¹ Cfᵀ: the matrix inverted has eigenvalues
    # >= 1, so no ill-conditioned A_init⁻¹ is ever formed.
    if A_init is None:
        mid = eye_k + prefix / lam0
        rhs = eye_k * lam0**-0.5
    else:
        cf = torch.linalg.cholesky(0.5 * (A_init + A_init.transpose(-1, -2))).unsqueeze(2)
        mid = eye_k + cf.transpose(-1, -2) @ prefix @ cf
        rhs = cf.transpose(-1, -2)
    E = torch.linalg.solve_triangular(torch.linalg.cholesky(mid), rhs, upper=False)
    A_all = E.transpose(-1, -2) @ E
    A0 = A_all[:, :, :NC]

    # Woodbury on the leading blocks of N = I + U A0 Uᵀ = L Lᵀ: the rows of R = L⁻¹ U A0 are the
    # Sherman–Morrison vectors z_t / sqrt(1 + u_tᵀ z_t), so a_t = A0 k̂_t - Σ_{s<=t} (r_s·k̂_t) r_s.
    M = U @ A0
    L = torch.linalg.cholesky(eye_c + M @ U.transpose(-1, -2))
    R = torch.linalg.solve_triangular(L, M, upper=False)
    a = KH @ A0 - (KH @ R.transpose(-1, -2)).tril() @ R
    alpha = a / a.norm(dim=-1, keepdim=True) if normalize_write else a
    return alpha.reshape(B, H, TP, K), A_all[:, :, NC]


def vla_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    lam0: float,
    eps: float,
    normalize_output: bool,
    initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    chunk_size: int = CHUNK_SIZE,
    gates: Callable[..., tuple[torch.Tensor, torch.Tensor]] = vla_chunk_gates,
    normalize_write: bool = True,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Dense VLA (inputs trusted, see ``vla_attention``).

    Args:
        q, k, u: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        initial_state: ``(S [B, H, V, K], A [B, H, K, K], n [B, H, K])`` or ``None``.
        gates: ``(k̂, u, lam0, A_init, chunk_size) -> (α̂, A_T)`` as :func:`vla_chunk_gates` (the default; called
            with ``normalize_write=False`` as well for the ablation), on ``k̂`` padded to whole chunks.

    Returns:
        ``o [B, T, H, V]`` in ``v.dtype`` and the final ``(S, A, n)`` in float32 (float64 for float64 inputs).
    """
    dtype = compute_dtype(q, k, v, u, *(initial_state or ()))
    B, T, H, K = k.shape
    V, out_dtype = v.shape[-1], v.dtype
    q, k, v, u = (x.to(dtype).transpose(1, 2) for x in (q, k, v, u))
    if initial_state is None:
        S0, A_init, n0 = None, None, k.new_zeros(B, H, K)
    else:
        S0, A_init, n0 = (s.to(dtype) for s in initial_state)
    if T == 0:
        S_end = k.new_zeros(B, H, V, K) if S0 is None else S0
        # A_init's symmetric part, the only part a non-empty sequence reads (as the loop of naive.py)
        eye = torch.eye(K, dtype=dtype, device=k.device)
        A_end = eye.repeat(B, H, 1, 1) / lam0 if A_init is None else 0.5 * (A_init + A_init.transpose(-1, -2))
        # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        on_graph = (q.sum() + k.sum() + v.sum() + u.sum()).to(out_dtype)
        return v.new_zeros(B, 0, H, V, dtype=out_dtype) + on_graph, (S_end, A_end, n0)

    k_hat = k / k.norm(dim=-1, keepdim=True)
    C = chunk_size
    pad = -T % C
    if pad:
        # u = 0 leaves A unchanged; any unit k̂ keeps α̂ finite, and the padded α̂ rows are zeroed below.
        k_hat = torch.cat([k_hat, k_hat.new_full((B, H, pad, K), K**-0.5)], 2)
        u = F.pad(u, (0, 0, 0, pad))
    alpha, A_end = gates(k_hat, u, lam0, A_init, C, **({} if normalize_write else {"normalize_write": False}))
    if pad:
        alpha = alpha[:, :, :T]
        k_hat = k_hat[:, :, :T]

    o, S_end = chunk_generalized_delta_rule(q, k_hat, v, alpha, S0, C)
    n = n0.unsqueeze(2) + k.cumsum(2)
    if normalize_output:
        o = o / (n * q).sum(-1, keepdim=True).clamp_min(eps)
    return o.transpose(1, 2).to(out_dtype), (S_end, A_end, n[:, :, -1])
