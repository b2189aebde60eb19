"""Decode-step latency on a GPU: one new token against a cache of L slots, each fused step against an SDPA
decode step (flash backend) over the same cache (SPEC §8: a PaTH step over a 32k cache ≤ 2× SDPA's).

    python benchmarks/decode.py [--cache-lens 1024 4096 16384 32768] [--batch 8] [--heads 16] [--head-dim 64]
                                [--out DIR] [--name decode]

bf16, ``triton.testing.do_bench`` medians. Steps timed: ``sdpa`` (the baseline), ``path_fused``
(``path_decode_step_``: carry every cached key in place and read the softmax in one pass), ``path_torch``
(``path_decode_step``: the rank-one update, concatenation and SDPA), ``path_copy`` (``path_decode_step`` on the
Triton backend, what the layers run: the caches copied one slot longer, then the fused step), ``tapa_triton``
(``tapa_decode_step`` on the Triton backend). The in-place PaTH step changes its cache, so it runs on its own
copy (the timing keeps carrying the same keys: same work each call). Writes ``NAME.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.path import path_decode_step, path_decode_step_  # noqa: E402
from attnkit.ops.tapa import tapa_decode_step  # noqa: E402
from benchmarks.ops import environment  # noqa: E402


def steps(
    B: int, L: int, H: int, D: int, device: torch.device, dt: torch.dtype = torch.bfloat16
) -> dict[str, Callable[[], object]]:
    """The decode steps of one cache length, each a closure over its own inputs."""
    q = torch.randn(B, 1, H, D, device=device, dtype=dt)
    k_new, v_new = torch.randn(B, 1, H, D, device=device, dtype=dt), torch.randn(B, 1, H, D, device=device, dtype=dt)
    w = F.normalize(torch.randn(B, 1, H, D, device=device), dim=-1).to(dt)
    beta = (1.5 + 0.5 * torch.rand(B, 1, H, device=device)).to(dt)
    k_cache = torch.randn(B, L, H, D, device=device, dtype=dt) * D**-0.5
    v_cache = torch.randn(B, L, H, D, device=device, dtype=dt)
    k_buf = torch.cat([k_cache, torch.zeros_like(k_cache[:, :1])], 1)
    v_buf = torch.cat([v_cache, torch.zeros_like(v_cache[:, :1])], 1)
    qt, kt, vt = q.transpose(1, 2), k_buf.transpose(1, 2), v_buf.transpose(1, 2)
    positions = torch.arange(L + 1, device=device).expand(B, L + 1)
    mask = torch.ones(B, L + 1, dtype=torch.bool, device=device)

    def sdpa() -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    return {
        "sdpa": sdpa,
        "path_fused": lambda: path_decode_step_(q, k_new, v_new, w, beta, k_buf, v_buf, L, backend="triton"),
        "path_torch": lambda: path_decode_step(q, k_new, v_new, w, beta, k_cache, v_cache, backend="torch"),
        "path_copy": lambda: path_decode_step(q, k_new, v_new, w, beta, k_cache, v_cache, backend="triton"),
        "tapa_triton": lambda: tapa_decode_step(q, k_buf, v_buf, positions[:, -1], positions, mask, backend="triton"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-lens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="decode")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode.py needs a CUDA device")
    import triton

    device = torch.device("cuda")
    rows = []
    for L in args.cache_lens:
        for name, fn in steps(args.batch, L, args.heads, args.head_dim, device).items():
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                error = None
            except Exception as e:  # noqa: BLE001 — a failing step is a row, not a crash
                ms, error = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(dict(step=name, L=L, B=args.batch, H=args.heads, D=args.head_dim, ms=ms, error=error))
        torch.cuda.empty_cache()
    for row in rows:
        base = next(r["ms"] for r in rows if r["L"] == row["L"] and r["step"] == "sdpa")
        row["ratio_to_sdpa"] = row["ms"] / base
    payload = {"environment": environment(device), "args": vars(args), "rows": rows}
    write_json(str(Path(args.out) / f"{args.name}.json"), payload)
    print(f"decode step, B={args.batch} H={args.heads} D={args.head_dim} bf16: ms (x SDPA)")
    names = list(dict.fromkeys(r["step"] for r in rows))
    print("      L " + "".join(f"{n:>22}" for n in names))
    for L in args.cache_lens:
        cells = {r["step"]: r for r in rows if r["L"] == L}
        print(f"{L:7d} " + "".join(f"{cells[n]['ms']:>13.4f} ({cells[n]['ratio_to_sdpa']:4.2f}x)" for n in names))


if __name__ == "__main__":
    main()
