"""Learning-curve plots from run folders' ``metrics.jsonl`` (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os
import sys


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(runs: dict[str, str], path: str) -> str | None:
    """Training loss against step for every ``{label: run folder}``; returns ``path``, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; skipped the plot", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, run_dir in runs.items():
        events = [e for e in read_metrics(run_dir) if e["event"] == "train"]
        ax.plot([e["step"] for e in events], [e["loss"] for e in events], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
