"""The gates' segment scan (``attnkit/ops/common/triton/scan.py``) under several tilings, timed in one run: the
PaTH-FoX and FoX ops run it once in their forward and twice in their backward, on ``[B, T, HQ]``.

    python benchmarks/scan_tune.py [--shapes 4:4096:16 1:32768:16] [--out DIR]

A shape is ``B:T:HQ`` (``--packed`` adds the same tokens as 8 packed sequences of random lengths). A setting is
``heads,tile,warps`` (``scan.MAX_HEADS``, ``scan.TILE_ELEMENTS``, ``scan.NUM_WARPS``); "16,1024,4" is the first
version's fixed ``[64, 16]`` tile. Each row is checked against ``torch.cumsum`` in float64. ``triton.testing.do_bench``
medians on CUDA; on CPU (the interpreter, tests) every setting runs once, untimed. Writes ``DIR/scan_tune.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.common.triton import scan  # noqa: E402
from benchmarks.kernel_profile import applied  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

SETTINGS = ("16,1024,4", "default", "16,8192,4", "4,8192,4", "4,8192,8", "4,16384,8", "2,8192,4", "1,8192,4")


def assignments(setting: str) -> list[str]:
    """``setting`` as :func:`benchmarks.kernel_profile.applied`'s ``MODULE.NAME=VALUE`` list ("default": none, the
    module's own tiling)."""
    if setting == "default":
        return []
    names = ("MAX_HEADS", "TILE_ELEMENTS", "NUM_WARPS")
    return [f"{scan.__name__}.{name}={int(part)}" for name, part in zip(names, setting.split(","), strict=True)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4:4096:16", "8:4096:16", "1:32768:16"])
    parser.add_argument("--packed", action="store_true", help="also each shape's tokens as 8 packed sequences")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        B, T, HQ = (int(part) for part in shape.split(":"))
        cases = [(B, T, None)]
        if args.packed:
            cut = torch.randperm(B * T - 1, generator=torch.Generator().manual_seed(0))[:7].add(1).sort().values
            cases.append((1, B * T, torch.tensor([0, *cut.tolist(), B * T], device=args.device)))
        for b, t, cu in cases:
            x = torch.randn(b, t, HQ, device=args.device)
            for reverse in (False, True):
                want = reference_sums(x, cu, reverse)

                def call(x=x, cu=cu, reverse=reverse):
                    return scan.segment_cumsum(x, cu, 1.0, reverse, torch.float32)

                for setting in args.settings:
                    with applied(assignments(setting)):
                        err = ((call().double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()
                        us = None if args.device == "cpu" else 1e3 * do_bench(call)
                        config = scan.launch_config(t, HQ)
                    rows.append(dict(shape=f"{b}:{t}:{HQ}", packed=cu is not None, reverse=reverse, setting=setting,
                                     **config, us=us, error=err))  # fmt: skip
    head = ("shape", "packed", "rev", "setting", "BH", "BT", "warps", "us", "error")
    print(" ".join(f"{name:>{w}}" for name, w in zip(head, (12, 6, 4, 10, 3, 5, 5, 8, 8))))
    for r in rows:
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        print(f"{r['shape']:>12} {r['packed']!s:>6} {r['reverse']!s:>4} {r['setting']:>10} {r['BH']:>3} {r['BT']:>5} "
              f"{r['num_warps']:>5} {us:>8} {r['error']:>8.1e}")  # fmt: skip
    result = dict(environment=environment(torch.device(args.device)), settings=vars(args), rows=rows)
    if args.out:
        write_json(Path(args.out) / "scan_tune.json", result)
    return result


def reference_sums(x: torch.Tensor, cu: torch.Tensor | None, reverse: bool) -> torch.Tensor:
    """float64 sums of each sequence (prefix, or suffix with ``reverse``)."""
    x = x.double()
    bounds = [(0, x.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    y = torch.zeros_like(x)
    for bos, eos in bounds:
        part = x[:, bos:eos]
        y[:, bos:eos] = part.flip(1).cumsum(1).flip(1) if reverse else part.cumsum(1)
    return y


if __name__ == "__main__":
    main()
