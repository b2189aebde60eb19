"""A numerical check of Proposition 2 of the VLA paper (arXiv 2605.11196): is the transition ``I − α̂ k̂ᵀ`` of
the state update non-expansive?

VLA updates ``S_t = S_{t−1}(I − k̂_t α̂_tᵀ) + v_t α̂_tᵀ`` (SPEC §4; the paper writes the transition as
``I − α̂ k̂ᵀ``, the transpose, which has the same singular values and eigenvalues). The paper's text says its spectral
norm is 1. What holds in general is weaker: with unit ``k̂``, ``α̂`` and ``c = α̂ᵀk̂`` (``0 < c ≤ 1`` because
``α̂ ∝ A k̂`` with ``A`` SPD), the eigenvalues are 1 (``K − 1`` times) and ``1 − c ∈ [0, 1)``, so the spectral
*radius* is 1; but the two singular values on ``span{k̂, α̂}`` satisfy ``σ₁² + σ₂² = 3 − 2c`` and
``σ₁σ₂ = 1 − c``, so

    ‖I − α̂ k̂ᵀ‖₂ = sqrt((3 − 2c + sqrt(5 − 4c)) / 2)

which is 1 only when ``c = 1`` (``α̂ = k̂``) and grows to the golden ratio 1.618 as ``c → 0``. This module measures
both, by SVD and by eigenvalues, on the ``k̂`` and ``α̂`` the VLA op computes, for random inputs and for the inputs
a (trained) model's VLA layers see on a batch:

    from attnkit.experiments.vla_proposition import check_proposition2
    stats = check_proposition2(model, input_ids)   # model, input_ids optional; see the docstring
    stats["random"]["radius_is_one"], stats["random"]["norm_is_one"], stats["model"]["frac_norm_above_1"]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attnkit.layers import VLAAttention
from attnkit.layers.base import check_int
from attnkit.ops.common.validation import check_scalar
from attnkit.ops.vla.torch_impl import vla_chunk, vla_chunk_gates

__all__ = ["check_proposition2", "model_gates", "random_gates", "transition_stats", "vla_gates"]


def vla_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, lam0: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k̂, α̂)`` ``[B, T, H, K]`` in float64, exactly as the PyTorch VLA op computes them for these inputs.

    The op runs in float64 with a gate function that records what it is handed (``k̂``, padded to whole chunks)
    and what it returns (``α̂``), so no line of the op's own padding and normalisation is repeated here.
    ``q, k, v, u`` as :func:`attnkit.ops.vla_attention` takes them (``k`` feature-mapped, ``u`` as the layer
    makes it); ``q`` and ``v`` do not change the gates.
    """
    recorded: dict[str, torch.Tensor] = {}

    def gates(k_hat, u, lam0, A_init, chunk_size):
        alpha, A = vla_chunk_gates(k_hat, u, lam0, A_init, chunk_size)
        recorded.update(k_hat=k_hat, alpha=alpha)
        return alpha, A

    with torch.no_grad():
        vla_chunk(*(x.double() for x in (q, k, v, u)), lam0, 1e-4, True, None, gates=gates)
    T = k.shape[1]
    return recorded["k_hat"][:, :, :T].transpose(1, 2), recorded["alpha"][:, :, :T].transpose(1, 2)


def random_gates(
    batch: int = 4, seq_len: int = 256, num_heads: int = 4, head_dim: int = 32, lam0: float = 0.1, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k̂, α̂)`` of random inputs shaped as a VLA layer makes them: ``k = elu(x) + 1`` of a standard normal ``x``,
    ``u`` a random unit vector divided by ``sqrt(K)``; ``[batch, seq_len, num_heads, head_dim]`` in float64."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, num_heads, head_dim)
    q, k, v, u = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
    k = F.elu(k) + 1
    u = F.normalize(u, dim=-1) * head_dim**-0.5
    return vla_gates(q, k, v, u, lam0)


def model_gates(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k̂, α̂)`` ``[N, K]`` in float64 of every token, head and VLA layer of ``model`` on ``input_ids [B, T]``.

    ``model`` is any module that contains :class:`VLAAttention` layers and is called as ``model(input_ids,
    use_cache=False)`` (an ``AttnKitForCausalLM``, a hybrid stack included). Each VLA layer's input is captured by a
    hook during one forward; its projections give ``q, k, v, u``, and :func:`vla_gates` the gates with the layer's
    own ``lam0``.
    """
    layers = [m for m in model.modules() if isinstance(m, VLAAttention)]
    if not layers:
        raise ValueError(f"model: has no VLAAttention layer ({type(model).__name__})")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids: expected an integer tensor [B, T], got {getattr(input_ids, 'shape', input_ids)}")
    inputs: dict[VLAAttention, torch.Tensor] = {}

    def capture(layer, args, kwargs):
        inputs[layer] = args[0] if args else kwargs["hidden_states"]

    hooks = [layer.register_forward_pre_hook(capture, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            model(input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    k_hats, alphas = [], []
    with torch.no_grad():
        for layer in layers:
            k_hat, alpha = vla_gates(*layer._qkvu(inputs[layer]), layer.lam0)
            k_hats.append(k_hat.reshape(-1, k_hat.shape[-1]))
            alphas.append(alpha.reshape(-1, alpha.shape[-1]))
    return torch.cat(k_hats), torch.cat(alphas)


def transition_stats(k_hat: torch.Tensor, alpha: torch.Tensor, tol: float = 1e-6) -> dict:
    """Spectral norm and spectral radius of ``I − α̂ k̂ᵀ`` for every row of ``k_hat`` and ``alpha`` (unit vectors,
    ``[..., K]``, one shape), computed in float64 by ``svdvals`` and ``eigvals``.

    Returns ``count``; ``norm_max``, ``norm_median``, ``norm_min``; ``radius_max``, ``radius_median``,
    ``radius_min``; ``frac_norm_above_1`` (norm ``> 1 + tol``); ``frac_radius_off_1`` (``|radius − 1| > tol``);
    ``cos_min`` and ``cos_median`` of ``c = α̂ᵀk̂``; ``closed_form_error``, the largest gap between the measured norm
    and ``sqrt((3 − 2c + sqrt(5 − 4c)) / 2)``; and the verdicts ``radius_is_one`` (every radius within ``tol`` of 1)
    and ``norm_is_one`` (every norm within ``tol`` of 1), as plain Python values.
    """
    tol = check_scalar("tol", tol, low=0.0)
    if not isinstance(k_hat, torch.Tensor) or not isinstance(alpha, torch.Tensor) or k_hat.shape != alpha.shape:
        raise ValueError(f"alpha: expected the shape of k_hat {tuple(getattr(k_hat, 'shape', ()))}")
    if k_hat.dim() < 1 or k_hat.numel() == 0:
        raise ValueError(f"k_hat: expected a non-empty [..., K] tensor, got shape {tuple(k_hat.shape)}")
    K = k_hat.shape[-1]
    k_hat, alpha = k_hat.double().reshape(-1, K), alpha.double().reshape(-1, K)
    M = torch.eye(K, dtype=torch.float64) - alpha[:, :, None] * k_hat[:, None, :]
    norm = torch.linalg.svdvals(M)[:, 0]
    radius = torch.linalg.eigvals(M).abs().amax(-1)
    c = (alpha * k_hat).sum(-1)
    closed_form = ((3 - 2 * c + (5 - 4 * c).clamp_min(0).sqrt()) / 2).sqrt()
    return {
        "count": int(norm.numel()),
        "norm_max": norm.max().item(),
        "norm_median": norm.median().item(),
        "norm_min": norm.min().item(),
        "radius_max": radius.max().item(),
        "radius_median": radius.median().item(),
        "radius_min": radius.min().item(),
        "frac_norm_above_1": (norm > 1 + tol).double().mean().item(),
        "frac_radius_off_1": ((radius - 1).abs() > tol).double().mean().item(),
        "cos_min": c.min().item(),
        "cos_median": c.median().item(),
        "closed_form_error": (norm - closed_form).abs().max().item(),
        "radius_is_one": bool(((radius - 1).abs() <= tol).all()),
        "norm_is_one": bool(((norm - 1).abs() <= tol).all()),
    }


def check_proposition2(
    model: nn.Module | None = None,
    input_ids: torch.Tensor | None = None,
    *,
    batch: int = 4,
    seq_len: int = 256,
    num_heads: int = 4,
    head_dim: int = 32,
    lam0: float = 0.1,
    seed: int = 0,
    tol: float = 1e-6,
) -> dict:
    """Proposition 2 of the VLA paper, measured: the spectral norm and radius of ``I − α̂_t k̂_tᵀ``.

    Args:
        model: a module with :class:`VLAAttention` layers (a trained ``AttnKitForCausalLM`` with ``mixer="vla"``,
            say), or None to measure random inputs only.
        input_ids: ``[B, T]`` token ids of a task batch for ``model`` (required with it).
        batch, seq_len, num_heads, head_dim, lam0, seed: the random inputs (:func:`random_gates`).
        tol: how far from 1 a norm or radius may be and still count as 1 (the float64 eigenvalues of these
            matrices are accurate to about 1e-12).

    Returns:
        ``{"random": stats, "model": stats or None}``, each ``stats`` as :func:`transition_stats` returns it
        (plain numbers and bools, JSON-ready). The paper's statement (norm 1) holds where ``norm_is_one`` is true;
        the weaker one (radius 1) where ``radius_is_one`` is.
    """
    if (model is None) != (input_ids is None):
        raise ValueError("input_ids: pass both model and input_ids, or neither")
    lam0 = check_scalar("lam0", lam0, low=0.0)
    tol = check_scalar("tol", tol, low=0.0)
    for name, value in (("batch", batch), ("seq_len", seq_len), ("num_heads", num_heads), ("head_dim", head_dim)):
        check_int(name, value)
    trained = None if model is None else transition_stats(*model_gates(model, input_ids), tol)
    random = transition_stats(*random_gates(batch, seq_len, num_heads, head_dim, lam0, seed), tol)
    return {"random": random, "model": trained}
