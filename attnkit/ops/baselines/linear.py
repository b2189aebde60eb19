"""Linear attention (Katharopoulos et al. 2020), chunk-parallel PyTorch, optionally normalised."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnkit.ops.common.utils import compute_dtype, run_segments
from attnkit.ops.common.validation import (
    check_cu_seqlens,
    check_qkv,
    check_scalar,
    check_state,
    check_step_qkv,
    resolve_backend,
)

CHUNK_SIZE = 64
TRITON_MAX_HEAD_DIM = 128  # the backward's per-chunk kernels hold whole [K, V] state tiles
# "auto" takes the fused kernels (``linear_triton/``) for CUDA tensors: they passed their GPU tests on an H200
# (test_linear_triton.py's real sizes, sixteenth session) and ran a 32768-token batch's forward+backward in 1.66 /
# 1.44 / 3.48 ms at T = 2k / 8k / 32k, D = 64, against FLA's chunk_linear_attn 2.47 / 2.41 / 3.17
# (benchmarks/results/ops_linear_h200.json).
AUTO_TRITON = True

__all__ = ["linear_attention"]


def linear_attention_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    normalize: bool,
    eps: float,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Dense linear attention (inputs trusted, see ``linear_attention``).

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; ``HQ % H == 0``.
        initial_state: ``(S [B, H, V, K], n [B, H, K])`` or ``None``.

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype`` and the final ``(S, n)`` in float32 (float64 for float64 inputs).
    """
    dtype = compute_dtype(q, k, v, *(initial_state or ()))
    B, T, HQ, K = q.shape
    H, V, out_dtype = k.shape[2], v.shape[-1], v.dtype
    G = HQ // H
    # Query heads grouped per key/value head: [B, H, G, T, K]; keys and values broadcast over G.
    q = q.to(dtype).reshape(B, T, H, G, K).permute(0, 2, 3, 1, 4)
    k, v = (x.to(dtype).transpose(1, 2).unsqueeze(2) for x in (k, v))
    if initial_state is None:
        S0, n0 = k.new_zeros(B, H, V, K), k.new_zeros(B, H, K)
    else:
        S0, n0 = (s.to(dtype) for s in initial_state)

    C = chunk_size
    NC = -(-T // C)
    pad = NC * C - T
    # Zero keys and values write nothing; padded query rows are cut off below.
    qc, kc, vc = (F.pad(x, (0, 0, 0, pad)).reshape(*x.shape[:3], NC, C, x.shape[-1]) for x in (q, k, v))
    kv = vc.transpose(-1, -2) @ kc
    # State at the start of each chunk: S0 plus an exclusive prefix sum of the chunks' writes.
    starts = S0[:, :, None, None] + torch.cat([torch.zeros_like(kv[:, :, :, :1]), kv[:, :, :, :-1]], 3).cumsum(3)
    o = qc @ starts.transpose(-1, -2) + (qc @ kc.transpose(-1, -2)).tril() @ vc
    o = o.reshape(B, H, G, NC * C, V)[:, :, :, :T]
    n = n0[:, :, None, None] + k.cumsum(3)
    if normalize:
        o = o / (n * q).sum(-1, keepdim=True).clamp_min(eps)
    S_end = S0 + kv.sum(3).squeeze(2)
    n_end = n0 + k.sum(3).squeeze(2)
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, HQ, V).to(out_dtype), (S_end, n_end)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalize: bool = True,
    eps: float = 1e-4,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Causal linear attention: ``S_t = S_{t-1} + v_t k_tᵀ``, ``n_t = n_{t-1} + k_t``,
    ``o_t = S_t q_t / max(n_tᵀ q_t, eps)`` (or ``S_t q_t`` when ``normalize`` is false).

    Args:
        q: ``[B, T, HQ, K]``; k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; ``HQ % H == 0`` (GQA). ``q`` and
            ``k`` are already feature-mapped by the caller (layers use ``elu + 1``).
        normalize: divide by the normaliser; eps: its floor, ``> 0``.
        initial_state: ``(S [N, H, V, K], n [N, H, K])`` in float32 or float64, or ``None`` (zeros).
        output_final_state: return the state after the last token of every sequence.
        cu_seqlens: ``[N + 1]`` int32/int64 boundaries of packed sequences (``B == 1``).
        backend: ``"auto"`` (the PyTorch backend for now, until the kernels pass their GPU tests), ``"torch"``
            (chunk-parallel PyTorch) or ``"triton"`` (fused chunked kernels, forward and backward, GQA and
            ``cu_seqlens`` in one launch each; float16 / bfloat16 / float32, head dims up to 128).

    Returns:
        ``o [B, T, HQ, V]`` in ``v.dtype`` and ``(S, n)`` in float32 (float64 for float64 inputs) or ``None``.
    """
    check_qkv(q, k, v)
    B, T, H, K = k.shape
    V = v.shape[-1]
    eps = check_scalar("eps", eps, low=0.0)
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        initial_state = check_state("initial_state", initial_state, ((N, H, V, K), (N, H, K)), q.device)
    dims = dict(head_dims=(K, V), max_head_dim=TRITON_MAX_HEAD_DIM)
    backend = resolve_backend(
        backend, "linear_attention", q.device, has_triton=True, auto_triton=AUTO_TRITON, dtype=q.dtype, **dims
    )

    def dense(q, k, v, state):
        return linear_attention_chunk(q, k, v, normalize, eps, state)

    if backend == "triton" and T > 0:
        # Imported here: Triton is a Linux-only dependency, and the PyTorch path must import without it.
        from attnkit.ops.baselines.linear_triton.chunk import linear_attention_triton

        o, state = linear_attention_triton(q, k, v, normalize, eps, initial_state, cu_seqlens)
    elif cu_seqlens is None:
        o, state = dense(q, k, v, initial_state)
    else:
        o, state = run_segments(dense, (q, k, v), cu_seqlens, initial_state)
    return o, (state if output_final_state else None)


def linear_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, n: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of normalised linear attention, the decode step of :func:`linear_attention` (``normalize=True``).

    q ``[B, 1, HQ, K]``, k ``[B, 1, H, K]``, v ``[B, 1, H, V]`` (one dtype, ``HQ`` a positive multiple of ``H``),
    ``S [B, H, V, K]``, ``n [B, H, K]`` in float32 or float64 (the state's dtype is the compute dtype), ``eps > 0``
    -> ``(o [B, 1, HQ, V] in v.dtype, S, n)``, all on one device; a shape that would broadcast is refused.
    """
    B, HQ, H, K, V = check_step_qkv(q, k, v)
    (S,) = check_state("S", S, ((B, H, V, K),), q.device)
    (n,) = check_state("n", n, ((B, H, K),), q.device)
    eps = check_scalar("eps", eps, low=0.0)
    dtype, out_dtype = S.dtype, v.dtype
    q = q[:, 0].to(dtype).view(B, H, HQ // H, K)
    k, v = k[:, 0].to(dtype), v[:, 0].to(dtype)
    S = S + v[..., :, None] * k[..., None, :]
    n = n + k
    o = (q @ S.transpose(-1, -2)) / (q * n[:, :, None]).sum(-1, keepdim=True).clamp_min(eps)
    return o.reshape(B, 1, HQ, V).to(out_dtype), S, n
