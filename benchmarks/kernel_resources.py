"""What every Triton kernel of PaTH's forward+backward compiles to on Hopper, without a GPU: registers, spills,
shared memory and tensor-core instructions (``wgmma`` or the warp-level ``mma.sync``) of each launch the GPU's
defaults pick (``benchmarks/results/path_kernel_resources_sm90a.json``).

    pip install --target /tmp/t36 triton==3.6.0     # the GPU machine's Triton; the CPU wheel carries ptxas
    PYTHONPATH=/tmp/t36 python benchmarks/kernel_resources.py [--head-dims 64 128] [--gate] [--list] [--out FILE]
        [--setting LABEL]    # one of path_tune.py's LOCAL settings (its module attributes patched meanwhile)
        [--loops]            # each loop's SASS instructions by opcode, innermost first

The launchers run on CPU tensors without ``TRITON_INTERPRET`` (it must be unset: the kernels are then plain
``JITFunction``s, and the launchers choose the GPU's chunks, tiles, warps, stages and precisions), and every launch is
recorded instead of run: their outputs are never read (the launchers take no host sync, which this also checks).
``--list`` prints the launches without compiling them. Each distinct specialisation is then compiled for sm_90a through
:func:`benchmarks.sass_report.compile_report`. Inputs are bf16, as a model under autocast hands them (``w``, ``beta``
and the gates float32), one sequence of 2048 positions (four superblocks at the default span), ``H·D = 1024``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton.runtime.jit import JITFunction  # noqa: E402

from benchmarks.sass_report import compile_report  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def record_launches(fn, keep: bool = True, on_launch=None) -> list[dict]:
    """Run ``fn`` with every Triton launch recorded (kernel, arguments by name, warps, stages) instead of run; with
    ``keep`` False each launch is dropped and nothing is recorded (its arguments would outlive their frees).
    ``on_launch``: called with each launch's kernel (a ``JITFunction``) as it is dropped or recorded."""
    launches, run = [], JITFunction.run

    def recorder(self, *args, grid, warmup, **kwargs):
        if on_launch is not None:
            on_launch(self)
        if keep:
            named = dict(zip([p.name for p in self.params], args)) | kwargs
            launches.append(dict(kernel=self, args=named))

    JITFunction.run = recorder
    try:
        fn()
    finally:
        JITFunction.run = run
    return launches


def specialisation(launch: dict) -> tuple[dict, dict, int, int]:
    """``(signature, constants, num_warps, num_stages)`` of a recorded launch, as ``compile_report`` takes them."""
    args, signature, constants = dict(launch["args"]), {}, {}
    warps, stages = args.pop("num_warps", 4), args.pop("num_stages", 3)
    for p in launch["kernel"].params:
        value = args.get(p.name, p.default if p.has_default else None)
        if p.is_constexpr or value is None:
            constants[p.name] = value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            constants[p.name] = value
        elif isinstance(value, int):
            signature[p.name] = "i32" if abs(value) < 2**31 else "i64"
        else:
            signature[p.name] = "fp32"
    return signature, constants, warps, stages


def path_inputs(D: int, gate: bool, B: int = 1, T: int = 2048) -> tuple:
    """``(q, k, v, w, beta, g, do)`` on the CPU as a model under autocast hands them: ``q, k, v, do`` bf16, unit
    ``w``, ``beta`` and the gates float32, ``H·D = 1024``."""
    H = max(1, 1024 // D)
    q, k, v, do = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    w = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    beta, g = torch.rand(B, T, H) * 2, (-torch.rand(B, T, H) if gate else None)
    return q, k, v, w, beta, g, do


def path_step(D: int, gate: bool, inputs: tuple | None = None):
    """PaTH's (or PaTH-FoX's) forward then backward through the kernels' own functions, on CPU tensors
    (``inputs``: :func:`path_inputs`' tuple, by default one sequence of 2048 positions), as a step under autograd
    runs them: the forward's prepared tensors kept for the backward where ``parallel.keeps_prepared``."""
    from attnkit.ops.path.parallel import keeps_prepared, path_bwd_fn
    from attnkit.ops.path.triton.forward import path_fwd_fn

    q, k, v, w, beta, g, do = path_inputs(D, gate) if inputs is None else inputs
    o, lse, *prepared = path_fwd_fn(q, k, v, w, beta, g, D**-0.5, None, keep=keeps_prepared(q.dtype, D))
    path_bwd_fn(q, k, v, w, beta, g, None, o, lse, do, D**-0.5, prepared or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--gate", action="store_true", help="PaTH-FoX (the gates' kernels and branches)")
    parser.add_argument("--list", action="store_true", help="print the launches, compile nothing")
    parser.add_argument("--out", help="JSON of every row")
    parser.add_argument("--setting", help="a path_tune.LOCAL label: compile the launches that setting makes")
    parser.add_argument(
        "--loops", action="store_true", help="also each loop's SASS instructions by opcode (innermost loops first)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1: the launchers would pick the interpreter's configurations; unset it")
    from benchmarks import path_tune

    settings = dict(path_tune.LOCAL)
    if args.setting is not None and args.setting not in settings:
        parser.error(f"--setting: {args.setting!r} is not one of {list(settings)}")
    rows = []
    for D in args.head_dims:
        seen = set()
        with path_tune.patched(settings.get(args.setting, {})):
            launches = record_launches(functools.partial(path_step, D, args.gate))
        for launch in launches:
            signature, constants, warps, stages = specialisation(launch)
            name = launch["kernel"].fn.__name__
            key = (name, json.dumps(constants, default=str, sort_keys=True), warps, stages)
            if key in seen:
                continue
            seen.add(key)
            if args.list:
                shown = {k: v for k, v in constants.items() if v is not None and k.isupper()}
                print(f"D={D} {name} (warps {warps}, stages {stages}): {shown}", flush=True)
                continue
            try:
                report = compile_report(launch["kernel"], signature, constants, warps, stages)
                loop_ops = sorted(report.pop("loop_ops"), key=lambda ops: sum(ops.values()))
                report.pop("loops")
                if args.loops:
                    report["loops"] = [dict(instructions=sum(ops.values()), opcodes=ops) for ops in loop_ops]
            except Exception as e:  # noqa: BLE001 — out of resources and the like are results here
                report = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
            row = dict(D=D, kernel=name, num_warps=warps, num_stages=stages, **report)
            row["constants"] = {k: v for k, v in constants.items() if v is not None and k.isupper()}
            rows.append(row)
            shown = ", ".join(f"{k}={v}" for k, v in report.items() if k != "loops")
            print(f"D={D} {name} (warps {warps}, stages {stages}): {shown}", flush=True)
            for loop in report.get("loops", []):
                top = ", ".join(f"{op} {n}" for op, n in list(loop["opcodes"].items())[:14])
                print(f"    loop of {loop['instructions']} instructions: {top}", flush=True)
    if args.out:
        import triton

        from benchmarks.ops import environment

        env = environment(torch.device("cpu")) | dict(
            triton=triton.__version__, target="sm_90a", gate=args.gate, setting=args.setting
        )
        Path(args.out).write_text(json.dumps(dict(environment=env, rows=rows), indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
