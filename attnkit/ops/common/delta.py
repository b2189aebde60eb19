"""The chunk-parallel generalised delta rule shared by VLA (``a = α̂``) and DeltaNet (``a = β k``).

Recurrence, per head: ``S_t = S_{t-1} + (v_t - S_{t-1} k_t) a_tᵀ``, ``o_t = S_t q_t``. Within a chunk of
``C`` tokens the pseudo-values ``Δ_t = v_t - S_{t-1} k_t`` satisfy the unit lower-triangular system
``(I + strict_tril(K Aᵀ)) Δ = V - K S0ᵀ`` (the WY/UT form), so ``S_end = S0 + Δᵀ A`` and
``O = Q S0ᵀ + tril(Q Aᵀ) Δ``. Only the two small matmuls that carry ``S`` across chunks are sequential.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_generalized_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the generalised delta rule over whole chunks.

    Args:
        q, k, a: ``[B, H, T, K]``; v: ``[B, H, T, V]``; one floating dtype, which is the compute dtype.
        initial_state: ``S_0`` as ``[B, H, V, K]`` or ``None`` (zeros).
        chunk_size: tokens per chunk ``C``; ``T`` need not be a multiple of it.

    Returns:
        ``o [B, H, T, V]`` and the final state ``S_T [B, H, V, K]``, in the dtype of the inputs.
    """
    B, H, T, K = k.shape
    V = v.shape[-1]
    S = k.new_zeros(B, H, V, K) if initial_state is None else initial_state
    if T == 0:  # empty, but on the inputs' graph, so that a backward through it gives empty gradients
        return v.new_zeros(B, H, 0, V) + (q.sum() + k.sum() + v.sum() + a.sum()).to(v.dtype), S
    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    if pad:
        # Zero rows are no-ops: a = 0 writes nothing and q = 0 reads nothing.
        q, k, v, a = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, a))
    q, k, a = (x.reshape(B, H, NC, C, K) for x in (q, k, a))
    v = v.reshape(B, H, NC, C, V)

    # unitriangular=True ignores the (zero) diagonal, so the strict lower triangle is the whole matrix.
    t_mat = (k @ a.transpose(-1, -2)).tril(-1)
    # The solve in the inputs' dtype: under autocast t_mat is 16-bit, and torch.linalg has no 16-bit solves.
    with torch.autocast(k.device.type, enabled=False):
        sol = torch.linalg.solve_triangular(t_mat.to(k.dtype), torch.cat([v, k], -1), upper=False, unitriangular=True)
    v_new, w = sol.split([V, K], dim=-1)

    # unbind once so the backward assembles each gradient with one stack, not one scatter per chunk.
    v_chunks, w_chunks, a_chunks = v_new.unbind(2), w.unbind(2), a.unbind(2)
    starts, deltas = [], []
    for c in range(NC):
        starts.append(S)
        delta = v_chunks[c] - w_chunks[c] @ S.transpose(-1, -2)
        deltas.append(delta)
        S = S + delta.transpose(-1, -2) @ a_chunks[c]
    S0 = torch.stack(starts, 2)
    delta = torch.stack(deltas, 2)

    o = q @ S0.transpose(-1, -2) + (q @ a.transpose(-1, -2)).tril() @ delta
    return o.reshape(B, H, NC * C, V)[:, :, :T], S


# The Triton kernels fit sm_90's shared memory up to K = V = 128 (compiled with Triton 3.6; the largest, the WY part
# of the backward, needs ~190 KB there).
TRITON_MAX_HEAD_DIM = 128
