"""VLA decoding: the recurrence of SPEC §4 for one new token per sequence, fused.

The step is the definitional loop at ``T = 1``, arranged so that each state tensor is read once:
``A_{t-1} [u_t, k̂_t]`` is one matmul, and Sherman–Morrison gives
``a_t = A_t k̂_t = A_{t-1} k̂_t − z_t (z_tᵀ k̂_t) / (1 + u_tᵀ z_t)`` without waiting for ``A_t``; likewise
``S_{t-1} [k̂_t, q_t]`` is one matmul and the read of the updated memory is
``S_t q_t = S_{t-1} q_t + (v_t − S_{t-1} k̂_t)(α̂_tᵀ q_t)``. The chunked op at ``T = 1`` pays for padding
a whole chunk, Cholesky factorisations and triangular solves instead.
"""

from __future__ import annotations

import torch

from attnkit.ops.common.delta import TRITON_MAX_HEAD_DIM
from attnkit.ops.common.utils import compute_dtype
from attnkit.ops.common.validation import check_like, check_scalar, check_state, check_step_qkv, resolve_backend

VLAState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

__all__ = ["vla_decode_step"]


def vla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    state: VLAState | None = None,
    *,
    lam0: float = 0.1,
    eps: float = 1e-4,
    normalize_output: bool = True,
    normalize_write: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, VLAState]:
    """One token of VLA for a dense batch: equal to ``vla_attention`` on that token with
    ``initial_state=state, output_final_state=True``.

    Args:
        q, k, u: ``[B, 1, H, K]`` (``q``, ``k`` feature-mapped as for ``vla_attention``); v: ``[B, 1, H, V]``.
        state: ``(S [B, H, V, K], A [B, H, K, K], n [B, H, K])`` in float32 or float64, as returned by
            ``vla_attention`` or by the previous step (``A`` symmetric positive definite: trusted, not
            checked, to keep the step cheap); ``None`` starts from ``(0, I / lam0, 0)``.
        lam0: ridge of the empty state, ``> 0`` (only used when ``state`` is None).
        eps: floor of the normaliser, ``> 0``.
        normalize_output: divide ``S_t q_t`` by ``max(n_tᵀ q_t, eps)``.
        normalize_write: write along ``α̂_t = a_t / ‖a_t‖`` (true) or ``a_t = A_t k̂_t`` (the ablation), as
            ``vla_attention``'s option of that name.
        backend: ``"auto"`` (the kernel for CUDA tensors of float16 / bfloat16 / float32, head dims up to 128,
            when no gradient is needed; PyTorch otherwise), ``"torch"`` or ``"triton"`` (one fused kernel;
            float32 states; no gradient).

    Returns:
        ``o [B, 1, H, V]`` in ``v.dtype`` and the new ``(S, A, n)`` in float32 (float64 for float64 inputs).
    """
    B, _, H, K, V = check_step_qkv(q, k, v, same_heads=True)
    check_like("u", u, (B, 1, H, K), q.device)
    lam0 = check_scalar("lam0", lam0, low=0.0)
    eps = check_scalar("eps", eps, low=0.0)
    if state is not None:
        state = check_state("state", state, ((B, H, V, K), (B, H, K, K), (B, H, K)), q.device)
    dtype, out_dtype = compute_dtype(q, k, v, u, *(state or ())), v.dtype
    use_triton = resolve_backend(backend, "vla_decode_step", q.device, has_triton=True, dtype=dtype) == "triton"
    if use_triton and backend == "auto":
        # The kernel (validated on an H200) has no backward, and tiles of up to 128 channels.
        needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, u, *(state or ())))
        use_triton = not needs_grad and max(K, V) <= TRITON_MAX_HEAD_DIM
    if state is None:
        S = q.new_zeros(B, H, V, K, dtype=dtype)
        A = torch.eye(K, dtype=dtype, device=q.device).expand(B, H, K, K) / lam0
        n = q.new_zeros(B, H, K, dtype=dtype)
    else:
        S, A, n = (s.to(dtype) for s in state)

    if use_triton:
        # Imported here: Triton is a Linux-only dependency, and the PyTorch step must import without it.
        from attnkit.ops.vla.parallel import vla_decode_op

        # The kernel reads the inputs in their own dtypes and computes in float32.
        o, S, A, n = vla_decode_op(q, k, v, u, S, A, n, eps, normalize_output, normalize_write)
        return o, (S, A, n)

    q, k, v, u = (x.squeeze(1).to(dtype) for x in (q, k, v, u))  # [B, H, K] / [B, H, V]

    # Eager PyTorch pays per op at this size, so the step is written in as few ops as possible.
    k_hat = k / k.norm(dim=-1, keepdim=True)
    X = torch.stack([u, k_hat], -1)
    AX = A @ X  # [z, A k̂]
    XAX = X.mT @ AX  # [[uᵀz, uᵀA k̂], [k̂ᵀz, k̂ᵀA k̂]]
    z, Ak = AX.unbind(-1)
    c = XAX[..., 0, :1] + 1  # 1 + uᵀz >= 1
    # (z / sqrt(c)) (z / sqrt(c))ᵀ rounds symmetrically, so A stays exactly symmetric.
    zs = z * c.rsqrt()
    A = torch.addcmul(A, zs[..., :, None], zs[..., None, :], value=-1)
    a = torch.addcmul(Ak, z, XAX[..., 1, :1] / c, value=-1)
    alpha = a / a.norm(dim=-1, keepdim=True) if normalize_write else a

    Sk, Sq = (S @ torch.stack([k_hat, q], -1)).unbind(-1)
    delta = v - Sk
    S = torch.addcmul(S, delta[..., :, None], alpha[..., None, :])
    o = torch.addcmul(Sq, delta, (alpha * q).sum(-1, keepdim=True))
    n = n + k
    if normalize_output:
        o = o / (n * q).sum(-1, keepdim=True).clamp_min(eps)
    return o[:, None].to(out_dtype), (S, A, n)
