"""Comparison helpers for the tests."""

from __future__ import annotations

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)``, computed in float64.

    An all-zero ``expected`` (the gradient of a query that sees one key, say) is compared absolutely.
    """
    actual, expected = actual.double(), expected.double()
    denom = expected.pow(2).mean().sqrt().item()
    return (actual - expected).pow(2).mean().sqrt().item() / (denom if denom > 0 else 1.0)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def tol_for(dtype: torch.dtype) -> float:
    """The bars of the foundation issue: 1e-10 in float64, 1e-5 in float32."""
    return 1e-10 if dtype == torch.float64 else 1e-5
