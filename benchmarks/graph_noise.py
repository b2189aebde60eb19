"""Graphed training steps against eager ones, next to eager against eager: where the two differ, and why.

For each mixer, four 8-step runs of the GPU test's MQAR cell (``tests/train/test_cuda_graph.py``, bf16): eager, eager
again, graphed (``cuda_graph``), and eager with autocast's cache of cast weights off, as the graphed step has it. Per
parameter it prints the largest difference from the first eager run of the second and of the graphed run (each with
the count of elements past the test's tolerance, rtol 2e-2 and atol 2e-3), then of the cache-off eager run, and the
largest difference between the cache-off eager run and the graphed one."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnkit.train import TrainConfig, train  # noqa: E402

DEVICE = "cuda"
AUTOCAST = torch.autocast


def _autocast_without_cache(*args, **kwargs):
    return AUTOCAST(*args, **{**kwargs, "cache_enabled": False})


def run(folder: Path, name: str, mixer: str, cache: bool = True, **graph) -> tuple[dict, list[float]]:
    config = TrainConfig(
        task="mqar_vla", task_options={"num_kv_pairs": 4, "test_size": 64, "validation_size": 32}, mixer=mixer,
        hidden_size=64, num_layers=2, num_heads=4, steps=8, batch_size=32, lr=3e-3, device=DEVICE, bf16=True,
        warmup_steps=2, log_every=1, out=str(folder / name), quiet=True, **graph,
    )  # fmt: skip
    torch.autocast = AUTOCAST if cache else _autocast_without_cache
    try:
        result = train(config)
    finally:
        torch.autocast = AUTOCAST
    with open(folder / name / "metrics.jsonl") as f:
        losses = [e["loss"] for e in map(json.loads, f) if e["event"] == "train"]
    return {k: v.detach().float().cpu() for k, v in result.model.state_dict().items()}, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mixers", nargs="+")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    report = {}
    for mixer in args.mixers:
        with tempfile.TemporaryDirectory() as d:
            folder = Path(d)
            runs = {
                "eager": run(folder, "eager", mixer),
                "eager2": run(folder, "eager2", mixer),
                "graphed": run(folder, "graphed", mixer, cuda_graph=True),
                "nocache": run(folder, "nocache", mixer, cache=False),
            }
        a, g, c = runs["eager"][0], runs["graphed"][0], runs["nocache"][0]
        rows = {}
        for k, v in a.items():
            tol = 2e-3 + 2e-2 * v.abs()
            row = {"shape": list(v.shape)}
            for name in ("eager2", "graphed", "nocache"):
                diff = (runs[name][0][k] - v).abs()
                row[f"{name}_max"], row[f"{name}_over"] = diff.max().item(), int((diff > tol).sum())
            row["nocache_graphed_max"] = (c[k] - g[k]).abs().max().item()
            rows[k] = row
        report[mixer] = {"params": rows, "losses": {name: r[1] for name, r in runs.items()}}
        print(f"== {mixer}: last loss " + ", ".join(f"{name} {r[1][-1]:.6f}" for name, r in runs.items()))
        heads = ("eager2 (over)", "graphed (over)", "nocache (over)", "nocache-graphed")
        print(f"   {'parameter':<40}" + "".join(f"{h:>16}" for h in heads))
        for k, r in rows.items():
            cells = "".join(f"{r[f'{n}_max']:>10.2e} ({r[f'{n}_over']:>2})" for n in ("eager2", "graphed", "nocache"))
            print(f"   {k:<40}{cells}{r['nocache_graphed_max']:>16.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
