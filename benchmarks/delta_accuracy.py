"""DeltaNet's accuracy (issue 17) under the delta-rule kernels' settings: the Triton backend's output, final state and
gradients against the float64 PyTorch backend on the same rounded inputs, one run per setting.

    python benchmarks/delta_accuracy.py [--seq-lens 4096 32768] [--head-dims 64 128] [--out DIR] [--name NAME]
        [--settings "" "attnkit.ops.common.triton.delta_bwd.WY_WARPS=4" ...]

Inputs as a DeltaNet layer hands them under bf16 autocast: ``q``, ``v`` normal, unit keys (bf16, or ``--dtype``: under
``TRITON_INTERPRET=1`` bf16 products are wrong), ``beta`` float32
in ``(0, 1)`` (a sigmoid's range) and in ``(1.5, 2)`` (the eigenvalue ``1 − β`` near −1), B = 1, H = 4, an initial
state. Each setting (``MODULE.NAME=VALUE`` entries separated by spaces, "" the defaults) runs every cell; the
reference runs once a cell. Reported: relative RMS errors of ``o``, ``S``, ``dq``, ``dk``, ``dv``, ``dbeta``,
``dS0`` and whether anything is NaN; bars 5e-3 for ``o`` and ``S``, 1e-2 for the gradients (issue 17). Writes
``DIR/NAME.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import delta_rule  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from benchmarks.kernel_profile import applied  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

NAMES = ("o", "S", "dq", "dk", "dv", "dbeta", "dS0")
BARS = {"o": 5e-3, "S": 5e-3}


def inputs(
    T: int, K: int, beta_range: tuple[float, float], device: torch.device, dtype: torch.dtype, H: int = 4
) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(T + K)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, v = randn(1, T, H, K).to(dtype), randn(1, T, H, K).to(dtype)
    k = F.normalize(randn(1, T, H, K), dim=-1).to(dtype)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(1, T, H, generator=gen, device=device)
    return [q, k, v, beta, 0.1 * randn(1, H, K, K)]


def run(xs: list[torch.Tensor], cotangents: list[torch.Tensor], backend: str) -> list[torch.Tensor]:
    leaves = [x.detach().requires_grad_() for x in xs]
    q, k, v, beta, state = leaves
    o, S = delta_rule(q, k, v, beta, initial_state=state, output_final_state=True, backend=backend)
    loss = (o.to(cotangents[0].dtype) * cotangents[0]).sum() + (S.to(cotangents[1].dtype) * cotangents[1]).sum()
    return [o.detach(), S.detach(), *torch.autograd.grad(loss, leaves)]


def measure(xs: list, cot: list, ref: list, setting: str, label: str) -> dict:
    """One setting's errors on one cell, the attributes it names put back after."""
    with applied(setting.split()):
        got = run(xs, cot, "triton")
    errors = {n: rel_rms(a.double(), e) for n, a, e in zip(NAMES, got, ref)}
    nan = any(not torch.isfinite(t).all().item() for t in got)
    ok = not nan and all(e <= BARS.get(n, 1e-2) for n, e in errors.items())
    shown = " ".join(f"{n} {e:.1e}" for n, e in errors.items())
    print(f"{label} {setting or 'default'}: {shown} nan={nan} ok={ok}", flush=True)
    return dict(setting=setting or "default", errors=errors, nan=nan, ok=ok)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--settings", nargs="+", default=[""])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="delta_accuracy")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for K in args.head_dims:
        for T in args.seq_lens:
            for beta_range in ((0.0, 1.0), (1.5, 2.0)):
                xs = inputs(T, K, beta_range, device, getattr(torch, args.dtype))
                gen = torch.Generator(device=device).manual_seed(1)
                cot = [torch.randn(1, T, 4, K, generator=gen, device=device), torch.randn(1, 4, K, K, device=device)]
                ref = run([x.double() for x in xs], [c.double() for c in cot], "torch")
                for setting in args.settings:
                    row = measure(xs, cot, ref, setting, f"K={K} T={T} beta={beta_range}")
                    rows.append(row | dict(K=K, T=T, beta=list(beta_range)))
                del ref
                torch.cuda.empty_cache() if device.type == "cuda" else None
    write_json(f"{args.out}/{args.name}.json", {"environment": environment(device), "rows": rows})
    print(f"{sum(r['ok'] for r in rows)} of {len(rows)} cells within their bars")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
