"""TAPA's accuracy bar (issue 4): the Triton kernels' output and gradients against the PyTorch backend, T to 64k.

    python benchmarks/tapa_accuracy.py [--seq-lens 1024 8192 32768 65536] [--head-dims 64 128] [--out DIR]

Random normal ``q, k, v`` and cotangent, B=1, H=2 (the phase argument ``2π·d^alpha·(q_P·k_P)/sqrt(dP)`` grows
with the distance ``d``, so long T is where a cheap cosine or power would show), ``theta = 0.5``, ``alpha = 0.1``.
Each cell runs ``tapa_attention`` forward and backward with ``backend="triton"`` and ``backend="torch"`` on the
same inputs in float32 and in bf16 and reports the relative RMS error of ``o``, ``dq``, ``dk``, ``dv``. Bars:
float32 ≤ 1e-3; bf16 ≤ 5e-3 for ``o`` and ≤ 1e-2 for the gradients; no NaN. Writes ``DIR/tapa_accuracy_h200.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import tapa_attention  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

BARS = {torch.float32: (1e-3, 1e-3), torch.bfloat16: (5e-3, 1e-2)}  # (o, gradients)
NAMES = ("o", "dq", "dk", "dv")


def run(xs: list[torch.Tensor], do: torch.Tensor, backend: str) -> list[torch.Tensor]:
    leaves = [x.detach().requires_grad_() for x in xs]
    o = tapa_attention(*leaves, theta=0.5, alpha=0.1, backend=backend)
    return [o.detach(), *torch.autograd.grad(o, leaves, do)]


def cell(T: int, D: int, dtype: torch.dtype, device: torch.device, heads: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(T + D)
    xs = [torch.randn(1, T, heads, D, generator=gen, device=device).to(dtype) for _ in range(4)]
    begin = time.perf_counter()
    got, ref = run(xs[:3], xs[3], "triton"), run(xs[:3], xs[3], "torch")
    errors = {n: rel_rms(a, e) for n, a, e in zip(NAMES, got, ref)}
    nan = any(not torch.isfinite(t).all().item() for t in got)
    bar_o, bar_grads = BARS[dtype]
    ok = not nan and errors["o"] <= bar_o and all(errors[n] <= bar_grads for n in NAMES[1:])
    row = {
        "T": T, "D": D, "H": heads, "dtype": str(dtype).removeprefix("torch."), "errors": errors, "nan": nan,
        "bars": {"o": bar_o, "grads": bar_grads}, "ok": ok, "seconds": time.perf_counter() - begin,
    }  # fmt: skip
    shown = " ".join(f"{n} {e:.1e}" for n, e in errors.items())
    print(f"T={T:6d} D={D:3d} {row['dtype']:8s} {shown} nan={nan} ok={ok}", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 8192, 32768, 65536])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="tapa_accuracy_h200")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    payload = {"environment": environment(device), "rows": rows}
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for D in args.head_dims:
            for T in args.seq_lens:
                rows.append(cell(T, D, dtype, device, args.heads))
                write_json(f"{args.out}/{args.name}.json", payload)
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cells within their bars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
