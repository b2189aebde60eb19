"""An address check for Triton's interpreter: inside :func:`interpreter_memcheck`, every address a kernel loads from,
stores to or updates atomically without a mask (or with its mask on) must lie inside the storage of one of that
launch's tensor arguments.

The NaN-filled ``torch.empty`` of ``conftest.py`` catches a read of memory a kernel never wrote; this catches a read or
a write outside every buffer, which on a GPU is an illegal memory access, or worse, another tensor's memory. It hooks
the interpreter's private launch and load/store paths (Triton >= 3.9); :func:`available` says whether this Triton
has them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np


def _interpreter():
    import triton.runtime.interpreter as interpreter

    return interpreter


def available() -> bool:
    """Whether this Triton's interpreter has the hooks the check patches."""
    try:
        interpreter = _interpreter()
    except ImportError:
        return False
    builder = type(getattr(interpreter, "interpreter_builder", None))
    return (
        hasattr(getattr(interpreter, "GridExecutor", None), "_init_args_hst")
        and hasattr(interpreter, "_get_np_dtype")
        and all(hasattr(builder, name) for name in _OPERANDS)
    )


# The interpreter builder's loads, stores and atomics: where their pointers and their mask (None: none) come among
# their arguments.
_OPERANDS = {
    "create_load": (0, None), "create_store": (0, None), "create_masked_load": (0, 1), "create_masked_store": (0, 2),
    "create_atomic_rmw": (1, 3), "create_atomic_cas": (0, None),
}  # fmt: skip


class OutOfBounds(AssertionError):
    """A kernel addressed memory outside every tensor argument of its launch."""


@contextlib.contextmanager
def interpreter_memcheck() -> Iterator[list[str]]:
    """Checks every launch inside the block; raises :class:`OutOfBounds` at the first address outside its launch's
    arguments, naming the kernel, the program and the operation. Yields the names of the kernels it checked."""
    interpreter = _interpreter()
    executor, builder = interpreter.GridExecutor, type(interpreter.interpreter_builder)
    ranges: list[tuple[int, int]] = []
    launched: list[str] = []
    init_args = executor._init_args_hst
    originals = {name: getattr(builder, name) for name in _OPERANDS}

    def init_args_checked(self, args_dev, kwargs):
        args, kwargs_host = init_args(self, args_dev, kwargs)
        ranges.clear()
        for arg in [*args, *kwargs_host.values()]:
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        launched.append(getattr(self.fn, "__name__", "?"))
        return args, kwargs_host

    def check(name: str, ptrs, mask) -> None:
        addresses = np.asarray(ptrs.data).astype(np.uint64)
        if mask is not None:
            addresses = addresses[np.asarray(mask.data).astype(bool)]
        if addresses.size == 0:
            return
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addresses.shape, dtype=bool)
        for lo, hi in ranges:
            inside |= (addresses >= lo) & (addresses + size <= hi)
        if not inside.all():
            program = interpreter.interpreter_builder.grid_idx
            raise OutOfBounds(
                f"{launched[-1]}: {name} of {int((~inside).sum())} of {addresses.size} elements outside every "
                f"argument's storage, program {program}"
            )

    def hooked(name: str, original, ptrs_at: int, mask_at: int | None):
        def method(self, *args):
            check(name, args[ptrs_at], None if mask_at is None else args[mask_at])
            return original(self, *args)

        return method

    executor._init_args_hst = init_args_checked
    for name, original in originals.items():
        setattr(builder, name, hooked(name, original, *_OPERANDS[name]))
    try:
        yield launched
    finally:
        executor._init_args_hst = init_args
        for name, original in originals.items():
            setattr(builder, name, original)
