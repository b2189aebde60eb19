"""Where the time of VLA's Triton backend goes: one forward+backward under ``torch.profiler``, its GPU kernels
grouped by name, next to FLA's ``chunk_delta_rule`` on the same shape.

    python benchmarks/vla_profile.py [--batch 32] [--seq-len 1024] [--heads 16] [--head-dim 64] [--out DIR]

bf16 inputs as ``benchmarks/ops.py`` makes them. First the gate kernels alone (warps, chunks a program, rows a
downdate block), then the kernels of each implementation by total GPU time (the table to read for the largest
gap); writes ``DIR/vla_profile_h200.json`` after each part.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.cpu_bench import make_inputs  # noqa: E402
from attnkit.experiments.output import write_json  # noqa: E402
from benchmarks.kernel_profile import applied, kernel_table, print_table  # noqa: E402
from benchmarks.ops import REGISTRY, environment  # noqa: E402

COLUMNS = (None, 32, 64)  # the backward's column blocks timed (gates.BWD_COLUMNS; None: one program a chunk)


def gate_sweep(B: int, T: int, H: int) -> list[dict]:
    """The gate kernels alone: warps, chunks a program (``GROUP``), rows a downdate block (``SB``; 64 = the chunk,
    unblocked), K = 64 and 128 (same tokens), ms by ``do_bench``; then the default launch's backward in column blocks
    (``gates.BWD_COLUMNS``), with its largest relative difference from the one-program kernel's gradients."""
    from triton.testing import do_bench

    from attnkit.ops.vla.triton.gates import vla_gates_bwd_fn, vla_gates_fwd_fn

    rows = []
    for K in (64, 128):
        h = H * 64 // K
        k_hat = torch.nn.functional.normalize(torch.randn(B, T, h, K, device="cuda"), dim=-1)  # [B, T, H, K]
        u = torch.nn.functional.normalize(torch.randn(B, T, h, K, device="cuda"), dim=-1) / K**0.5
        X = torch.randn(B, h, T // 64, 2 * K, K, device="cuda") / K
        lam = 0.1 * torch.eye(K, device="cuda") + X.mT @ X
        w = 4 if K == 64 else 8
        # The fifteenth session's sweep (vla_profile_session15_h200.log) set GROUP = 8, SB = 16 and found eight warps
        # at K = 64 2.2x slower than four: the default against fewer warps (the downdates' reductions cross fewer).
        configs = [(w, 8, 16), (w // 2, 8, 16), (w // 2, 4, 16), (w // 2, 8, 32), (w, 4, 16)]
        for warps, group, sb in configs:
            if K == 128 and group == 4 and sb == 64:
                continue  # 256 KB of shared memory
            config = dict(num_warps=warps, num_stages=1, GROUP=group, SB=sb)
            saved = vla_gates_fwd_fn(k_hat, u, lam, 64, "tf32x3", config)
            dalpha = torch.randn_like(k_hat)
            fwd = do_bench(lambda: vla_gates_fwd_fn(k_hat, u, lam, 64, "tf32x3", config))  # noqa: B023
            bwd = do_bench(lambda: vla_gates_bwd_fn(u, *saved, dalpha, 64, "tf32x3", config))  # noqa: B023
            rows.append({"K": K, "H": h, "warps": warps, "group": group, "SB": sb, "fwd_ms": fwd, "bwd_ms": bwd})
            shown = f"forward {fwd:.3f} ms, backward {bwd:.3f} ms"
            print(f"  gates K={K} H={h} warps={warps} group={group} SB={sb}: {shown}", flush=True)
        saved = vla_gates_fwd_fn(k_hat, u, lam, 64, "tf32x3")
        with applied(["attnkit.ops.vla.triton.gates.BWD_COLUMNS=None"]):
            expected = vla_gates_bwd_fn(u, *saved, dalpha, 64, "tf32x3")
        for columns in COLUMNS:
            with applied([f"attnkit.ops.vla.triton.gates.BWD_COLUMNS={columns}"]):
                got = vla_gates_bwd_fn(u, *saved, dalpha, 64, "tf32x3")
                bwd = do_bench(lambda: vla_gates_bwd_fn(u, *saved, dalpha, 64, "tf32x3"))  # noqa: B023
            diff = max(((x - y).norm() / y.norm()).item() for x, y in zip(got, expected))
            rows.append({"K": K, "H": h, "bwd_columns": columns, "bwd_ms": bwd, "rel_diff": diff})
            blocks = "one program a chunk" if columns is None else f"{columns}-column blocks"
            print(f"  gates K={K} H={h} backward in {blocks}: {bwd:.3f} ms ({diff:.1e})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--impls", nargs="+", default=["vla_triton", "fla_chunk_delta_rule"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default="vla_profile_h200")
    args = parser.parse_args(argv)
    op = REGISTRY["vla"]
    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    x = {n: t.cuda().bfloat16() for n, t in make_inputs("vla", B, T, H, D).items()}
    do = torch.randn_like(x["v"])
    payload = {"environment": environment(torch.device("cuda")), "gate_sweep": gate_sweep(B, T, H), "tables": {}}
    write_json(f"{args.out}/{args.name}.json", payload)
    for name in args.impls:  # FLA's first call autotunes for a minute: last, and written after each
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        table, wall_ms = kernel_table(partial(op.impls[name].fn, leaves), list(leaves.values()), do)
        payload["tables"][name] = table
        write_json(f"{args.out}/{args.name}.json", payload)
        print_table(name, f"B={B} T={T} H={H} D={D}", table, wall_ms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
