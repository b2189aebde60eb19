"""Command line: ``python -m attnkit [demo]``."""

from __future__ import annotations

import argparse
import json

import torch


def _demo(args: argparse.Namespace) -> int:
    from .cpu_bench import accuracy_rows, format_accuracy, format_timing, timing_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"attnkit demo: PyTorch backends on {torch.get_num_threads()} CPU threads, float32")
    print(f"\nAccuracy against the definitional loops (float64), T={args.accuracy_t}:")
    acc = accuracy_rows(T=args.accuracy_t)
    print(format_accuracy(acc))
    print(f"\nTiming, B={args.batch} T={args.seq_len} H={args.heads} D={args.head_dim}, median of {args.repeats}:")
    rows = timing_rows(args.batch, args.seq_len, args.heads, args.head_dim, repeats=args.repeats)
    print(format_timing(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": acc, "timing": rows, "args": vars(args)}, f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention beyond RoPE: PaTH, TAPA, VLA.")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser(
        "demo",
        help="accuracy and CPU timing table of every mechanism (the default command)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--batch", type=int, default=2, help="batch size B of the timing runs")
    demo.add_argument("--seq-len", type=int, default=512, help="sequence length T of the timing runs")
    demo.add_argument("--heads", type=int, default=4, help="heads H")
    demo.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    demo.add_argument("--repeats", type=int, default=3, help="timed repetitions (the median is reported)")
    demo.add_argument("--accuracy-t", type=int, default=48, help="sequence length of the accuracy check")
    demo.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    demo.add_argument("--json", default=None, help="also write the results to this JSON file")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *(argv or [])])
    return args.func(args)
