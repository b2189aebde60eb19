"""PaTH's fused directions (``attnkit/ops/path/triton/direction.py``) with the backward's tiles set by hand: positions
a program and warps, each timed in one run beside the forward.

    python benchmarks/direction_tune.py [--shape 4:4096:16:64] [--settings default 8,1 16,2 32,8] [--out DIR]

The shape is ``B:T:H:D`` of ``u [B, T, H·D]`` (bf16 on CUDA, float32 on CPU), a convolution of 3 taps, a float32
``dw``, as a PaTH layer's training step gives them. A setting is ``positions,warps`` for the backward
(``direction.backward_tiles``; "default": the module's own). Each row has the largest relative difference of ``du``
and ``dweight`` from the first setting's. ``triton.testing.do_bench`` medians on CUDA; on CPU (the interpreter, tests)
every setting runs once, untimed. Writes ``DIR/direction_tune.json``. The thirty-sixth session's H100 run
(``benchmarks/results/direction_tune_session36_h100.json``, a script of the same settings) chose 8 positions on one
warp at D = 64.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.path.triton import direction  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

SETTINGS = ("default", "8,1", "8,2", "16,1", "16,2", "16,4", "32,4", "32,8", "64,8")


def tiles(setting: str):
    """``setting`` as a replacement of ``direction.backward_tiles`` (``None``: the module's own)."""
    if setting == "default":
        return None
    positions, warps = (int(part) for part in setting.split(","))
    return lambda head_dim: (positions, warps)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4:4096:16:64")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    B, T, H, D = (int(part) for part in args.shape.split(":"))
    device = torch.device(args.device)
    gen = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    u = torch.randn(B, T, H * D, device=device, generator=gen).to(dtype)
    weight = torch.randn(H * D, 3, device=device, generator=gen) * 0.5
    dw = torch.randn(B, T, H, D, device=device, generator=gen)

    def backward():
        return direction.path_direction_bwd_fn(u, weight, None, dw, H)

    def time(fn) -> float | None:
        return do_bench(fn, warmup=30, rep=200) * 1e3 if device.type == "cuda" else None

    forward_us = time(lambda: direction.path_direction_fwd_fn(u, weight, None, H))
    rows, first = [], None
    for setting in args.settings:
        replacement = tiles(setting)
        with mock.patch.object(direction, "backward_tiles", replacement or direction.backward_tiles):
            positions, warps = direction.backward_tiles(D)
            out = backward()
            first = first or out
            diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(out, first))
            rows.append(dict(setting=setting, positions=positions, warps=warps, bwd_us=time(backward), rel_diff=diff))
        print(rows[-1], flush=True)
    payload = dict(shape=dict(B=B, T=T, H=H, D=D), forward_us=forward_us, rows=rows, environment=environment(device))
    if args.out:
        write_json(str(Path(args.out) / "direction_tune.json"), payload)
    return payload


if __name__ == "__main__":
    main()
