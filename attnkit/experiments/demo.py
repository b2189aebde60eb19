"""The README's demo: PaTH against RoPE on flip-flop (PaTH Table 1), next to the published error rates.

On a GPU it runs the paper's setting (T = 512); on a CPU a shorter sequence (the table says which) so it
finishes in minutes on two cores. It evaluates five times during training, and ``demo.png`` plots the read error
of every test set against step beside the published error (dashed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..registry import MIXER_NAMES
from .output import add_json_argument, print_results

# Published error, percent (PaTH paper, Table 1): in-distribution / sparse / dense.
PUBLISHED = {"rope": (6.9, 40.3, 0.01), "fox": (8.3, 36.3, 0.0), "path": (0.0, 0.0001, 0.0)}
SETS = ("in_distribution", "sparse", "dense")

CPU_SETTING = {"seq_len": 64, "steps": 600, "batch_size": 32, "lr": 3e-3, "test": (256, 1024, 256)}
GPU_SETTING = {"seq_len": 512, "steps": 5000, "batch_size": 64, "lr": 3e-3, "test": (2048, 8192, 2048)}
TINY_SETTING = {"seq_len": 16, "steps": 3, "batch_size": 4, "lr": 3e-3, "test": (8, 8, 8)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixers", nargs="+", default=["path", "rope"], choices=MIXER_NAMES, help="mixers to train")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (the setting follows the device)")
    parser.add_argument("--seq-len", type=int, default=0, help="override the sequence length (0: the setting's)")
    parser.add_argument("--steps", type=int, default=0, help="override the training steps (0: the setting's)")
    parser.add_argument("--batch-size", type=int, default=0, help="override the batch size (0: the setting's)")
    parser.add_argument("--lr", type=float, default=0.0, help="override the learning rate (0: the setting's)")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (paper: 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, data and test sets")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    parser.add_argument("--out", default="runs/demo", help="run folder: per-mixer runs, demo.json, demo.png")
    parser.add_argument("--overwrite", action="store_true", help="move earlier per-mixer runs in --out aside")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or lines")
    add_json_argument(parser)


def format_table(rows: list[dict], seq_len: int) -> str:
    head = f"flip-flop, 1 layer, 2 heads, T={seq_len} (paper: T=512); read error %, ours (published)"
    lines = [head, f"{'mixer':<8} {'in-dist':>18} {'sparse':>18} {'dense':>18} {'train s':>8}"]
    for row in rows:
        pub = PUBLISHED.get(row["mixer"], (float("nan"),) * 3)
        cells = [f"{100 * row['error'][s]:.2f} ({p:g})" for s, p in zip(SETS, pub)]
        lines.append(f"{row['mixer']:<8} " + " ".join(f"{c:>18}" for c in cells) + f" {row['wall_time_s']:>8.1f}")
    return "\n".join(lines)


def plot_title(setting: dict) -> str:
    return f"Flip-flop, ours (T={setting['seq_len']}, {setting['steps']} steps) against PaTH Table 1 (T=512)"


def published_fractions(mixers: list[str]) -> dict[str, dict[str, float]]:
    """``PUBLISHED`` of ``mixers`` as ``{mixer: {test set: error as a fraction}}`` (what the plot draws)."""
    return {m: {s: p / 100 for s, p in zip(SETS, PUBLISHED[m])} for m in mixers if m in PUBLISHED}


def run(args: argparse.Namespace) -> int:
    import torch

    from ..train import TrainConfig, open_run_folder, train
    from ..train.distributed import resolve_device
    from .plots import plot_runs

    device = resolve_device(args.device)
    setting = dict(TINY_SETTING if args.tiny else GPU_SETTING if device == "cuda" else CPU_SETTING)
    for key in ("seq_len", "steps", "batch_size", "lr"):
        if getattr(args, key):
            setting[key] = getattr(args, key)
    test_sizes = dict(zip(SETS, setting["test"]))
    t0 = time.perf_counter()
    try:  # every run's settings and folder are checked before the first one trains
        configs = [
            TrainConfig(
                task="flipflop",
                task_options={"seq_len": setting["seq_len"], "test_sizes": test_sizes},
                mixer=mixer,
                hidden_size=args.hidden_size,
                num_layers=1,
                num_heads=2,
                steps=setting["steps"],
                batch_size=setting["batch_size"],
                lr=setting["lr"],
                warmup_steps=max(setting["steps"] // 10, 1),
                log_every=max(setting["steps"] // 20, 1),
                eval_every=max(setting["steps"] // 5, 1),
                seed=args.seed,
                device=device,
                out=os.path.join(args.out, mixer),
                overwrite=args.overwrite,
                quiet=args.quiet,
            )
            for mixer in args.mixers
        ]
        for config in configs:
            open_run_folder(config, is_main=False)
    except ValueError as err:  # a RunFolderError too
        print(f"attnkit demo: {err}", file=sys.stderr)
        return 2
    rows = []
    for mixer, config in zip(args.mixers, configs):
        result = train(config)
        rows.append(
            {
                "mixer": mixer,
                "error": {s: result.metrics[s]["read_error"] for s in SETS},
                "sequence_error": {s: result.metrics[s]["sequence_error"] for s in SETS},
                "final_loss": result.loss,
                "wall_time_s": result.wall_time_s,
            }
        )
    wall = time.perf_counter() - t0
    table = format_table(rows, setting["seq_len"])
    table += f"\ntotal wall time {wall:.1f} s on {device} ({torch.get_num_threads()} threads)"
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "demo.json")
    with open(path, "w") as f:
        json.dump({"setting": setting, "rows": rows, "published_percent": PUBLISHED, "wall_time_s": wall}, f, indent=2)
    png = plot_runs(
        {m: os.path.join(args.out, m) for m in args.mixers},
        os.path.join(args.out, "demo.png"),
        title=plot_title(setting),
        published=published_fractions(args.mixers),
        published_note="published, T=512",
    )
    print_results(table, path, [path, png], args.json)
    return 0
