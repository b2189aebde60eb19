"""One PaTH forward+backward through the kernels against the PyTorch backend, at one shape, on the GPU: the probe for a
fault that a shape or a setting brings out (``run_gpu.sh pathsmall`` runs each in its own process, with
``CUDA_LAUNCH_BLOCKING=1``, since an illegal memory access loses the process's CUDA context; on the CPU under
``TRITON_INTERPRET=1``, where the tests run it).

    python benchmarks/path_probe.py [--batch 2] [--seq-len 24] [--heads 2] [--kv-heads 2] [--key-dim 16]
        [--value-dim 16] [--dtype bfloat16] [--w-dtype float32] [--beta-dtype float32] [--gate]
        [--set MODULE.NAME=VALUE ...]

The defaults are the PaTH model of ``tests/models/test_autocast.py`` (hidden 32, 2 heads) under bf16 autocast: bf16
``q, k, v``, float32 ``w`` and ``beta`` as the layer hands them (until the twenty-first session ``beta`` came in bf16
under autocast: ``--beta-dtype bfloat16``, the shape that faulted on the GPU). Prints one line, ``OK`` or ``FAIL``,
with the largest error of ``o`` and of each gradient relative to the PyTorch backend's largest value (bars: 5e-3 for
``o``, 1e-2 for the gradients, at 16-bit inputs; 1e-3 at float32), and exits 1 on ``FAIL``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnkit.ops import path_attention  # noqa: E402
from attnkit.ops.common import validation  # noqa: E402
from benchmarks.kernel_profile import apply_setting  # noqa: E402

NAMES = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]
# run_gpu.sh pathsmall's probes (``--list`` prints them, one a line; ``benchmarks/precompile.py --probes`` compiles
# them): the shape that faulted (bf16 beta), the autocast model's now (float32 beta), then the faulting shape changed
# in one thing each (V; T: 64, one whole chunk where 24 is one partial chunk, and 77, two chunks; gates, query heads
# a key head, K, the inputs' dtype, the local adjoint's settings). In the twenty-third session every bf16 probe with
# one query head a key head and V below 64 faulted in the local adjoint, which now takes 64 value columns at least
# (local.value_block; benchmarks/results/path_small_k_fault_session23_h200.log): the probes hold it there.
LOCAL = "attnkit.ops.path.triton.local"
FAULT = "--beta-dtype bfloat16"
PROBES = [FAULT, ""] + [
    f"{FAULT} {change}"
    for change in (
        "--value-dim 64", "--seq-len 64", "--seq-len 77", "--seq-len 77 --heads 4 --gate", "--gate", "--heads 4",
        "--key-dim 64 --value-dim 16", "--key-dim 64 --value-dim 64", "--key-dim 32 --value-dim 32",
        "--dtype float16", "--dtype float32",
        f"--set {LOCAL}.LOCAL_GRADS_16BIT=None", f"--set {LOCAL}.LOCAL_SOLVE=None",
    )
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--key-dim", type=int, default=16)
    parser.add_argument("--value-dim", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--w-dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--beta-dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--gate", action="store_true", help="PaTH-FoX: forget gates")
    parser.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE", help="module attributes to change")
    parser.add_argument("--list", action="store_true", help="print run_gpu.sh pathsmall's probes, one a line, and stop")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(PROBES))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not validation.kernel_device(torch.device(device)):  # (benchmarks/precompile.py lets CPU tensors through)
        parser.error("the probe runs the kernels on a GPU, or on the CPU under TRITON_INTERPRET=1")
    settings = dict(apply_setting(text) for text in args.set)
    B, T, HQ, H, K, V = args.batch, args.seq_len, args.heads, args.kv_heads, args.key_dim, args.value_dim
    dtype, w_dtype, beta_dtype = (getattr(torch, name) for name in (args.dtype, args.w_dtype, args.beta_dtype))
    gen = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0, offset=0.0, to=dtype):
        return (offset + scale * torch.randn(*shape, generator=gen)).to(to).to(device).requires_grad_()

    q, k, v = make(B, T, HQ, K), make(B, T, H, K), make(B, T, H, V)
    w = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(w_dtype).to(device).requires_grad_()
    beta = (1.0 + 0.9 * torch.rand(B, T, H, generator=gen)).to(beta_dtype).to(device).requires_grad_()
    g = F.logsigmoid(torch.randn(B, T, HQ, generator=gen) + 3).to(device).requires_grad_() if args.gate else None
    do = torch.randn(B, T, HQ, V, generator=gen).to(dtype).to(device)
    inputs = [x for x in (q, k, v, w, beta, g) if x is not None]
    results = {}
    for backend in ("triton", "torch"):
        o = path_attention(q, k, v, w, beta, g, backend=backend)
        grads = torch.autograd.grad(o, inputs, do)
        if device == "cuda":
            torch.cuda.synchronize()
        results[backend] = [o.float()] + [x.float() for x in grads]
    errors = [
        ((a - e).abs().max() / e.abs().max().clamp_min(1e-6)).item() if torch.isfinite(a).all() else float("inf")
        for a, e in zip(results["triton"], results["torch"])
    ]
    exact = dtype == torch.float32
    ok = all(err <= (1e-3 if exact else 5e-3 if i == 0 else 1e-2) for i, err in enumerate(errors))
    gate = " gate" if g is not None else ""
    shape = (
        f"B={B} T={T} HQ={HQ} H={H} K={K} V={V} {args.dtype} w {args.w_dtype}{gate}{f' {settings}' if settings else ''}"
    )
    table = " ".join(f"{name} {err:.1e}" for name, err in zip(NAMES, errors))
    print(f"{'OK' if ok else 'FAIL'} {shape}: {table}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
