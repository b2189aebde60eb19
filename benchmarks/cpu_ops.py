"""CPU timing of the PyTorch backends against SDPA + RoPE (the foundation issue's speed bars).

    python benchmarks/cpu_ops.py [--out benchmarks/results/cpu_ops.json] [--check]

Prints a table of median milliseconds and ratios to SDPA + RoPE, forward and forward+backward, float32.
"""

from __future__ import annotations

import argparse
import json
import os

from attnkit.cpu_bench import environment, format_timing, timing_rows

# forward+backward, multiples of SDPA + RoPE at B=4, T=1024, H=4, D=64, float32
BARS = {"path": 8.0, "path_fox": 8.0, "tapa": 4.0, "vla": 8.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows and the environment to this JSON file")
    parser.add_argument("--check", action="store_true", help="exit 1 when a bar is missed")
    args = parser.parse_args()

    env = environment()
    rows = timing_rows(args.batch, args.seq_len, args.heads, args.head_dim, repeats=args.repeats)
    print(f"B={args.batch} T={args.seq_len} H={args.heads} D={args.head_dim} float32, "
          f"median of {args.repeats}; {env['cpu']}, {env['threads']} threads, torch {env['torch']}")
    print(format_timing(rows, BARS))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"environment": env, "shape": vars(args), "bars": BARS, "rows": rows}, f, indent=2)
    missed = [r["name"] for r in rows if r["name"] in BARS and r["fwd_bwd_ratio"] > BARS[r["name"]]]
    if missed:
        print("missed bars:", ", ".join(missed))
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
