"""TAPA through FlexAttention: the baseline a hand-written kernel has to beat (SPEC §3, issue 4).

FlexAttention's ``q·k`` is the amplitude part (``scale = 1/sqrt(dA)``); the phase part lives in ``score_mod``,
which multiplies the amplitude logit by ``cos(2π · (m−n)^alpha · (q_P·k_P)/sqrt(dP))``. ``score_mod`` can only
read captured tensors at scalar indices, so each phase channel is captured as its own ``[B, H, T]`` tensor and
``q_P·k_P`` is a sum of ``dP`` products. That is also the form that compiles with gradients: Inductor refuses
a captured tensor that requires grad and is indexed twice (one ``[B, H, T, dP]`` tensor would be indexed once
per channel), and it accumulates a captured tensor's gradient with one atomic add per score element, so expect
the backward to be slow (``2·dP`` atomics per score).

    o = tapa_flex(q, k, v, theta=0.5, alpha=0.1)                       # eager: materialises the scores
    o = tapa_flex(q, k, v, block_mask=causal_block_mask(T, q.device),
                  flex=compiled_flex_attention())                     # fused kernel (CUDA)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=8)
def causal_block_mask(seq_len: int, device: torch.device | str) -> BlockMask:
    """The causal ``BlockMask`` of a ``seq_len`` sequence, shared by every batch and head; cached because a
    model builds it once per length, so it does not belong in the timed call."""
    return create_block_mask(_causal, None, None, seq_len, seq_len, device=device)


@functools.lru_cache(maxsize=1)
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)`` with static shapes, the form PyTorch documents for a fused kernel.

    Only ``flex_attention`` is compiled, not :func:`tapa_flex`: the captured phase channels stay graph inputs
    (compiling the channel split too failed in Inductor's CPU template, whose captured buffers must be inputs),
    and a new ``score_mod`` closure of the same code reuses the compiled kernel. Static shapes because with
    ``dynamic=True`` Inductor failed to lower it (torch 2.13, CPU: a float argument became a symbolic scalar);
    the price is one compilation per sequence length and grad mode.
    """
    return torch.compile(flex_attention, dynamic=False)


def tapa_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    theta: float = 0.5,
    alpha: float = 0.1,
    *,
    block_mask: BlockMask | None = None,
    flex: Callable[..., torch.Tensor] = flex_attention,
) -> torch.Tensor:
    """Causal TAPA (one dense batch, ``HQ == H``) as a FlexAttention ``score_mod``.

    Args:
        q, k: ``[B, T, H, D]``; the first ``dA = round(theta·D)`` channels are the amplitude part.
        v: ``[B, T, H, V]``.
        theta, alpha: as in :func:`attnkit.ops.tapa_attention` (``0^alpha = 0``).
        block_mask: the causal mask of length ``T`` (:func:`causal_block_mask`); built here when None.
        flex: ``flex_attention`` (eager) or :func:`compiled_flex_attention`.

    Returns:
        ``o [B, T, H, V]`` in ``v.dtype``, differentiable with respect to ``q``, ``k`` and ``v`` (the channel
        split below is ordinary autograd, outside the compiled kernel).
    """
    B, T, H, D = q.shape
    amp_dim = round(theta * D)
    phase_dim = D - amp_dim
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    # float32 copies: the phase is computed in float32 (SPEC §3), and the captured tensors' gradients are
    # accumulated by atomic adds, which in bfloat16 would both lose bits and run slower. The constant
    # 2π/sqrt(dP) rides on the query channels, so score_mod captures no float that changes with D (Dynamo
    # would make such a float symbolic when it recompiles with dynamic shapes, and FlexAttention fails on that).
    phase_scale = 2 * math.pi / math.sqrt(phase_dim)
    q_phase = (qt[..., amp_dim:].float() * phase_scale).permute(3, 0, 1, 2).contiguous().unbind(0)
    k_phase = kt[..., amp_dim:].float().permute(3, 0, 1, 2).contiguous().unbind(0)

    def score_mod(
        score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        dot = q_phase[0][b, h, q_idx] * k_phase[0][b, h, kv_idx]
        for qc, kc in zip(q_phase[1:], k_phase[1:]):
            dot = dot + qc[b, h, q_idx] * kc[b, h, kv_idx]
        dist = (q_idx - kv_idx).to(torch.float32)
        # Masked pairs (dist < 0) reach score_mod too; they get power 0 rather than a NaN from pow.
        power = torch.where(dist > 0, dist.clamp_min(1.0).pow(alpha), 0.0)
        return score * torch.cos(power * dot)

    if block_mask is None:
        block_mask = causal_block_mask(T, q.device)
    o = flex(qt[..., :amp_dim], kt[..., :amp_dim], vt, score_mod=score_mod, block_mask=block_mask, scale=amp_dim**-0.5)
    return o.transpose(1, 2)
