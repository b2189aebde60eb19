"""Tuning sweep of the TAPA Triton kernels on a GPU: block sizes, warps, stages, the cosine on the FMA pipe or
the special-function unit, and dQ by recomputation or atomics — each timed against SDPA (flash) in one run.

    python benchmarks/tapa_tune.py [--seq-lens 2048 8192 32768] [--head-dims 64 128] [--out DIR]
    python benchmarks/tapa_tune.py --series-orders 0 3 4 6 [--seq-lens ...] [--head-dims ...] [--out DIR]

bf16, causal, 32768 tokens per batch, H·D = 1024 (SPEC §8). Prints a table per cell (fastest first) and
writes ``tapa_tune.json``. The chosen configurations live in ``fwd_config`` / ``bwd_config``. With
``--series-orders``, it times the distance power's series off the diagonal instead (order 0 is the exact path;
the default launch configurations) and writes ``tapa_series.json``: the order that wins becomes
``common.SERIES_ORDER``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.tapa.triton.backward import tapa_bwd_fn  # noqa: E402
from attnkit.ops.tapa.triton.forward import tapa_fwd_fn  # noqa: E402
from benchmarks.ops import environment  # noqa: E402

FWD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (128, 32, 4, 3)]
DKDV = [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 1)]
DQ = [(128, 64, 8, 2), (64, 64, 4, 3)]


def bench(fn, grad_to_none=None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def time_cell(D: int, T: int) -> dict:
    """Every variant of one (D, T) cell, with SDPA's forward and backward as the yardsticks."""
    H, B = 1024 // D, 32768 // T
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q.clone(), k.clone(), v.clone()))
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa_fwd = bench(sdpa)
        ot = sdpa()
        sdpa_bwd = bench(functools.partial(ot.backward, do.transpose(1, 2), retain_graph=True), [qt, kt, vt])
    cell = dict(D=D, T=T, B=B, H=H, sdpa_fwd=sdpa_fwd, sdpa_bwd=sdpa_bwd, fwd=[], bwd=[])
    for config, asm in itertools.product(FWD, (False, True)):
        fn = functools.partial(tapa_fwd_fn, q, k, v, D // 2, 0.1, None, config=config, trig_asm=asm)
        ms = bench_or_nan(fn, f"fwd {config} asm={asm}")
        cell["fwd"].append(dict(config=config, asm=asm, ms=ms, ratio=ms / sdpa_fwd))
    o, lse = tapa_fwd_fn(q, k, v, D // 2, 0.1, None)
    for dkdv, dq, atomic, asm in itertools.product(DKDV, DQ, (False, True), (False, True)):
        if atomic and dq != DQ[0]:
            continue  # the dQ kernel does not run with atomics
        config = {"dkdv": dkdv, "dq": dq, "atomic_dq": atomic}
        fn = functools.partial(tapa_bwd_fn, q, k, v, o, lse, do, D // 2, 0.1, None, config=config, trig_asm=asm)
        ms = bench_or_nan(fn, f"bwd {config} asm={asm}")
        cell["bwd"].append(dict(config=config, asm=asm, ms=ms, ratio=ms / sdpa_bwd))
    torch.cuda.empty_cache()
    return cell


def time_series(D: int, T: int, orders: list[int]) -> list[dict]:
    """Forward and backward of the default configurations at each series order, with the exact path's ratio."""
    H, B = 1024 // D, 32768 // T
    q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = tapa_fwd_fn(q, k, v, D // 2, 0.1, None)
    rows = []
    for order in orders:
        fwd = functools.partial(tapa_fwd_fn, q, k, v, D // 2, 0.1, None, series_order=order)
        bwd = functools.partial(tapa_bwd_fn, q, k, v, o, lse, do, D // 2, 0.1, None, series_order=order)
        rows.append(dict(D=D, T=T, order=order, fwd_ms=bench_or_nan(fwd, "fwd"), bwd_ms=bench_or_nan(bwd, "bwd")))
    exact = next((r for r in rows if r["order"] == 0), rows[0])
    for r in rows:
        r["fwd_ratio"], r["bwd_ratio"] = r["fwd_ms"] / exact["fwd_ms"], r["bwd_ms"] / exact["bwd_ms"]
    torch.cuda.empty_cache()
    return rows


def bench_or_nan(fn, label: str) -> float:
    """A variant that does not compile or fit (shared memory, registers) is a NaN row, not a crash."""
    try:
        return bench(fn)
    except Exception as e:  # noqa: BLE001
        print(label, type(e).__name__, str(e)[:160])
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--series-orders", type=int, nargs="+", help="time these series orders (0: exact) instead")
    args = parser.parse_args()
    if args.series_orders:
        cells = itertools.product(args.head_dims, args.seq_lens)
        rows = [r for D, T in cells for r in time_series(D, T, args.series_orders)]
        env = environment(torch.device("cuda"))
        write_json(str(Path(args.out) / "tapa_series.json"), {"environment": env, "rows": rows})
        for r in rows:
            print(f"D={r['D']} T={r['T']} order={r['order']}: fwd {r['fwd_ms']:.3f} ms ({r['fwd_ratio']:.3f}x exact), "
                  f"bwd {r['bwd_ms']:.3f} ms ({r['bwd_ratio']:.3f}x exact)")  # fmt: skip
        return
    rows = [time_cell(D, T) for D, T in itertools.product(args.head_dims, args.seq_lens)]
    # The benchmark's record of the machine: GPU, torch, triton, python, commit, dirty tree, source hash, date.
    env = environment(torch.device("cuda"))
    write_json(str(Path(args.out) / "tapa_tune.json"), {"environment": env, "cells": rows})
    for cell in rows:
        best_f = sorted((r for r in cell["fwd"] if r["ms"] == r["ms"]), key=lambda r: r["ms"])[:4]
        best_b = sorted((r for r in cell["bwd"] if r["ms"] == r["ms"]), key=lambda r: r["ms"])[:4]
        print(f"D={cell['D']} T={cell['T']}: sdpa fwd {cell['sdpa_fwd']:.3f} ms, bwd {cell['sdpa_bwd']:.3f} ms")
        for r in best_f:
            print(f"  fwd {r['config']} asm={r['asm']:d} {r['ms']:.3f} ms  {r['ratio']:.2f}x")
        for r in best_b:
            c = r["config"]
            label = f"{c['dkdv']} {c['dq']} at={c['atomic_dq']:d} asm={r['asm']:d}"
            print(f"  bwd {label} {r['ms']:.3f} ms {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
