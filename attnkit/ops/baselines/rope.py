"""Rotary position embedding (RoPE) with position interpolation, NTK-aware and YaRN scaling.

The formulas are written out here so that attnkit does not depend on transformers; the tests hold them to
transformers' ``ROPE_INIT_FUNCTIONS``. Rotation uses the half-split convention of Llama / transformers
(``rotate_half``): channel ``i`` pairs with channel ``i + D/2``.

Scaling dicts follow transformers' ``rope_scaling`` / ``rope_parameters`` keys (``"rope_type"``, or the
legacy ``"type"``):

- ``"default"``: ``inv_freq_i = base^(-2i/dim)``.
- ``"linear"`` (position interpolation): positions divided by ``factor``, i.e. ``inv_freq / factor``.
- ``"ntk"`` (static NTK-aware): ``base' = base · factor^(dim/(dim-2))``.
- ``"dynamic"`` (transformers' dynamic NTK): ``base' = base · (factor·L/M − (factor−1))^(dim/(dim−2))`` with
  ``M = original_max_position_embeddings`` (or ``max_position_embeddings``) from the dict and
  ``L = max(seq_len, M)``; ``seq_len`` defaults to ``M``, where it leaves ``base`` unchanged, as
  transformers does at initialisation. It equals ``"ntk"`` at ``L = M·(2·factor − 1)/factor``.
- ``"yarn"``: per-frequency linear ramp between interpolation (``inv_freq / factor``) and extrapolation
  (``inv_freq``) over the dimensions whose wavelength makes ``beta_slow`` … ``beta_fast`` rotations in
  ``original_max_position_embeddings``; cos and sin are multiplied by ``attention_factor`` (default
  ``0.1·ln(factor) + 1``, or the DeepSeek ``mscale`` / ``mscale_all_dim`` ratio).

A ``rope_theta`` entry in the dict, when present, is the base (transformers 5 keeps it there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from attnkit.ops.common.validation import check_scalar

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, factor: float, scaling: Mapping) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("scaling: 'yarn' needs original_max_position_embeddings")
    original = check_scalar("scaling['original_max_position_embeddings']", original, low=0.0)
    beta_fast = check_scalar("scaling['beta_fast']", scaling.get("beta_fast") or 32.0, low=0.0)
    beta_slow = check_scalar("scaling['beta_slow']", scaling.get("beta_slow") or 1.0, low=0.0)

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    attention_factor = check_scalar("scaling['attention_factor']", attention_factor, low=0.0)

    def correction_dim(rotations: float) -> float:
        # The dimension index whose wavelength fits `rotations` full turns into the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval; transformers nudges it the same way

    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp = 0 for high-frequency dimensions (kept, extrapolated), 1 for low ones (interpolated).
    inv_freq = inv_freq * (1 - ramp) + inv_freq / factor * ramp
    return inv_freq.float(), float(attention_factor)


def rope_inv_freq(
    dim: int, base: float = 10000.0, scaling: Mapping | None = None, *, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the rotary embedding and the factor that multiplies cos and sin.

    Args:
        dim: rotary dimension (even).
        base: the RoPE base (``rope_theta``).
        scaling: ``None`` or a transformers-style dict, see the module docstring.
        seq_len: current sequence length, used by ``"dynamic"`` only.

    Returns:
        ``(inv_freq [dim // 2] float32, attention_factor)``; computed in float64 and rounded once.
    """
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim: expected a positive even integer, got {dim!r}")
    scaling = {} if scaling is None else scaling
    if not isinstance(scaling, Mapping):
        raise ValueError(f"scaling: expected None or a dict, got {type(scaling).__name__}")
    base = check_scalar("base", scaling.get("rope_theta", base), low=1.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling: rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "default":
        return (base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(), 1.0

    if "factor" not in scaling:
        raise ValueError(f"scaling: {rope_type!r} needs a factor")
    factor = check_scalar("scaling['factor']", scaling["factor"], low=0.0)
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, factor, scaling)
    if rope_type == "ntk":
        base = base * factor ** (dim / (dim - 2))
    elif rope_type == "dynamic":
        trained = scaling.get("original_max_position_embeddings", scaling.get("max_position_embeddings"))
        if trained is None:
            raise ValueError("scaling: 'dynamic' needs original_max_position_embeddings (the trained length)")
        trained = check_scalar("scaling['original_max_position_embeddings']", trained, low=0.0)
        length = trained if seq_len is None else max(check_scalar("seq_len", seq_len, low=0.0), trained)
        base = base * (factor * length / trained - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rope_type == "linear":
        inv_freq = inv_freq / factor
    return inv_freq.float(), 1.0


def rope_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[*positions.shape, 2 * len(inv_freq)]`` in ``dtype``, half-split layout.

    The angles ``position · inv_freq`` are formed in float32, as transformers and FlashAttention do.
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` by ``cos, sin`` of shape ``[T, D]`` or ``[B, T, D]`` (one angle per
    position, shared by the heads). Returns a tensor like ``x``."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
