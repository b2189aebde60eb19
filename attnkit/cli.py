"""Command line: ``python -m attnkit {train,compare,demo,table,...}`` (``attnkit <command> --help`` for options)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from .experiments import bench, extrapolate, probe_state, reproduce
from .models import MIXERS
from .tasks import TASKS
from .train import TrainConfig

# Other experiments register themselves when their module exists: add_arguments(parser) and run(args) -> int.
# command -> (module, help); each module has add_arguments(parser) and run(args)
EXPERIMENTS = {
    "extrapolate": (extrapolate, "length extrapolation: perplexity and passkey accuracy against evaluation length"),
    "probe-state": (probe_state, "state-norm probe of the recurrent mixers (VLA, linear attention, DeltaNet)"),
    "bench": (bench, "timing of the ops (CPU table; GPU kernel benchmarks)"),
    "reproduce": (reproduce, "reproduce a paper's claims (path, tapa, vla, all): cells, verdicts, report.md"),
}


def _table(args: argparse.Namespace) -> int:
    from .cpu_bench import accuracy_rows, format_accuracy, format_timing, timing_rows

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"attnkit table: PyTorch backends on {torch.get_num_threads()} CPU threads, float32")
    print(f"\nAccuracy against the definitional loops (float64), T={args.accuracy_t}:")
    acc = accuracy_rows(T=args.accuracy_t)
    print(format_accuracy(acc))
    print(f"\nTiming, B={args.batch} T={args.seq_len} H={args.heads} D={args.head_dim}, median of {args.repeats}:")
    rows = timing_rows(args.batch, args.seq_len, args.heads, args.head_dim, repeats=args.repeats)
    print(format_timing(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": acc, "timing": rows, "args": vars(args)}, f, indent=2, default=str)
        print(f"\nwrote {args.json}")
    return 0


def _add_train_arguments(p: argparse.ArgumentParser, single_mixer: bool) -> None:
    d = TrainConfig()
    p.add_argument("--task", default=d.task, choices=sorted(TASKS), help="task (attnkit.tasks.TASKS)")
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra task constructor option, e.g. --task-option p_ignore=0.8 (repeatable)",
    )
    p.add_argument("--seq-len", type=int, default=0, help="task sequence length (0: the task's default)")
    if single_mixer:
        p.add_argument("--mixer", nargs="+", default=[d.mixer], choices=MIXERS, help="mixer, or one per layer")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size, help="model width")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help="layers")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="heads")
    p.add_argument(
        "--model-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra AttnKitConfig keyword, e.g. --model-option backend='\"torch\"' (repeatable)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch size (split over ranks)")
    if single_mixer:
        p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices only)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="gradient-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of model, data and test sets")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"], help="device")
    p.add_argument("--no-bf16", action="store_true", help="disable bf16 autocast on GPU")
    p.add_argument("--distributed", default=d.distributed, choices=["ddp", "fsdp"], help="mode under torchrun")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every N steps (0: at the end)")
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size, help="evaluation chunk size")
    p.add_argument("--log-every", type=int, default=d.log_every, help="log every N steps")
    p.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="checkpoint every N steps (0: at the end)"
    )
    p.add_argument("--out", default="runs/train", help="run folder")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt (it must exist)")
    p.add_argument(
        "--overwrite", action="store_true", help="move an earlier run in --out aside to <out>.old-<time>, then start"
    )
    p.add_argument("--stop-at", type=int, default=d.stop_at, help="stop after this step (0: run to --steps)")
    p.add_argument("--profile", action="store_true", help="print the step-time fraction outside forward+backward")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _options(pairs: list[str], name: str) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{name}: expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def config_from_args(args: argparse.Namespace, mixer, lr: float, out: str) -> TrainConfig:
    task_options = _options(args.task_option, "--task-option")
    if args.seq_len:
        task_options["seq_len"] = args.seq_len
    return TrainConfig(
        task=args.task,
        task_options=task_options,
        mixer=mixer,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        model_options=_options(args.model_option, "--model-option"),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=lr,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        grad_clip=args.grad_clip,
        seed=args.seed,
        device=args.device,
        bf16=not args.no_bf16,
        distributed=args.distributed,
        eval_every=args.eval_every,
        eval_batch_size=args.eval_batch_size,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        out=out,
        resume=args.resume,
        overwrite=args.overwrite,
        stop_at=args.stop_at,
        profile=args.profile,
        quiet=args.quiet,
    )


def _train(args: argparse.Namespace) -> int:
    from .train import CheckpointError, NonFiniteLossError, RunFolderError, train

    mixer = args.mixer[0] if len(args.mixer) == 1 else args.mixer
    try:
        config = config_from_args(args, mixer, args.lr, args.out)
    except ValueError as err:
        print(f"attnkit train: {err}", file=sys.stderr)
        return 2
    try:
        result = train(config)
    except RunFolderError as err:
        print(f"attnkit train: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, NonFiniteLossError) as err:
        print(f"attnkit train: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"step": result.step, "loss": result.loss, "metrics": result.metrics}, indent=2))
    return 0


def _flat_metrics(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{s}/{k}": v for s, m in metrics.items() for k, v in m.items()}


def _compare(args: argparse.Namespace) -> int:
    from .experiments.plots import plot_curves
    from .train import CheckpointError, RunFolderError, open_run_folder, train

    # Every run's settings and folder are checked before the first one trains.
    try:
        configs = {
            (mixer, lr): config_from_args(args, mixer, lr, os.path.join(args.out, f"{mixer}_lr{lr:g}"))
            for mixer in args.mixers
            for lr in args.lrs
        }
        for config in configs.values():
            open_run_folder(config, is_main=False)
    except (ValueError, RunFolderError) as err:
        print(f"attnkit compare: {err}", file=sys.stderr)
        return 2
    runs, rows = {}, []
    for (mixer, lr), config in configs.items():
        try:
            result = train(config)
        except CheckpointError as err:
            print(f"attnkit compare: {err}", file=sys.stderr)
            return 1
        runs[f"{mixer} lr={lr:g}"] = config.out
        rows.append(
            {
                "mixer": mixer,
                "lr": lr,
                "loss": result.loss,
                "wall_time_s": result.wall_time_s,
                **_flat_metrics(result.metrics),
            }
        )
    keys = [k for k in rows[0] if k not in ("mixer", "lr", "loss", "wall_time_s")]
    print(f"{'mixer':<10} {'lr':>8} {'loss':>8} " + " ".join(f"{k:>28}" for k in keys) + f" {'train s':>8}")
    for r in rows:
        cells = " ".join(f"{r[k]:>28.4f}" for k in keys)
        print(f"{r['mixer']:<10} {r['lr']:>8.0e} {r['loss']:>8.4f} {cells} {r['wall_time_s']:>8.1f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(
            {
                "config": {**dataclasses.asdict(config), "mixer": args.mixers, "lr": args.lrs, "out": args.out},
                "rows": rows,
            },
            f,
            indent=2,
        )
    png = plot_curves(runs, os.path.join(args.out, "compare.png"))
    print(f"wrote {os.path.join(args.out, 'compare.json')}" + (f" and {png}" if png else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention beyond RoPE: PaTH, TAPA, VLA.")
    sub = parser.add_subparsers(dest="command")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser("train", help="train one model on one task", formatter_class=fmt)
    _add_train_arguments(p, single_mixer=True)
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "compare", help="train several mixers (and learning rates); table, JSON and plot", formatter_class=fmt
    )
    p.add_argument("--mixers", nargs="+", default=["path", "rope"], choices=MIXERS, help="mixers to compare")
    p.add_argument("--lrs", nargs="+", type=float, default=[TrainConfig().lr], help="learning rates to sweep")
    _add_train_arguments(p, single_mixer=False)
    p.set_defaults(func=_compare, out="runs/compare")

    from .experiments import demo

    p = sub.add_parser(
        "demo", help="PaTH vs RoPE on flip-flop against the published numbers (the default)", formatter_class=fmt
    )
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)

    p = sub.add_parser("table", help="accuracy and CPU timing table of every mechanism's op", formatter_class=fmt)
    p.add_argument("--batch", type=int, default=2, help="batch size B of the timing runs")
    p.add_argument("--seq-len", type=int, default=512, help="sequence length T of the timing runs")
    p.add_argument("--heads", type=int, default=4, help="heads H")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (the median is reported)")
    p.add_argument("--accuracy-t", type=int, default=48, help="sequence length of the accuracy check")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=_table)

    for name, (module, help_text) in EXPERIMENTS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=fmt)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo", *argv])
    return args.func(args)
