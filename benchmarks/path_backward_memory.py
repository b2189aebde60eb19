"""Peak memory of the PyTorch part of PaTH's Triton-backend backward, on a CPU: the chunk-local terms, their
autograd graph, the superblock-local terms and the diagonal blocks, with the between-chunk and between-superblock
kernels replaced by zeros of their outputs' shapes (the interpreter would take hours at these sizes). It checks the
working-set estimate of ``attnkit.ops.path.parallel.heads_per_slice`` and what slicing the heads saves.

    python benchmarks/path_backward_memory.py [--seq-len 8192] [--heads 16] [--head-dim 64] [--budget BYTES]
                                              [--count-ops]

Prints the peak resident memory above the start of the backward (Linux's ``VmHWM``, reset just before it through
``/proc/self/clear_refs``, so that what the imports and the inputs' setup peaked at does not count; ``--budget``
defaults to the library's) and the wall time. glibc's allocator is told to return every block of
64 KB or more to the system when it is freed (``M_MMAP_THRESHOLD``); by default it keeps freed blocks of up to
32 MB for reuse, and the resident peak then also counts what earlier slices freed.

``--count-ops`` also counts the ATen operators the backward dispatches (views included: on a GPU each costs host
time, and below T = 32k the step is bound by it), in total and a slice of heads, with the most frequent ten.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.ops.path import parallel  # noqa: E402
from attnkit.ops.path.triton import backward  # noqa: E402


def return_freed_blocks() -> None:
    """``mallopt(M_MMAP_THRESHOLD, 64 KB)`` where the C library is glibc (elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    except (OSError, AttributeError):
        pass


def resident_kib(key: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset) of this process, in KiB."""
    with open("/proc/self/status") as status:
        return int(re.search(rf"{key}:\s+(\d+) kB", status.read())[1])


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident size (where the kernel refuses, the peak keeps what came
    before, and a small run may then show less than it used)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as error:
        print(f"could not reset the resident peak ({error}); it includes the setup's")


def zeros_for_kernels(x, kt, v, w, m, mw, gcum, do, lse, delta, cu_seqlens, scale, chunk, longest):
    """The between-chunk kernels' outputs (``dA`` form), all zero."""
    B, T, HQ, K = x.shape
    H = kt.shape[2]
    z = torch.zeros
    return z(B, T, H, K), z(B, T, H, v.shape[-1]), z(B, T, HQ, K), z(0), z(0), z(m.shape[0], H, K, K), z(B, T, HQ)


def zeros_for_super_kernels(xh, kh, v, sig, gcum, do, lse, delta, cu_seqlens, scale, chunk, span, longest):
    """The between-superblock kernels' outputs, all zero."""
    z = torch.zeros
    return z(xh.shape), z(kh.shape), z(v.shape), z(sig.shape), z(lse.shape)


class CountOps(TorchDispatchMode):
    """Counts the ATen operators dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--budget", type=int, default=None, help="BACKWARD_BUDGET_BYTES (default: the library's)")
    parser.add_argument("--count-ops", action="store_true", help="count the ATen operators the backward dispatches")
    args = parser.parse_args(argv)
    return_freed_blocks()
    T, H, K, C = args.seq_len, args.heads, args.head_dim, args.chunk
    if args.budget is not None:
        parallel.BACKWARD_BUDGET_BYTES = args.budget
    parallel.path_bwd_between_op = zeros_for_kernels
    parallel.path_bwd_super_op = zeros_for_super_kernels
    backward.backward_config = lambda key_dim: (C, 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    w = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    beta = 2 * torch.sigmoid(torch.randn(1, T, H, generator=gen))
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3)
    o, lse, do = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, generator=gen), torch.randn_like(q)
    ctx = SimpleNamespace(saved_tensors=(q, k, v, w, beta, g, None, o, lse), scale=K**-0.5)
    reset_peak()
    start = resident_kib("VmRSS")
    began = time.perf_counter()
    counter = CountOps() if args.count_ops else contextlib.nullcontext()
    with counter:
        parallel._fwd_backward(ctx, do, None)
    result = dict(
        heads_per_slice=parallel.heads_per_slice(1, T, H, H, K, K, C),
        peak_mib=(resident_kib("VmHWM") - start) / 1024,
        input_mib=T * H * K * 4 / 2**20,
        seconds=time.perf_counter() - began,
    )
    print(
        f"T={T} H={H} K={K} C={C}: {result['heads_per_slice']} heads a slice, peak {result['peak_mib']:.0f} MiB above "
        f"the start ({result['peak_mib'] / result['input_mib']:.1f}x one float32 input), {result['seconds']:.1f} s"
    )
    if args.count_ops:
        slices = -(-H // result["heads_per_slice"])
        result["aten_ops"] = sum(counter.counts.values())
        per_slice = result["aten_ops"] / slices
        print(f"{result['aten_ops']} ATen operators, {per_slice:.0f} a slice of heads ({slices} slices)")
        for name, n in counter.counts.most_common(10):
            print(f"  {n:6d} {name}")
    return result


if __name__ == "__main__":
    main()
