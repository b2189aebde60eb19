"""Compare distributed runs with the single-process run of the same mixer (issue 21).

Reads ``OUT/<mixer>-{single,ddp,fsdp}/metrics.jsonl`` (the trainer's log, one ``train`` event a step) and writes
``OUT/multi_gpu.json`` and ``OUT/multi_gpu.md``: per mixer and mode, the largest relative loss difference from
the single run over the logged steps (bar ≤ 1e-2), the median tokens/s after the first steps (compilation and
autotuning) and its ratio to the single run's (bar ≥ 1.8 on two GPUs), each run's precision (from its
``final.json``: FSDP2 runs in bf16 name their MixedPrecisionPolicy), with the machine, torch, NCCL and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

MODES = ("ddp", "fsdp")
WARMUP_STEPS = 5


def train_events(run: Path) -> dict[int, dict]:
    events = {}
    with open(run / "metrics.jsonl") as f:
        for line in f:
            event = json.loads(line)
            if event.get("event") == "train":
                events[event["step"]] = event
    return events


def precision(run: Path) -> str | None:
    """The arithmetic the trainer ran ``run`` in (``final.json``'s ``precision``), or None when it did not say."""
    final = run / "final.json"
    return json.loads(final.read_text()).get("precision") if final.exists() else None


def compare(single: dict[int, dict], other: dict[int, dict]) -> dict:
    steps = sorted(set(single) & set(other))
    if not steps:
        raise ValueError("the runs share no logged step")
    rel = [abs(other[s]["loss"] - single[s]["loss"]) / max(abs(single[s]["loss"]), 1e-12) for s in steps]
    late = [s for s in steps if s > WARMUP_STEPS] or steps
    tps = statistics.median(other[s]["tokens_per_s"] for s in late)
    tps_single = statistics.median(single[s]["tokens_per_s"] for s in late)
    return {
        "steps": len(steps),
        "max_rel_loss_diff": max(rel),
        "worst_step": steps[rel.index(max(rel))],
        "tokens_per_s": tps,
        "tokens_per_s_single": tps_single,
        "speedup": tps / tps_single,
    }


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = {"torch": torch.__version__, "commit": commit or None}
    if torch.cuda.is_available():
        info["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def report(out: Path, world_size: int) -> dict:
    rows = []
    for single_dir in sorted(out.glob("*-single")):
        mixer = single_dir.name.removesuffix("-single")
        single = train_events(single_dir)
        for mode in MODES:
            run = out / f"{mixer}-{mode}"
            if (run / "metrics.jsonl").exists():
                row = {"mixer": mixer, "mode": mode, **compare(single, train_events(run))}
                rows.append({**row, "precision": precision(run), "precision_single": precision(single_dir)})
    result = {"world_size": world_size, "machine": machine(), "rows": rows}
    (out / "multi_gpu.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"world size {world_size}; {result['machine']}",
        "",
        "| mixer | mode | steps | max rel. loss diff (≤ 1e-2) | tokens/s | × one process (≥ 1.8) | precision |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mixer']} | {r['mode']} | {r['steps']} | {r['max_rel_loss_diff']:.2e} (step {r['worst_step']}) "
            f"| {r['tokens_per_s']:,.0f} | {r['speedup']:.2f} | {r['precision'] or '?'} |"
        )
    (out / "multi_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder benchmarks/multi_gpu.sh wrote")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    if not any(args.out.glob("*-single")):
        print(f"{args.out}: no <mixer>-single run to compare with", file=sys.stderr)
        return 1
    report(args.out, args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
