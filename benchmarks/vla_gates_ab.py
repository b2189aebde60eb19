"""VLA's gate stage (the chunks' penalties, the write directions and their backward) of this tree against another
version of ``attnkit/ops/vla/triton/gates.py``, in the same run: forward and backward times of the default launches,
the backward in column blocks (``gates.BWD_COLUMNS``) beside them, and every output's relative difference from the
other version's.

    git show REV:attnkit/ops/vla/triton/gates.py > /tmp/gates_before.py
    python benchmarks/vla_gates_ab.py --before /tmp/gates_before.py [--shapes 64:1024:32 128:32768:1] [--out DIR]

A shape is ``K:T:B`` with ``H·K = 1024`` (32768 tokens a batch by default). On CUDA the times are
``triton.testing.do_bench`` medians; ``--device cpu`` (the interpreter, tiny shapes) runs each once, untimed, for the
tests. Writes ``DIR/vla_gates_ab.json`` with the GPU, torch, Triton and commit.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attnkit.ops.vla.triton.gates as gates  # noqa: E402
from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.common.triton_utils import float32_dots  # noqa: E402
from benchmarks.kernel_profile import applied  # noqa: E402
from benchmarks.ops import environment  # noqa: E402
from benchmarks.vla_profile import COLUMNS  # noqa: E402

NAMES = ("alpha", "A_end", "dk_hat", "du", "dlam_init")


def load_before(path: str):
    """The other version as its own module (its kernels distinct from this tree's)."""
    spec = importlib.util.spec_from_file_location("gates_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_ms(fn, device: str) -> float | None:
    if device == "cpu":
        fn()
        return None
    from triton.testing import do_bench

    return do_bench(fn, rep=200)


def stage(module, k_hat, u, dalpha, chunk: int, precision: str, device: str) -> dict:
    """The forward and backward of ``module``'s gate stage: times and outputs."""

    def forward():
        return module.vla_write_fwd_fn(k_hat, u, None, None, 0.1, chunk, precision)

    alpha, a_end, a0, r, anorm = forward()

    def backward():
        return module.vla_write_bwd_fn(u, alpha, a0, r, anorm, a_end, dalpha, None, None, chunk, precision)

    outputs = (alpha, a_end, *backward())
    return dict(fwd_ms=time_ms(forward, device), bwd_ms=time_ms(backward, device), outputs=outputs)


def column_label(columns: int | None) -> str:
    """A row's name for the backward's column blocks (``gates.BWD_COLUMNS``)."""
    return "one program" if columns is None else f"columns {columns}"


def compare(before, K: int, T: int, B: int, device: str) -> dict:
    H = 1024 // K if device != "cpu" else 2
    chunk = 64 if device != "cpu" else 32
    gen = torch.Generator(device=device).manual_seed(0)
    k_hat = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    u = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1) / K**0.5
    dalpha = torch.randn(B, T, H, K, device=device, generator=gen)
    precision = float32_dots(torch.float32)
    runs = {"before": stage(before, k_hat, u, dalpha, chunk, precision, device)}
    runs["now"] = stage(gates, k_hat, u, dalpha, chunk, precision, device)  # this tree's defaults
    for columns in COLUMNS:
        with applied([f"{gates.__name__}.BWD_COLUMNS={columns}"]):
            runs[column_label(columns)] = stage(gates, k_hat, u, dalpha, chunk, precision, device)
    reference = runs["before"]["outputs"]
    row = dict(K=K, T=T, B=B, H=H)
    for name, run in runs.items():
        diff = {n: ((x - y).norm() / y.norm()).item() for n, x, y in zip(NAMES, run["outputs"], reference)}
        row[name] = dict(fwd_ms=run["fwd_ms"], bwd_ms=run["bwd_ms"], rel_diff=diff)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="another version of attnkit/ops/vla/triton/gates.py")
    parser.add_argument("--shapes", nargs="+", default=["64:1024:32", "128:1024:32", "64:32768:1", "128:32768:1"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    before = load_before(args.before)
    rows = []
    for shape in args.shapes:
        K, T, B = (int(x) for x in shape.split(":"))
        row = compare(before, K, T, B, args.device)
        rows.append(row)
        cells = "; ".join(
            f"{name} fwd {row[name]['fwd_ms'] or 0:.3f} bwd {row[name]['bwd_ms'] or 0:.3f} ms"
            f" (diff {max(row[name]['rel_diff'].values()):.1e})"
            for name in row
            if isinstance(row[name], dict)
        )
        print(f"K={K} T={T} B={B}: {cells}", flush=True)
        payload = {"environment": environment(torch.device(args.device)), "rows": rows}
        write_json(f"{args.out}/vla_gates_ab.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
