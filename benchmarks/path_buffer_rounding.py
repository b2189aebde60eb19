"""The rounding of the PaTH backward's stored working copies (``prepare.BUFFERS_16BIT``: ``K̃``, ``x``, ``k̂``), alone:
float32 inputs through Triton's interpreter, whose products are exact, with the copies stored in float32, float16
and bfloat16, each output's and gradient's relative RMS error from the PyTorch backend in float64. ``beta`` in
(1.9, 2) (near-reflections), gates, one sequence, two heads, superblocks of ``--span`` chunks.

    TRITON_INTERPRET=1 python benchmarks/path_buffer_rounding.py [--head-dim 16] [--seq-len 1300] [--span 3] [--out F]

On a GPU the 16-bit inputs' logits round ``K̃``, ``x`` and ``k̂`` to their dtype anyway; what this measures is the
rest, the gradients' products and carries that read the stored copies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.ops.path import path_attention  # noqa: E402
from attnkit.ops.path.triton import prepare  # noqa: E402
from tests.helpers import rel_rms  # noqa: E402
from tests.ops.test_path import make_inputs  # noqa: E402

NAMES = ("o", "dq", "dk", "dv", "dw", "dbeta", "dg")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1300)
    parser.add_argument("--span", type=int, default=3, help="chunks a superblock")
    parser.add_argument("--out", help="JSON of the rows")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        parser.error("set TRITON_INTERPRET=1: the study needs the interpreter's exact products")
    prepare.superblock_chunks = lambda key_dim, chunk: args.span
    torch.manual_seed(0)
    K, T = args.head_dim, args.seq_len
    inputs = make_inputs(1, T, 2, 2, K, K, gate=True, dtype=torch.float64, beta_low=1.9)
    do = torch.randn(1, T, 2, K, dtype=torch.float64)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = path_attention(*leaves, backend="torch")
    o.backward(do)
    expected = [o] + [x.grad for x in leaves]
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        prepare.buffer_dtype = lambda *_, dtype=dtype: dtype
        start = time.time()
        leaves = [x.float().detach().requires_grad_() for x in inputs]
        o = path_attention(*leaves, backend="triton")
        o.backward(do.float())
        actual = [o] + [x.grad for x in leaves]
        errs = {n: rel_rms(a.double(), e) for n, a, e in zip(NAMES, actual, expected)}
        rows.append(dict(copies=str(dtype).removeprefix("torch."), errs=errs, seconds=time.time() - start))
        shown = " ".join(f"{n} {e:.1e}" for n, e in errs.items())
        print(f"K={K} T={T} span={args.span} copies {rows[-1]['copies']}: {shown} (largest {max(errs.values()):.1e})")
    if args.out:
        from benchmarks.ops import environment

        env = environment(torch.device("cpu"))
        payload = dict(environment=env, head_dim=K, seq_len=T, span=args.span, rows=rows)
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
