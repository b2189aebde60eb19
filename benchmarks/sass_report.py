"""What the TAPA kernels compile to on Hopper, without a GPU: registers, spills, shared memory and the size of
each main loop in SASS instructions, for the launch configurations ``fwd_config`` / ``bwd_config`` pick.

    pip install --target /tmp/t36 triton==3.6.0     # the GPU machine's Triton; the CPU wheel carries ptxas
    PYTHONPATH=/tmp/t36 python benchmarks/sass_report.py [--head-dims 64 128]

Compiles for sm_90a with the launcher's 16-byte alignment specialisation (without it every load is scalar and
the report is meaningless), assembles with Triton's own ``ptxas`` and disassembles with its ``cuobjdump``. A loop
is a backward branch; its size over the logits per thread per iteration is the issue cost the kernel pays per
logit (the forward is issue-bound: ``benchmarks/results/tapa_h200.md``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.ops.tapa.triton.backward import bwd_config, tapa_bwd_dkdv_kernel  # noqa: E402
from attnkit.ops.tapa.triton.forward import fwd_config, tapa_fwd_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of each loop of a kernel in ``cuobjdump --dump-sass``'s text, in the order of their backward
    branches (as ``compile_report``'s ``loops``): a loop runs from a branch's target to the branch."""
    ins = [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(ins)}
    bodies = []
    for i, (address, text) in enumerate(ins):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else address
        if target < address and target in index:
            bodies.append([t for _, t in ins[index[target] : i + 1]])
    return bodies


def opcode_counts(body: list[str]) -> dict[str, int]:
    """A loop's instructions by opcode, most frequent first; a predicate and the modifiers are dropped (``@!P0
    FMUL.FTZ R1, R2, R3`` counts as ``FMUL``): where a loop's issue slots go, e.g. ``SHFL`` for cross-thread
    reductions, ``LDL`` for spill reloads, ``HGMMA`` for the tensor-core products."""
    ops = Counter(re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in body)
    return dict(ops.most_common())


def compile_report(fn, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int) -> dict:
    """Registers, spill bytes, shared memory, ``[instructions per loop]`` and tensor-core instructions (``wgmma``,
    ``mma_sync``) of one specialisation."""
    aligned = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(signature.items()) if t.startswith("*")}
    aligned.update({(list(signature).index(n),): [["tt.divisibility", 16]] for n in ("T", "NT") if n in signature})
    src = ASTSource(
        fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants, attrs=aligned
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    ptxas = subprocess.run(
        [str(BIN / "ptxas"), "-arch=sm_90a", "-v", "-o", os.devnull, "/dev/stdin"],
        input=kernel.asm["ptx"], capture_output=True, text=True,
    )  # fmt: skip
    regs = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(BIN / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
    bodies = loop_bodies(sass)
    ptx = kernel.asm["ptx"]
    return dict(
        registers=int(regs.group(1)) if regs else None,
        spill_bytes=int(spills.group(1)) if spills else 0,
        shared=kernel.metadata.shared,
        loops=[len(body) - 1 for body in bodies],  # the instructions from the branch's target up to the branch
        loop_ops=[opcode_counts(body) for body in bodies],
        # Hopper's warpgroup MMA (wgmma, a 64-row tile a warpgroup at least) against the warp-level mma.sync that
        # Triton falls back to for smaller tiles: the tensor-core instructions in the PTX.
        wgmma=len(re.findall(r"\bwgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90a, bf16, theta 0.5")
    for D in args.head_dims:
        dims = (D // 2, D // 2, D)
        base = dict(HQ=8, H=8, DA=D // 2, DP=D // 2, V=D, BDA=D // 2, BDP=D // 2, BV=D, IS_VARLEN=False, LOG_N=1)
        base.update(PRECISION="tf32", TRIG_ASM=False, ALPHA_ZERO=False, LINEAR=False, SERIES=0)
        seq = {"cu_seqlens": "*i32", "offsets": "*i32", "N": "i32", "T": "i32", "NT": "i32", "series_gap": "i32"}
        BM, BN, warps, stages = fwd_config(dims)
        sig = dict.fromkeys(["q", "k", "v", "o"], "*bf16") | {"lse": "*fp32"} | seq
        sig |= {"scale_log2": "fp32", "alpha": "fp32", "log2_scale": "fp32"}
        report = compile_report(tapa_fwd_kernel, sig, base | dict(BM=BM, BN=BN), warps, stages)
        report.pop("loop_ops")
        per_logit = [round(n / (BM * BN / (32 * warps)), 1) for n in report["loops"]]
        print(f"D={D} forward  {BM}x{BN} {warps}w: {report} -> instructions per logit {per_logit}")

        cfg = bwd_config(dims)
        BM, BN, warps, stages = cfg["dkdv"]
        sig = dict.fromkeys(["q", "k", "v", "do"], "*bf16") | {"lse": "*fp32", "delta": "*fp32", "dq": "*fp32"}
        sig |= dict.fromkeys(["dk", "dv"], "*bf16") | seq
        sig |= dict.fromkeys(["scale_log2", "scale_amp", "alpha", "log2_scale"], "fp32")
        consts = base | dict(BM=BM, BN=BN, ATOMIC_DQ=cfg["atomic_dq"])
        report = compile_report(tapa_bwd_dkdv_kernel, sig, consts, warps, stages)
        report.pop("loop_ops")
        per_logit = [round(n / (BM * BN / (32 * warps)), 1) for n in report["loops"]]
        print(f"D={D} dK/dV    {BM}x{BN} {warps}w: {report} -> instructions per logit {per_logit}")


if __name__ == "__main__":
    main()
