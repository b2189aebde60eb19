"""VLA's accuracy bar (issue 5): the Triton backend's output and gradients against the float64 PyTorch backend.

    python benchmarks/vla_accuracy.py [--seq-lens 1024 4096 16384 65536] [--lam0s 0.01 0.1 1 10] [--out DIR]

Inputs as the VLA layer passes them (``elu + 1`` features, ``u`` unit directions over ``sqrt(K)``), B=1, H=4,
K=V=64. Each cell rounds the inputs to the kernel's dtype (float32 or bf16), runs ``vla_attention`` forward and
backward under one fixed random cotangent with ``backend="triton"``, and again with ``backend="torch"`` on the
same rounded values in float64 (the reference the CPU tests hold to the token-by-token loop). Reported: the
relative RMS error of ``o``, ``dq``, ``dk``, ``dv``, ``du``; ``‖S_T‖_F`` of the final state; whether anything
is NaN. The T sweep runs at ``lam0 = 0.1``, the ``lam0`` sweep at the second length. Bars (issue 5): ≤ 1e-3 for
float32 inputs, ≤ 1e-2 for bf16, no NaN for ``lam0`` in [0.01, 10]. Writes ``DIR/vla_accuracy_h200.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import vla_attention  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

BARS = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
NAMES = ("o", "dq", "dk", "dv", "du")


def inputs(T: int, H: int, K: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = F.elu(randn(1, T, H, K)) + 1, F.elu(randn(1, T, H, K)) + 1, randn(1, T, H, K)
    u = F.normalize(randn(1, T, H, K), dim=-1) / math.sqrt(K)
    return [q, k, v, u]


def run(xs: list[torch.Tensor], do: torch.Tensor, lam0: float, backend: str) -> tuple[list[torch.Tensor], float]:
    """Output and the gradients of q, k, v, u under cotangent ``do``; and ``‖S_T‖_F`` (largest over heads)."""
    leaves = [x.detach().requires_grad_() for x in xs]
    o, (S, _, _) = vla_attention(*leaves, lam0=lam0, output_final_state=True, backend=backend)
    grads = torch.autograd.grad((o.to(do.dtype) * do).sum(), leaves)
    return [o.detach(), *grads], S.flatten(2).norm(dim=-1).max().item()


def cell(T: int, dtype: torch.dtype, lam0: float, device: torch.device, H: int, K: int) -> dict:
    xs = [x.to(dtype) for x in inputs(T, H, K, device)]
    do = torch.randn(xs[2].shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
    begin = time.perf_counter()
    got, s_norm = run(xs, do.to(dtype), lam0, "triton")
    ref, s_ref = run([x.double() for x in xs], do.double(), lam0, "torch")
    errors = {n: rel_rms(a, e) for n, a, e in zip(NAMES, got, ref)}
    nan = any(not torch.isfinite(t).all().item() for t in got)
    row = {
        "T": T, "dtype": str(dtype).removeprefix("torch."), "lam0": lam0, "H": H, "K": K, "errors": errors,
        "max_error": max(errors.values()), "bar": BARS[dtype], "nan": nan, "S_norm": s_norm, "S_norm_ref": s_ref,
        "seconds": time.perf_counter() - begin,
    }  # fmt: skip
    row["ok"] = not nan and row["max_error"] <= row["bar"]
    shown = " ".join(f"{n} {e:.1e}" for n, e in errors.items())
    print(f"T={T:6d} {row['dtype']:8s} lam0={lam0:<5g} {shown} |S|={s_norm:.3g} nan={nan} ok={row['ok']}", flush=True)
    del got, ref, xs
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument("--lam0s", nargs="+", type=float, default=[0.01, 0.1, 1.0, 10.0])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="vla_accuracy_h200")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for T in args.seq_lens:
            rows.append(cell(T, dtype, 0.1, device, args.heads, args.head_dim))
        T = args.seq_lens[min(1, len(args.seq_lens) - 1)]
        for lam0 in args.lam0s:
            if lam0 != 0.1:
                rows.append(cell(T, dtype, lam0, device, args.heads, args.head_dim))
    write_json(f"{args.out}/{args.name}.json", {"environment": environment(device), "rows": rows})
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cells within their bar")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
