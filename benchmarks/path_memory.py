"""What PaTH's forward+backward holds at its peak, without a GPU: every buffer the launchers allocate, by call site,
and the set alive at the peak (``benchmarks/results/path_memory_cpu.json``).

    python benchmarks/path_memory.py [--head-dims 64 128] [--gate] [--batch 8] [--seq-len 4096] [--top 16] [--out F]
        [--setting LABEL]    # one of path_tune.py's LOCAL settings (its module attributes patched meanwhile)
        [--phases]           # also what is allocated at each launch (the JSON has it always, with the buffers)

The launchers run on CPU tensors without ``TRITON_INTERPRET`` (it must be unset), so that they pick the GPU's chunks,
waves and buffers; no kernel runs (its launch is dropped, its arguments not kept), so the numbers are the
allocations alone, as ``torch.cuda.max_memory_allocated`` would see them less the caching allocator's rounding. A
``TorchDispatchMode`` counts each new storage an operator returns (views and in-place results share theirs) from its
creation until it is freed. The peak is counted from the forward's start (the inputs and ``do`` are allocated
before), as ``benchmarks/ops.py`` measures memory on the GPU; its unit is one bf16 ``[B, T, H·D]`` tensor, so that
SDPA's forward+backward (``o``, ``dq``, ``dk``, ``dv``) holds about 4 of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernel_resources import path_inputs, path_step, record_launches  # noqa: E402


class Allocations(TorchDispatchMode):
    """Counts the bytes of every storage an operator creates while active, until it is freed: ``peak``, ``current``
    and ``at_peak`` (``{storage: (bytes, call site, shape, dtype)}`` alive at the peak)."""

    def __init__(self):
        super().__init__()
        self.current = self.peak = 0
        self.live: dict[int, tuple[int, str, tuple, str]] = {}
        self.at_peak: dict[int, tuple[int, str, tuple, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live:  # in place, or an output that aliases an input
                continue
            self.live[key] = (size, call_site(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
            weakref.finalize(storage, self.free, key)
            self.current += size
            if self.current > self.peak:
                self.peak, self.at_peak = self.current, dict(self.live)
        return out

    def free(self, key: int) -> None:
        self.current -= self.live.pop(key)[0]


def call_site() -> str:
    """The innermost two frames in attnkit's PaTH code (``file:line < caller:line``)."""
    frames = [f for f in traceback.extract_stack() if f"{os.sep}attnkit{os.sep}" in f.filename]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-2:]))


def measure(D: int, gate: bool, B: int, T: int) -> dict:
    """The peak of one forward+backward at ``[B, T, 1024 // D, D]`` and the buffers alive at it."""
    inputs = path_inputs(D, gate, B, T)
    counter = Allocations()

    def step():
        with counter:
            path_step(D, gate, inputs)

    unit = B * T * 1024 * 2

    def buffers(live: dict) -> list[dict]:
        alive = sorted(live.values(), key=lambda r: -r[0])
        return [dict(bytes=n, units=n / unit, site=site, shape=shape, dtype=dt) for n, site, shape, dt in alive]

    phases = []  # at each launch: the kernel and what is allocated then (runs of one kernel at one level kept once)

    def on_launch(kernel) -> None:
        name = kernel.fn.__name__
        if not phases or (phases[-1]["kernel"], phases[-1]["bytes"]) != (name, counter.current):
            phases.append(dict(kernel=name, bytes=counter.current, units=counter.current / unit))
            phases[-1]["alive"] = buffers(counter.live)

    record_launches(step, keep=False, on_launch=on_launch)  # the launchers' allocations alone
    return dict(
        D=D, B=B, T=T, H=max(1, 1024 // D), gate=gate, peak_bytes=counter.peak, peak_units=counter.peak / unit,
        leaked_bytes=counter.current, at_peak=buffers(counter.at_peak), phases=phases,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--gate", action="store_true", help="PaTH-FoX")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--top", type=int, default=16, help="buffers shown a head dim")
    parser.add_argument("--out", help="JSON of every head dim")
    parser.add_argument("--phases", action="store_true", help="print what is allocated at each launch")
    parser.add_argument("--setting", help="a path_tune.LOCAL label: the allocations that setting makes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1: the launchers would pick the interpreter's configurations; unset it")
    from benchmarks import path_tune

    settings = dict(path_tune.LOCAL)
    if args.setting is not None and args.setting not in settings:
        parser.error(f"--setting: {args.setting!r} is not one of {list(settings)}")
    rows = []
    for D in args.head_dims:
        with path_tune.patched(settings.get(args.setting, {})):
            row = measure(D, args.gate, args.batch, args.seq_len) | dict(setting=args.setting)
        rows.append(row)
        print(
            f"D={D} B={args.batch} T={args.seq_len} H={row['H']}{' FoX' if args.gate else ''}"
            f"{f' [{args.setting}]' if args.setting else ''}: peak "
            f"{row['peak_bytes'] / 2**20:.0f} MiB = {row['peak_units']:.2f} bf16 [B, T, H·D] tensors "
            f"({row['leaked_bytes']} bytes left after the step)"
        )
        for b in row["at_peak"][: args.top]:
            print(f"  {b['bytes'] / 2**20:8.1f} MiB  {b['units']:5.2f}  {b['site']:<44} {b['shape']} {b['dtype']}")
        if args.phases:
            print("  allocated at each launch (units; a run of one kernel at one level once):")
            for p in row["phases"]:
                print(f"    {p['units']:6.2f}  {p['kernel']}")
    if args.out:
        import triton

        from benchmarks.ops import environment

        env = environment(torch.device("cpu")) | dict(triton=triton.__version__)
        Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
