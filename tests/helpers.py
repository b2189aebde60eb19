"""Comparison helpers for the tests."""

from __future__ import annotations

import torch

from attnkit.ops.common.utils import rel_rms

__all__ = ["assert_close", "rel_rms", "tol_for"]


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def tol_for(dtype: torch.dtype) -> float:
    """The bars of the foundation issue: 1e-10 in float64, 1e-5 in float32."""
    return 1e-10 if dtype == torch.float64 else 1e-5
