"""Chunked PaTH in PyTorch: the UT transform per chunk and a right-to-left scan over key chunks.

The CPU backend and the oracle of the Triton kernels. ``README.md`` beside this file derives every
formula used here. Inside, tensors are ``[B, H, N, C, D]``: ``N`` chunks of ``C`` positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.utils import compute_dtype


def _chunk(x: torch.Tensor, C: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, H, *D] -> [B, H, N, C, *D]``, zero-padded to a multiple of ``C``.

    Zero padding is harmless: a padded position has ``beta = 0`` (its transition is the identity) and comes
    after every real position, so causality keeps it out of every real output.
    """
    B, T = x.shape[:2]
    pad = (-T) % C
    x = x.to(dtype)
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.reshape(B, (T + pad) // C, C, *x.shape[2:])
    return x.movedim(3, 1)


def ut_transform(w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``M = (I + diag(beta) strict_tril(W Wᵀ))⁻¹ diag(beta)`` per chunk, so that the transitions of a chunk
    compose as ``H_1 H_2 ··· H_C = I − Wᵀ Mᵀ W``, and any run ``H_a ··· H_b`` uses the block ``M[a:b, a:b]``.

    w ``[..., C, K]``, beta ``[..., C]`` -> M ``[..., C, C]`` (lower triangular).
    """
    C = w.shape[-2]
    eye = torch.eye(C, dtype=w.dtype, device=w.device)
    L = eye + beta[..., :, None] * (w @ w.transpose(-1, -2)).tril(-1)
    return torch.linalg.solve_triangular(L, torch.diag_embed(beta), upper=False, unitriangular=True)


def chunk_keys(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, C: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kc, wc, M, WK, kt)`` per chunk (``[B, H, N, C, ·]``): the chunked keys and directions, the UT matrix, the
    products ``(w_s · k_j)`` and the keys carried to their chunk's end, ``k̃_j = H_C ··· H_{j+1} k_j``."""
    kc, wc = _chunk(k, C, dtype), _chunk(w, C, dtype)
    M = ut_transform(wc, _chunk(beta, C, dtype))  # [B, H, N, C, C]
    WK = wc @ kc.transpose(-1, -2)
    kt = kc - (WK.tril(-1).transpose(-1, -2) @ M.transpose(-1, -2)) @ wc
    return kc, wc, M, WK, kt


def chunk_local_terms(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    C: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor | None]:
    """What each chunk contributes on its own, in ``dtype`` and ``[B, H*, N, C, ·]``: the UT matrix ``M``
    ``[B,H,N,C,C]``, the chunked directions ``w`` ``[B,H,N,C,K]``, the keys carried to their chunk's end ``kt``
    ``[B,H,N,C,K]``, the queries carried to their chunk's start ``x`` ``[B,HQ,N,C,K]``, the intra-chunk logits
    ``s`` ``[B,HQ,N,C,C]`` (scaled, gated, causally masked with ``-inf``) and the cumulative gates ``G``
    ``[B,HQ,N,C]`` (None without ``g``). Differentiable (the backward of the PyTorch forward is autograd)."""
    HQ, H = q.shape[2], k.shape[2]
    groups = HQ // H
    qc = _chunk(q, C, dtype)
    kc, wc, M, WK, kt = chunk_keys(k, w, beta, C, dtype)

    def per_query_head(x: torch.Tensor) -> torch.Tensor:
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    wq, Mq, kq, WKq = (per_query_head(x) for x in (wc, M, kc, WK))
    QWM = (qc @ wq.transpose(-1, -2)).tril() @ Mq  # (q_i · w_t) for t <= i, times M
    # intra-chunk logits: k_jᵀ (H_{j+1} ··· H_i) q_i, every run read off the block of M
    s = (qc @ kq.transpose(-1, -2) - QWM @ WKq.tril(-1)) * scale
    # queries carried to the start of their chunk, q̃_i = H_1 ··· H_i q_i
    x = qc - QWM @ wq
    G = None
    if g is not None:
        G = _chunk(g, C, dtype)  # [B, HQ, N, C]
        G = G.flatten(2).cumsum(-1).view_as(G)
        s = s + G[..., :, None] - G[..., None, :]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    return dict(M=M, w=wc, kt=kt, x=x, s=s, G=G)


def chunk_path_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    chunk_size: int = 64,
) -> torch.Tensor:
    """PaTH(-FoX) of one dense batch. q ``[B,T,HQ,K]``, k/w ``[B,T,H,K]``, v ``[B,T,H,V]``, beta ``[B,T,H]``,
    g ``[B,T,HQ]`` or None -> o ``[B,T,HQ,V]`` in the dtype of ``v``. Differentiable by autograd."""
    B, T, HQ, K = q.shape
    H = k.shape[2]
    groups = HQ // H
    dtype = compute_dtype(q, k, v, w, beta, g)
    C = min(chunk_size, T)
    terms = chunk_local_terms(q, k, w, beta, g, scale, C, dtype)
    s, G = terms["s"], terms["G"]
    N = s.shape[2]

    def per_query_head(x: torch.Tensor) -> torch.Tensor:
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    wq, Mq, ktq, vq = (per_query_head(x) for x in (terms["w"], terms["M"], terms["kt"], _chunk(v, C, dtype)))
    x = terms["x"][:, :, 1:]  # chunk 0 has no earlier keys

    # online softmax over key chunks, right to left; the running max is a constant for autograd
    m = s.amax(-1).detach()
    p = torch.exp(s - m[..., None])
    l = p.sum(-1)
    acc = p @ vq
    for d in range(1, N):
        # query chunks c = d .. N-1 meet key chunks c - d; x holds their queries carried to chunk c-d+1
        s = (x @ ktq[:, :, : N - d].transpose(-1, -2)) * scale
        if G is not None:
            s = s + G[:, :, d:, :, None] - G[:, :, : N - d, None, :]
        m_new = torch.maximum(m[:, :, d:], s.amax(-1).detach())
        r = torch.exp(m[:, :, d:] - m_new)
        p = torch.exp(s - m_new[..., None])
        l = torch.cat([l[:, :, :d], l[:, :, d:] * r + p.sum(-1)], dim=2)
        acc = torch.cat([acc[:, :, :d], acc[:, :, d:] * r[..., None] + p @ vq[:, :, : N - d]], dim=2)
        m = torch.cat([m[:, :, :d], m_new], dim=2)
        if d < N - 1:
            # carry the queries of chunks d+1 .. N-1 across key chunk c-d: x <- x (I − Wᵀ M W)
            x, wb, Mb = x[:, :, 1:], wq[:, :, 1 : N - d], Mq[:, :, 1 : N - d]
            x = x - ((x @ wb.transpose(-1, -2)) @ Mb) @ wb
    o = acc / l[..., None]  # [B, HQ, N, C, V]
    o = o.movedim(1, 3).reshape(B, N * C, HQ, -1)[:, :T]
    return o.to(v.dtype)


def chunk_path_carry_keys(k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64) -> torch.Tensor:
    """Every key multiplied by all later transitions of its sequence: ``H_T ··· H_{j+1} k_j``.

    k/w ``[B,T,H,K]``, beta ``[B,T,H]`` -> ``[B,T,H,K]`` in the dtype of ``k``. Linear in ``T``: one
    reverse pass over chunks that carries a ``K × K`` suffix product ``P_{c+1} ··· P_N``.
    """
    B, T, H, K = k.shape
    dtype = compute_dtype(k, w, beta)
    C = min(chunk_size, T)
    kc, wc, M, _, kt = chunk_keys(k, w, beta, C, dtype)
    N = kc.shape[2]
    eye = torch.eye(K, dtype=dtype, device=k.device)
    suffix = eye.expand(B, H, K, K)
    out = [None] * N
    for c in range(N - 1, -1, -1):
        out[c] = kt[:, :, c] @ suffix
        # P_c = H_1 ··· H_C = I − Wᵀ Mᵀ W of chunk c
        P = eye - wc[:, :, c].transpose(-1, -2) @ (M[:, :, c].transpose(-1, -2) @ wc[:, :, c])
        suffix = P @ suffix
    kf = torch.stack(out, dim=2)  # [B, H, N, C, K]
    return kf.movedim(1, 3).reshape(B, N * C, H, K)[:, :T].to(k.dtype)
