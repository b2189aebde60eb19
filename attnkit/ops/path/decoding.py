"""PaTH decoding: a cache of keys already carried to the newest position.

Because every ``H_s`` is symmetric, ``k_jᵀ (H_{j+1} ··· H_i) q_i = (H_i ··· H_{j+1} k_j)ᵀ q_i``: once each
cached key has been multiplied by all transitions after it, a decode step is ordinary (gated) softmax
decoding. Step ``t`` first applies ``H_t`` to every cached key (a rank-one update), then appends ``k_t``.
"""

from __future__ import annotations

import torch

from ..baselines.softmax import softmax_decode_step
from ..common.utils import segment_bounds
from ..common.validation import (
    check_cache_mask,
    check_cu_seqlens,
    check_decode_cache,
    check_like,
    check_real_slots,
    check_scalar,
    check_step_token,
    check_tensor,
    resolve_backend,
)
from .torch_impl import chunk_path_carry_keys


def path_carry_keys(
    k: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The prefill state of the decoding cache: ``H_T ··· H_{j+1} k_j`` for every key ``j`` of a sequence.

    k, w ``[B, T, H, K]``, beta ``[B, T, H]`` -> ``[B, T, H, K]`` in the dtype of ``k``. Linear in ``T``.
    With ``cu_seqlens`` every packed sequence is carried to its own end. ``backend``: ``"auto"`` (the kernel on
    CUDA, PyTorch elsewhere), ``"torch"`` or ``"triton"`` (one reverse pass over chunks carrying a
    ``K × K`` suffix product in column blocks; float16 / bfloat16 / float32 keys).
    """
    check_tensor("k", k, 4)
    B, T, H, K = k.shape
    check_like("w", w, (B, T, H, K), k.device)
    check_like("beta", beta, (B, T, H), k.device)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, k.device)
    if resolve_backend(backend, "path_carry_keys", k.device, has_triton=True, dtype=k.dtype) == "triton":
        # Imported here: Triton is a Linux-only dependency, and the PyTorch decoding must import without it.
        from .triton.carry import path_carry_fn

        return path_carry_fn(k.contiguous(), w.contiguous(), beta.contiguous(), cu_seqlens)
    parts = [
        chunk_path_carry_keys(k[:, bos:eos], w[:, bos:eos], beta[:, bos:eos])
        for bos, eos in segment_bounds(cu_seqlens, T)
        if eos > bos
    ]
    return torch.cat(parts, dim=1) if parts else k.clone()


def _check_step(
    q: object, k: object, v: object, w: object, beta: object, g: object, k_cache: object, v_cache: object
) -> tuple[int, int, int, int, int]:
    """A decode step's inputs: ``q`` against the caches as :func:`check_decode_cache` takes them, and the new token's
    ``k, w [B, 1, H, K]``, ``v [B, 1, H, V]``, ``beta [B, 1, H]``, ``g [B, 1, HQ]`` (or None), floating and on the
    device of ``q``; ``k`` and ``v`` share ``q``'s dtype. Returns ``(B, HQ, H, K, V)``."""
    B, _, HQ, H, K = check_decode_cache(q, k_cache, v_cache)
    V = v_cache.shape[3]
    check_step_token(q, k, v, H, K, V)
    check_like("w", w, (B, 1, H, K), q.device)
    check_like("beta", beta, (B, 1, H), q.device)
    if g is not None:
        check_like("g", g, (B, 1, HQ), q.device)
    return B, HQ, H, K, V


def path_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: torch.Tensor | None = None,
    g_cache: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cache_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One decoding step of PaTH(-FoX) for a batch of (possibly left-padded) caches; the caches passed in are not
    changed (the new ones are new tensors).

    Args:
        q: ``[B, 1, HQ, K]``; k, w: ``[B, 1, H, K]``; v: ``[B, 1, H, V]``; beta: ``[B, 1, H]``.
        k_cache: ``[B, t, H, K]`` keys carried to position ``t − 1`` (``path_carry_keys`` after a prefill).
        v_cache: ``[B, t, H, V]``.
        g: ``[B, 1, HQ]`` log forget gate of this step, with ``g_cache [B, t, HQ]`` the cumulative gates
            ``G_j`` of the cached positions; both None for PaTH without a gate. With left padding the last
            slot must be the newest real token (or a zero slot when the sequence has none yet).
        cache_mask: ``[B, t+1]`` bool, True for real slots (the new token's, last, included); padding slots
            get a logit of −inf. Every row needs a real slot (a ``ValueError`` otherwise: the one check that reads
            the device; trusted under ``torch.compile``). None: every slot is real.
        backend: ``"auto"`` (the kernel on CUDA, PyTorch elsewhere), ``"torch"`` (the rank-one
            update of every key, concatenation and a softmax step) or ``"triton"`` (the caches copied one slot
            longer, then :func:`path_decode_step_` on the copies: one fused pass that carries every key in float32
            and reads the softmax; ``g_cache`` float32).

    Returns:
        ``(o [B, 1, HQ, V], k_cache [B, t+1, H, K], v_cache [B, t+1, H, V], g_cache [B, t+1, HQ] or None)``.
    """
    B, HQ, H, K, V = _check_step(q, k, v, w, beta, g, k_cache, v_cache)
    t = k_cache.shape[1]
    if (g is None) != (g_cache is None):
        raise ValueError("g_cache: pass both g and g_cache, or neither")
    if cache_mask is not None:
        # its rows' real slots are checked by the step either branch ends in (one read of the device)
        check_cache_mask(cache_mask, (B, t + 1), q.device)
    scale = K**-0.5 if scale is None else check_scalar("scale", scale)
    dtype = k_cache.dtype
    if resolve_backend(backend, "path_decode_step", q.device, has_triton=True, dtype=dtype) == "triton":
        k_cache, v_cache = (torch.cat([c, c.new_empty(B, 1, *c.shape[2:])], dim=1) for c in (k_cache, v_cache))
        if g_cache is not None:
            g_cache = torch.cat([g_cache, g_cache.new_empty(B, 1, HQ)], dim=1)
        o = path_decode_step_(
            q, k, v, w, beta, k_cache, v_cache, t, g, g_cache, scale=scale, cache_mask=cache_mask, backend="triton"
        )
        return o.to(v.dtype), k_cache, v_cache, g_cache
    wt, bt = w[:, 0].to(dtype), beta[:, 0].to(dtype)  # [B, H, K], [B, H]
    # k_j <- H_t k_j = k_j − beta_t (w_t · k_j) w_t for every cached key (padding slots are zero and stay so)
    k_cache = k_cache - (bt[:, None] * (k_cache * wt[:, None]).sum(-1))[..., None] * wt[:, None]
    k_cache = torch.cat([k_cache, k.to(dtype)], dim=1)
    v_cache = torch.cat([v_cache, v.to(v_cache.dtype)], dim=1)
    G_t = None
    if g is not None:
        G_t = g[:, 0].to(g_cache.dtype) + (g_cache[:, -1] if t else 0)
        g_cache = torch.cat([g_cache, G_t[:, None]], dim=1)
    o = softmax_decode_step(q, k_cache, v_cache, cache_mask, g_cache, G_t, scale=scale)
    return o.to(v.dtype), k_cache, v_cache, g_cache


def path_decode_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    t: int,
    g: torch.Tensor | None = None,
    g_cache: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cache_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decoding step of PaTH(-FoX) on a preallocated cache, in place: the function of
    :func:`path_decode_step` without a single copy of the cache. The layers decode with it (outside autograd).

    Args:
        q: ``[B, 1, HQ, K]``; k, w: ``[B, 1, H, K]``; v: ``[B, 1, H, V]``; beta: ``[B, 1, H]``.
        k_cache: ``[B, CAP, H, K]`` contiguous, ``CAP > t``; slots ``[0, t)`` hold the keys carried to position
            ``t − 1``. On return they are carried to ``t`` and slot ``t`` holds ``k``.
        v_cache: ``[B, CAP, H, V]`` contiguous; slot ``t`` receives ``v``.
        t: the number of cached tokens before this one.
        g: ``[B, 1, HQ]`` log forget gate of this step and ``g_cache [B, CAP, HQ]`` float32 cumulative gates
            (slot ``t`` receives ``G_t``); both None for PaTH without a gate.
        cache_mask: ``[B, M]`` bool with ``t < M ≤ CAP``, True for real slots (left padding False); slots from
            ``t + 1`` on are never read. Every row needs a real slot among the first ``t + 1`` (a ``ValueError``
            otherwise: the one check that reads the device; trusted under ``torch.compile``). None: every slot is
            real.
        backend: ``"auto"`` (the kernel on CUDA, PyTorch elsewhere), ``"torch"`` (the rank-one update in place on
            ``k_cache[:, :t]`` and a softmax step over the first ``t + 1`` slots) or ``"triton"`` (one fused pass
            that carries every key in float32 and reads the softmax; GPU, or CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``o [B, 1, HQ, V]`` in ``v_cache.dtype``.
    """
    B, HQ, H, K, V = _check_step(q, k, v, w, beta, g, k_cache, v_cache)
    CAP = k_cache.shape[1]
    if not isinstance(t, int) or not 0 <= t < CAP:
        raise ValueError(f"t: expected an int in [0, {CAP}) (the cache's capacity), got {t!r}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous preallocated cache")
    if (g is None) != (g_cache is None):
        raise ValueError("g_cache: pass both g and g_cache, or neither")
    if g_cache is not None:
        check_like("g_cache", g_cache, (B, CAP, HQ), q.device)
        if g_cache.dtype != torch.float32 or not g_cache.is_contiguous():
            raise ValueError("g_cache: expected a contiguous float32 tensor")
    if cache_mask is not None:
        shape = cache_mask.shape if isinstance(cache_mask, torch.Tensor) else ()
        width = shape[1] if len(shape) == 2 and t < shape[1] <= CAP else CAP
        cache_mask = check_cache_mask(cache_mask, (B, width), q.device).contiguous()
        check_real_slots(cache_mask[:, : t + 1])
    scale = K**-0.5 if scale is None else check_scalar("scale", scale)
    dtype = k_cache.dtype
    use_triton = resolve_backend(backend, "path_decode_step_", q.device, has_triton=True, dtype=dtype) == "triton"

    if not use_triton:
        # k_j <- H_t k_j = k_j − beta_t (w_t · k_j) w_t for the cached keys, in place (padding slots stay zero)
        old, wt, bt = k_cache[:, :t], w[:, 0].to(dtype), beta[:, 0].to(dtype)
        old.sub_((bt[:, None] * (old * wt[:, None]).sum(-1))[..., None] * wt[:, None])
    k_cache[:, t] = k[:, 0]
    v_cache[:, t] = v[:, 0]
    if g is not None:
        g_cache[:, t] = g[:, 0].float() + (g_cache[:, t - 1] if t else 0)
    if not use_triton:
        n = t + 1
        mask = None if cache_mask is None else cache_mask[:, :n]
        g_slots, g_t = (None, None) if g_cache is None else (g_cache[:, :n], g_cache[:, t])
        o = softmax_decode_step(q, k_cache[:, :n], v_cache[:, :n], mask, g_slots, g_t, scale=scale)
        return o.to(v_cache.dtype)
    # Imported here: Triton is a Linux-only dependency, and the PyTorch decoding must import without it.
    from .parallel import path_decode_op

    return path_decode_op(q, w, beta, k_cache, v_cache, t, g_cache, cache_mask, scale)
