"""Benchmarks: ``--cpu`` times the PyTorch backends against SDPA + RoPE (``attnkit.cpu_bench``); ``--gpu`` runs
the GPU kernel benchmarks of ``benchmarks/ops.py`` (needs a CUDA device and the Triton kernels).

    python -m attnkit bench --cpu [--batch 4 --seq-len 1024 --heads 4 --head-dim 64] [--out cpu.json]
    python -m attnkit bench --gpu [-- extra arguments for benchmarks/ops.py]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from attnkit.cpu_bench import MECHANISMS, format_timing, timing_rows

from .output import write_json

GPU_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "ops.py"


def bench_cpu(
    batch: int = 4,
    seq_len: int = 1024,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 5,
    mechanisms: Sequence[str] = MECHANISMS,
) -> list[dict[str, float | str]]:
    """Median milliseconds, forward and forward+backward, of each mechanism and its ratio to SDPA + RoPE."""
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        raise ValueError(f"mechanisms: unknown mechanism {unknown[0]!r}; expected some of {MECHANISMS}")
    return timing_rows(batch, seq_len, heads, head_dim, repeats=repeats, names=tuple(mechanisms))


def bench_gpu(extra: Sequence[str] = ()) -> int:
    """Run ``benchmarks/ops.py`` with ``extra`` arguments; 2 (with a message) without CUDA or without the script."""
    if not torch.cuda.is_available():
        print("GPU kernel benchmarks need a CUDA device and the Triton kernels; no CUDA device is available here.")
        return 2
    if not GPU_SCRIPT.exists():
        print(f"GPU kernel benchmarks need the Triton kernels and {GPU_SCRIPT}, which does not exist yet.")
        return 2
    return subprocess.call([sys.executable, str(GPU_SCRIPT), *extra])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu", action="store_true", help="CPU timing table of the PyTorch backends (the default)")
    parser.add_argument("--gpu", action="store_true", help="GPU kernel benchmarks (benchmarks/ops.py; needs CUDA)")
    parser.add_argument("--batch", type=int, default=4, help="batch size B")
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence length T")
    parser.add_argument("--heads", type=int, default=4, help="heads H")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (the median is reported)")
    parser.add_argument(
        "--mechanisms", nargs="+", choices=MECHANISMS, default=list(MECHANISMS), help="mechanisms to time (CPU)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="write the CPU rows as JSON to this path")
    parser.add_argument("gpu_args", nargs="*", default=[], help="extra arguments for benchmarks/ops.py (after --)")


def run(args: argparse.Namespace) -> int:
    status = 0
    if args.cpu or not args.gpu:
        if args.threads:
            torch.set_num_threads(args.threads)
        rows = bench_cpu(args.batch, args.seq_len, args.heads, args.head_dim, args.repeats, args.mechanisms)
        print(
            f"B={args.batch} T={args.seq_len} H={args.heads} D={args.head_dim} float32, median of {args.repeats}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        print(format_timing(rows))
        if args.out:
            write_json(args.out, {"args": vars(args), "torch": torch.__version__, "rows": rows})
    if args.gpu:
        status = bench_gpu(args.gpu_args)
    return status
