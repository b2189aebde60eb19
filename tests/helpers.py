"""Comparison helpers for the tests."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from attnkit.ops.common.utils import rel_rms

__all__ = [
    "assert_close",
    "count_aten_ops",
    "full_size_ops_outside_kernels",
    "launch_counter",
    "leave_process_group",
    "rel_rms",
    "tol_for",
]


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def tol_for(dtype: torch.dtype) -> float:
    """The bars of the foundation issue: 1e-10 in float64, 1e-5 in float32."""
    return 1e-10 if dtype == torch.float64 else 1e-5


# What the operator count leaves out: views, allocations and zero-fills, the copies Triton's interpreter makes of
# kernel arguments (``set_``, ``copy_``), and ``to`` when it is a leaf (a no-op: a real conversion goes through
# ``_to_copy``).
UNCOUNTED_OPS = frozenset(
    "empty empty_strided empty_like new_empty new_empty_strided zeros zeros_like new_zeros zero_ fill_ resize_ set_ "
    "copy_ to view _unsafe_view reshape _reshape_alias as_strided transpose t permute expand expand_as select slice "
    "narrow unsqueeze squeeze alias detach flatten unflatten contiguous lift_fresh resolve_conj resolve_neg view_as "
    "unbind split movedim".split()
)


# The batches an operator-count test runs (``(B, T, cu_seqlens)``: dense, then packed with empty and one-token
# sequences): the count must be the same across each list.
OPERATOR_COUNT_SHAPES = [
    [(2, 40, None), (1, 100, None), (3, 170, None)],
    [(1, 100, [0, 7, 7, 100]), (1, 170, [0, 1, 60, 60, 170])],
]
OPERATOR_COUNT_IDS = ["dense", "varlen"]


def count_aten_ops(fn: Callable[[], object]) -> collections.Counter[str]:
    """The leaf ATen operators that do work while ``fn`` runs, by name, from ``torch.profiler`` on the CPU: every
    depth, inside custom operators too, less :data:`UNCOUNTED_OPS`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::") or any(c.name.startswith("aten::") for c in event.cpu_children):
            continue
        name = event.name.removeprefix("aten::")
        if name not in UNCOUNTED_OPS:
            counts[name] += 1
    return counts


KERNEL_RANGE = "triton_interpreter_launch"


@contextlib.contextmanager
def _marked_kernel_launches() -> Iterator[None]:
    """Every launch through Triton's interpreter inside a profiler range named :data:`KERNEL_RANGE`."""
    from triton.runtime import interpreter

    real = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        with record_function(KERNEL_RANGE):
            return real(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = call
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = real


def full_size_ops_outside_kernels(fn: Callable[[], object], size: int) -> collections.Counter[str]:
    """The leaf ATen operators that ``fn`` dispatches outside the Triton kernels (under the interpreter, whose
    argument copies are inside the launches) on a tensor of at least ``size`` elements, by name: copies
    (``copy_``, which ``contiguous``, ``to`` and ``transpose(…).contiguous()`` end in) and arithmetic. Views,
    allocations and fills are not counted (:data:`UNCOUNTED_OPS`, less ``copy_``)."""
    free = UNCOUNTED_OPS - {"copy_"}
    with _marked_kernel_launches(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::") or any(c.name.startswith("aten::") for c in event.cpu_children):
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != KERNEL_RANGE:
            parent = parent.cpu_parent
        name = event.name.removeprefix("aten::")
        if parent is None and name not in free and max(map(math.prod, event.input_shapes), default=0) >= size:
            counts[name] += 1
    return counts


def leave_process_group() -> None:
    """Both ranks finish their collectives before the group goes, then the process leaves without the
    interpreter's teardown: c10d's gloo threads aborted it there once on CI (SIGABRT, "terminate called without an
    active exception") after the results were complete; the results are on disk by then."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def recorded_launches(monkeypatch, module, name: str, record) -> list:
    """Replaces the Triton kernel ``module.name`` by a wrapper that appends ``record(grid, kwargs)`` for each launch
    and launches it; returns the list the records go to (only launches that look the kernel up on ``module`` at call
    time are seen)."""
    kernel, records = getattr(module, name), []

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                records.append(record(grid, kwargs))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, name, Recorded())
    return records


def launch_arguments(monkeypatch, module, name: str, argument: str) -> list:
    """:func:`recorded_launches` of the keyword ``argument`` of each launch of ``module.name``."""
    return recorded_launches(monkeypatch, module, name, lambda grid, kwargs: kwargs[argument])


def launch_counter(monkeypatch, module, name: str) -> list:
    """:func:`recorded_launches` of each launch's grid of ``module.name``."""
    return recorded_launches(monkeypatch, module, name, lambda grid, kwargs: grid)
