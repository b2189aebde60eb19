"""PaTH's accuracy bar (issue 3): the Triton kernels' output and gradients against the PyTorch backend, T to 32k.

    python benchmarks/path_accuracy.py [--seq-lens 4096 32768] [--head-dims 64 128] [--dtypes float32 bfloat16]
        [--gates fox none] [--float64-max-t 4096] [--out DIR]

Random normal ``q, k, v`` and cotangent, unit ``w``, ``beta`` uniform in (1.5, 2) (near-reflections, the hard case
for the cumulative products), FoX gates ``logsigmoid(N(2, 1))`` (``--gates none``: PaTH, whose kernels skip the
gates' sums), B = 1, H = 2. Each cell runs ``path_attention`` forward and backward with ``backend="triton"`` and
``backend="torch"`` on the same (rounded) inputs and reports the relative RMS error of ``o`` and of every gradient.
Bars: float32 ≤ 1e-3; bf16 ≤ 5e-3 for ``o`` and ≤ 1e-2 for the gradients; no NaN. For float32 cells up to
``--float64-max-t`` it also gives both backends' output error against the PyTorch backend in float64, which says how
much of their disagreement is the float32 reference's own. Writes ``DIR/path_accuracy_h200.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import path_attention  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

BARS = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (5e-3, 1e-2)}  # (o, gradients)
NAMES = ("o", "dq", "dk", "dv", "dw", "dbeta", "dg")


def run(xs: list[torch.Tensor | None], do: torch.Tensor, backend: str) -> list[torch.Tensor]:
    leaves = [None if x is None else x.detach().requires_grad_() for x in xs]
    o = path_attention(*leaves, backend=backend)
    return [o.detach(), *torch.autograd.grad(o, [x for x in leaves if x is not None], do)]


def inputs(T: int, D: int, heads: int, device: torch.device) -> list[torch.Tensor]:
    """``q, k, v, w, beta, g`` and the cotangent, float32."""
    gen = torch.Generator(device=device).manual_seed(T + D)
    q, k, v, do = (torch.randn(1, T, heads, D, generator=gen, device=device) for _ in range(4))
    w = F.normalize(torch.randn(1, T, heads, D, generator=gen, device=device), dim=-1)
    beta = 1.5 + 0.5 * torch.rand(1, T, heads, generator=gen, device=device)
    g = F.logsigmoid(torch.randn(1, T, heads, generator=gen, device=device) + 2)
    return [q, k, v, w, beta, g, do]


def cell(
    T: int, D: int, dtype: torch.dtype, device: torch.device, heads: int, float64_max_t: int, gate: bool = True
) -> dict:
    *xs, do = inputs(T, D, heads, device)
    xs[:3] = [x.to(dtype) for x in xs[:3]]
    if not gate:
        xs[5] = None
    begin = time.perf_counter()
    got = run(xs, do.to(dtype), "triton")
    ref = run([None if x is None else x.float() for x in xs], do, "torch")  # the same rounded inputs, in float32
    errors = {n: rel_rms(a.float(), e) for n, a, e in zip(NAMES, got, ref)}
    nan = any(not torch.isfinite(t).all().item() for t in got)
    bar_o, bar_grads = BARS[dtype]
    ok = not nan and errors["o"] <= bar_o and all(e <= bar_grads for n, e in errors.items() if n != "o")
    row = {
        "T": T, "D": D, "H": heads, "dtype": str(dtype).removeprefix("torch."), "gates": gate, "errors": errors,
        "nan": nan, "bars": {"o": bar_o, "grads": bar_grads}, "ok": ok,
    }  # fmt: skip
    if dtype == torch.float32 and T <= float64_max_t:
        with torch.no_grad():
            exact = path_attention(*(None if x is None else x.double() for x in xs), backend="torch")
        row["o_vs_float64"] = {"triton": rel_rms(got[0].double(), exact), "torch": rel_rms(ref[0].double(), exact)}
    row["seconds"] = time.perf_counter() - begin
    shown = " ".join(f"{n} {e:.1e}" for n, e in errors.items())
    extra = (
        ""
        if "o_vs_float64" not in row
        else " vs float64: " + " ".join(f"{n} {e:.1e}" for n, e in row["o_vs_float64"].items())
    )
    print(
        f"T={T:6d} D={D:3d} {row['dtype']:8s} {'fox' if gate else 'path'} {shown} nan={nan} ok={ok}{extra}", flush=True
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--gates", nargs="+", choices=["fox", "none"], default=["fox"], help="PaTH-FoX and/or PaTH")
    parser.add_argument("--float64-max-t", type=int, default=4096, help="float64 reference for float32 cells to this T")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="path_accuracy_h200")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    payload = {"environment": environment(device), "rows": rows}
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for D in args.head_dims:
            for T in args.seq_lens:
                for gates in args.gates:
                    rows.append(cell(T, D, dtype, device, args.heads, args.float64_max_t, gates == "fox"))
                    write_json(f"{args.out}/{args.name}.json", payload)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cells within their bars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
