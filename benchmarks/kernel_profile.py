"""Where one forward+backward's GPU time goes: the kernels of each implementation of an op under
``torch.profiler``, grouped by name, largest first, next to the step's wall time (the gap between the two is
time the GPU waits on the host: launches, syncs, allocation).

    python benchmarks/kernel_profile.py --op path [--impls path_triton fla_parallel_path_attn]
        [--batch 8] [--seq-len 4096] [--head-dims 64 128] [--out DIR] [--name NAME] [--set MODULE.NAME=VALUE ...]

bf16 inputs as ``benchmarks/ops.py`` makes them (H = 1024 // D); writes ``DIR/NAME.json`` after each table. ``--set``
profiles with a module attribute changed, a Python literal, e.g. every PaTH pair chunk by chunk:
``--set attnkit.ops.path.triton.prepare.SUPERBLOCK=1073741824`` (``prepare.NO_SUPERBLOCKS``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from benchmarks.ops import REGISTRY, WIDTH, _layout, _leaves, environment  # noqa: E402


def kernel_table(fn, leaves: list[torch.Tensor], do: torch.Tensor, steps: int = 3) -> tuple[list[dict], float]:
    """GPU kernels of ``steps`` forward+backward calls of ``fn`` (µs per call, largest first) and the wall ms of
    one call. Each call starts from empty ``.grad`` on the leaves: accumulated into the last call's, the gradients
    added one elementwise kernel per leaf that no training step runs (141 µs a DeltaNet call at T = 32k, seventeenth
    session)."""

    def step():
        for t in leaves:
            t.grad = None
        torch.autograd.backward(fn(), do)

    for _ in range(2):  # compile and warm up
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    rows = profile_kernels(step, steps)
    for t in leaves:
        t.grad = None
    return rows, wall_ms


def profile_kernels(run, steps: int) -> list[dict]:
    """The GPU kernels of ``steps`` calls of ``run`` under ``torch.profiler``, grouped by name: µs and calls per call
    of ``run``, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    rows = [
        {"kernel": e.key[:90], "us": e.device_time_total / steps, "calls": e.count // steps}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["us"])


def parse_setting(text: str) -> tuple[object, str, object]:
    """``MODULE.NAME=VALUE`` -> ``(module, NAME, VALUE)``, the module imported and ``VALUE`` a Python literal."""
    target, sep, literal = text.partition("=")
    module_name, _, attr = target.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"--set: expected MODULE.NAME=VALUE, got {text!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise ValueError(f"--set: {module_name} has no attribute {attr!r}")
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError) as error:
        raise ValueError(f"--set: {literal!r} is not a Python literal") from error
    return module, attr, value


def apply_setting(text: str) -> tuple[str, object]:
    """``MODULE.NAME=VALUE`` -> sets ``MODULE.NAME`` to the literal ``VALUE``; returns ``(MODULE.NAME, VALUE)``."""
    module, attr, value = parse_setting(text)
    setattr(module, attr, value)
    return text.partition("=")[0], value


@contextlib.contextmanager
def applied(settings: list[str]):
    """Every ``MODULE.NAME=VALUE`` of ``settings`` set, and each attribute put back on exit."""
    saved = []
    try:
        for text in settings:
            module, attr, value = parse_setting(text)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


def print_table(name: str, shape: str, table: list[dict], wall_ms: float | None = None, top: int = 25) -> None:
    total = sum(r["us"] for r in table)
    wall = "" if wall_ms is None else f", {wall_ms:.3f} ms wall"
    print(f"\n{name}: {shape} bf16, forward+backward, {total / 1e3:.3f} ms of GPU kernels{wall}")
    for r in table[:top]:
        print(f"  {r['us']:9.1f} us  {r['calls']:3d}x  {r['kernel']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, choices=sorted(REGISTRY))
    parser.add_argument("--impls", nargs="+", help="default: every implementation of the op")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", help="default: profile_OP_h200")
    parser.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE", help="module attributes to change")
    args = parser.parse_args(argv)
    op = REGISTRY[args.op]
    name = args.name or f"profile_{args.op}_h200"
    try:
        settings = dict(apply_setting(text) for text in args.set)
    except ValueError as error:
        parser.error(str(error))
    payload = {"environment": environment(torch.device("cuda")), "settings": settings, "tables": []}
    for D in args.head_dims:
        B, T, H = args.batch, args.seq_len, WIDTH // D
        x = {n: t.cuda().bfloat16() for n, t in op.make_inputs(B, T, H, D).items()}
        do = torch.randn_like(x["v"])
        for impl in args.impls or list(op.impls):  # FLA's first call autotunes for a minute
            leaves = _leaves(x, op.impls[impl], requires_grad=True)
            fn = partial(op.impls[impl].fn, leaves)
            table, wall_ms = kernel_table(fn, list(leaves.values()), _layout(do, op.impls[impl]))
            row = {"impl": impl, "B": B, "T": T, "H": H, "D": D, "wall_ms": wall_ms, "kernels": table}
            payload["tables"].append(row)
            write_json(f"{args.out}/{name}.json", payload)
            print_table(impl, f"B={B} T={T} H={H} D={D}", table, wall_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
