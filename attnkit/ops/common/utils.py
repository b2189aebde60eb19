"""Small helpers shared by the PyTorch implementations."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable[..., object])


def compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (the reference precision of the tests), float32 otherwise."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def autocast_off(fn: Fn) -> Fn:
    """``fn`` with autocast off on the device of its first argument, a tensor: its operations run in the dtypes of
    their inputs, which the caller chose (:func:`compute_dtype`), whatever autocast is on around it.

    For code that builds matrices and then factors, solves with or inverts them (VLA's gates): ``torch.linalg`` has
    no 16-bit kernels for that, and a Gram matrix built from 16-bit products need not be positive definite. Outside
    autocast nothing changes.
    """

    @functools.wraps(fn)
    def wrapper(x: torch.Tensor, *args: object, **kwargs: object) -> object:
        with torch.autocast(x.device.type, enabled=False):
            return fn(x, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)``, computed in float64: the accuracy measure of the tests and the
    benchmarks. An all-zero ``expected`` (the gradient of a query that sees one key, say) is compared absolutely.
    """
    actual, expected = actual.double(), expected.double()
    denom = expected.pow(2).mean().sqrt().item()
    return (actual - expected).pow(2).mean().sqrt().item() / (denom if denom > 0 else 1.0)


def segment_bounds(cu_seqlens: torch.Tensor | None, seq_len: int) -> list[tuple[int, int]]:
    """``[(bos, eos), ...]`` of the packed sequences; one segment covering ``[0, T)`` without ``cu_seqlens``."""
    if cu_seqlens is None:
        return [(0, seq_len)]
    values = cu_seqlens.tolist()
    return list(zip(values[:-1], values[1:]))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, T, H, D] -> [B, T, H * groups, D]``: query head ``h`` reads key/value head ``h // groups``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def run_segments(
    fn: Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
    tensors: tuple[torch.Tensor, ...],
    cu_seqlens: torch.Tensor,
    initial_state: tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Apply a dense recurrent op to each packed sequence of ``[1, T, ...]`` tensors independently.

    ``fn(*segment_tensors, segment_state) -> (o [1, L, ...], state tuple with leading dim 1)``, where
    ``segment_state`` is ``None`` or the ``i``-th row of every tensor of ``initial_state`` (a tuple).
    Returns ``o`` concatenated along T and the states concatenated along N.
    """
    outputs, states = [], []
    for i, (bos, eos) in enumerate(segment_bounds(cu_seqlens, tensors[0].shape[1])):
        state = None if initial_state is None else tuple(s[i : i + 1] for s in initial_state)
        o, state = fn(*(x[:, bos:eos] for x in tensors), state)
        outputs.append(o)
        states.append(state)
    return torch.cat(outputs, 1), tuple(torch.cat(parts, 0) for parts in zip(*states, strict=True))
