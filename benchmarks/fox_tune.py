"""Tile sweep of the FoX Triton kernels on a GPU: the forward's and both backward kernels' ``(BM, BN, num_warps,
num_stages)``, each timed against SDPA (flash, no gate) in one run, with its error from the default launch.

    python benchmarks/fox_tune.py [--seq-lens 8192] [--head-dims 64] [--out DIR]
    python benchmarks/fox_tune.py --float32 [--seq-lens 4096] [--head-dims 64 128] [--out DIR]

bf16, causal, 32768 tokens a batch, H·D = 1024, gates ``logsigmoid(N(0, 1) + 2)`` as ``benchmarks/ops.py`` makes
them. The forward's rows vary its launch alone; the backward's rows vary one kernel's launch (dK/dV or dQ) with the
other's default, so a winner of each combines. Prints a table per cell (fastest first) and writes
``fox_tune.json``; the chosen launches live in ``fwd_config`` / ``bwd_config``.

``--float32``: float32 inputs instead, forward+backward (default launches) under each ``forward.FLOAT32_PRECISION``
(exact ``ieee`` and 3×TF32), timed against SDPA in float32, with each one's largest error (output and gradients, by
``rel_rms``) from the PyTorch backend in float64 on one sequence of two heads; writes ``fox_float32.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.baselines.fox.triton import forward as fox_forward  # noqa: E402
from attnkit.ops.baselines.fox.triton.backward import bwd_config, fox_bwd_fn  # noqa: E402
from attnkit.ops.baselines.fox.triton.forward import fox_fwd_fn, fwd_config  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

# (BM, BN, num_warps, num_stages). The FoX forward at D = 64 took 1.57-1.69x SDPA's time and 1.2-1.3x FLA's in the
# thirteenth session with the first row (chosen by ptxas spills, never timed): FA-2's 128 x 64 tiles on eight warps.
FWD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 2)]
DKDV = [(32, 128, 8, 2), (32, 128, 8, 1), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)]
DQ = [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def attempt(fn, label: str):
    """``fn()``, or None with the error printed (a launch that does not fit the SM is a row, not the end)."""
    try:
        return fn()
    except Exception as error:  # out of resources, compile errors: recorded on the row
        print(f"  {label}: {type(error).__name__}: {str(error)[:200]}")
        return None


def time_cell(D: int, T: int) -> dict:
    """Every variant of one (D, T) cell, with SDPA's forward and forward+backward as the yardsticks."""
    H, B = 1024 // D, max(1, 32768 // T)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 2).to(torch.bfloat16)
    scale = D**-0.5
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
        sdpa_fwd = bench(sdpa)
        sdpa_fwdbwd = bench(lambda: sdpa().backward(do.transpose(1, 2)))
    cell = dict(D=D, T=T, B=B, H=H, sdpa_fwd=sdpa_fwd, sdpa_fwdbwd=sdpa_fwdbwd, fwd=[], bwd=[])
    o_ref, lse_ref = fox_fwd_fn(q, k, v, g, None, scale)
    for config in FWD:
        fn = functools.partial(fox_fwd_fn, q, k, v, g, None, scale, config=config)
        out = attempt(fn, f"fwd {config}")
        row = dict(config=config, default=config == fwd_config(D), ms=float("nan"))
        if out is not None:
            row.update(err=rel_rms(out[0], o_ref), ms=bench(fn))
            row["ratio"] = row["ms"] / sdpa_fwd
        cell["fwd"].append(row)
        print(f"  D={D} T={T} fwd {config}: {row['ms']:.3f} ms")
    default = bwd_config(D)
    ref = fox_bwd_fn(do, q, k, v, g, o_ref, lse_ref, None, scale)
    fwd_ms = min((r["ms"] for r in cell["fwd"] if r["ms"] == r["ms"]), default=float("nan"))
    variants = [dict(default, dkdv=c) for c in DKDV] + [dict(default, dq=c) for c in DQ if c != default["dq"]]
    for config in variants:
        fn = functools.partial(fox_bwd_fn, do, q, k, v, g, o_ref, lse_ref, None, scale, config=config)
        out = attempt(fn, f"bwd {config}")
        row = dict(config=config, default=config == default, ms=float("nan"))
        if out is not None:
            row.update(err=max(rel_rms(a, b) for a, b in zip(out, ref)), ms=bench(fn))
            row["ratio"] = (row["ms"] + fwd_ms) / sdpa_fwdbwd  # with the fastest forward above
        cell["bwd"].append(row)
        print(f"  D={D} T={T} bwd {config}: {row['ms']:.3f} ms")
    return cell


FLOAT32_PRECISIONS = ("ieee", "tf32x3")
NAMES = ("o", "dq", "dk", "dv", "dg")  # output_and_grads' tensors


def output_and_grads(backend: str, dtype: torch.dtype, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """FoX's output and ``dq, dk, dv, dg`` for ``xs = (q, k, v, g, do)`` in ``dtype`` through ``backend``, on fresh
    leaves: ``.to`` of a tensor already in ``dtype`` is the tensor itself, whose ``.grad`` would sum over calls (the
    twenty-fifth session's first measurement summed the 3xTF32 row's gradients onto the exact row's)."""
    from attnkit.ops.baselines.softmax import softmax_attention

    leaves = [x.detach().to(dtype, copy=True).requires_grad_() for x in xs[:4]]
    out = softmax_attention(*leaves[:3], g=leaves[3], backend=backend)
    out.backward(xs[4].to(dtype))
    return [out.detach(), *(x.grad for x in leaves)]


def float32_cell(D: int, T: int) -> dict:
    """Float32 FoX forward+backward under each of ``FLOAT32_PRECISIONS``, with SDPA (float32) as the yardstick."""
    from attnkit.ops.baselines.softmax import softmax_attention

    H, B = 1024 // D, max(1, 32768 // T)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 2)
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
    cell = dict(D=D, T=T, B=B, H=H, sdpa_fwdbwd=bench(lambda: sdpa().backward(do.transpose(1, 2))), rows=[])
    small = [x[:1, :, :2].detach() for x in (q, k, v, g, do)]  # one sequence, two heads: the float64 reference
    reference = output_and_grads("torch", torch.float64, small)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    default = fox_forward.FLOAT32_PRECISION
    try:
        for prec in FLOAT32_PRECISIONS:
            fox_forward.FLOAT32_PRECISION = prec

            def step() -> bool:
                softmax_attention(*leaves[:3], g=leaves[3], backend="triton").backward(do)
                return True

            row = dict(precision=prec, ms=float("nan"))
            if attempt(step, f"float32 {prec}"):  # compiles; a launch that does not fit is a row
                actual = output_and_grads("triton", torch.float32, small)
                row["errors"] = {n: rel_rms(a.double(), b) for n, a, b in zip(NAMES, actual, reference)}
                row["ms"] = bench(step)
                row["ratio"] = row["ms"] / cell["sdpa_fwdbwd"]
            cell["rows"].append(row)
            print(f"  D={D} T={T} float32 {prec}: {row['ms']:.3f} ms, errors {row.get('errors')}")
    finally:
        fox_forward.FLOAT32_PRECISION = default
    return cell


def table(cells: list[dict]) -> str:
    lines = []
    for cell in cells:
        lines.append(
            f"D={cell['D']} T={cell['T']} (B={cell['B']}, H={cell['H']}): SDPA fwd {cell['sdpa_fwd']:.3f} ms, "
            f"fwd+bwd {cell['sdpa_fwdbwd']:.3f} ms"
        )
        for kind in ("fwd", "bwd"):
            for row in sorted(cell[kind], key=lambda r: (r["ms"] != r["ms"], r["ms"])):
                mark = " (default)" if row["default"] else ""
                ratio = f", fwd+bwd {row['ratio']:.2f}x SDPA" if kind == "bwd" and "ratio" in row else ""
                ratio = f", {row['ratio']:.2f}x SDPA" if kind == "fwd" and "ratio" in row else ratio
                lines.append(
                    f"  {kind} {row['config']}{mark}: {row['ms']:.3f} ms{ratio}, err {row.get('err', float('nan')):.1e}"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--float32", action="store_true", help="float32 inputs: exact against 3xTF32 products")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("fox_tune.py times the kernels on a CUDA GPU")
    cells, env = [], environment(torch.device("cuda"))
    if args.float32:
        for T in args.seq_lens:
            for D in args.head_dims:
                cells.append(float32_cell(D, T))
                write_json(Path(args.out) / "fox_float32.json", dict(environment=env, cells=cells))
        for cell in cells:
            for row in cell["rows"]:
                worst = max(row.get("errors", {}).values(), default=float("nan"))
                print(
                    f"D={cell['D']} T={cell['T']} float32 {row['precision']}: {row['ms']:.3f} ms, "
                    f"{row.get('ratio', float('nan')):.2f}x SDPA (float32), largest error {worst:.1e}"
                )
        return 0
    for T in args.seq_lens:
        for D in args.head_dims:
            cells.append(time_cell(D, T))
            write_json(Path(args.out) / "fox_tune.json", dict(environment=env, cells=cells))
    print(table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
