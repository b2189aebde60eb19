"""Command line: ``python -m attnkit {train,compare,demo,table,...}`` (``attnkit <command> --help`` for options)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Collection
from types import SimpleNamespace
from typing import TYPE_CHECKING

from .registry import MIXER_NAMES, TASK_NAMES

if TYPE_CHECKING:
    from .train import TrainConfig

# command -> (module of attnkit.experiments, help); each module has add_arguments(parser) and run(args) -> int.
# A module is imported only when its command runs or shows its help, so start-up stays light.
EXPERIMENTS = {
    "extrapolate": ("extrapolate", "length extrapolation: perplexity and passkey accuracy against evaluation length"),
    "probe-state": ("probe_state", "state-norm probe of the recurrent mixers (VLA, linear attention, DeltaNet)"),
    "bench": ("bench", "timing of the ops (CPU table; GPU kernel benchmarks)"),
    "eval": ("evaluate", "lm-eval-harness tasks on a run folder or save_pretrained model"),
    "reproduce": ("reproduce", "reproduce a paper's claims (path, tapa, vla, all): cells, verdicts, report.md"),
}


def _table(args: argparse.Namespace) -> int:
    import torch

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


def _train_defaults() -> SimpleNamespace:
    """``TrainConfig``'s defaults, read off the dataclass (an instance would validate, which imports the models)."""
    from .train import TrainConfig

    return SimpleNamespace(
        **{
            f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(TrainConfig)
        }
    )


# Fields whose command-line default depends on the device: on CPU the demo's setting (see config_from_args).
def _cpu_defaults(task: str) -> dict:
    from .experiments.demo import CPU_SETTING

    defaults = {k: CPU_SETTING[k] for k in ("steps", "batch_size", "lr")}
    if task == "flipflop":  # the demo's task
        defaults["task_options"] = {"seq_len": CPU_SETTING["seq_len"]}
    return defaults


def _add_train_arguments(p: argparse.ArgumentParser, single_mixer: bool) -> None:
    """The TrainConfig flags. Their defaults are SUPPRESS, so the namespace holds only the flags given and
    ``config_from_args`` can layer them over ``--config`` and the defaults."""
    d = _train_defaults()
    off = argparse.SUPPRESS

    def add(*flags, help: str, default=None, **kwargs) -> None:
        shown = "" if default is None else f" (default: {default})"
        p.add_argument(*flags, default=off, help=help + shown, **kwargs)

    p.add_argument(
        "--config", default=None, metavar="FILE", help="YAML or JSON file of TrainConfig fields; flags override it"
    )
    add("--task", choices=TASK_NAMES, help="task (attnkit.tasks.TASKS)", default=d.task)
    add(
        "--task-option",
        action="append",
        metavar="KEY=JSON",
        help="extra task constructor option, e.g. --task-option p_ignore=0.8 (repeatable)",
    )
    add("--seq-len", type=int, help="task sequence length (default: the task's; flipflop on CPU: the demo's 64)")
    if single_mixer:
        add("--mixer", nargs="+", choices=MIXER_NAMES, help="mixer, or one per layer", default=d.mixer)
    add("--hidden-size", type=int, help=f"model width (default: --init-from's, else {d.hidden_size})")
    add("--num-layers", type=int, help=f"layers (default: --init-from's, else {d.num_layers})")
    add("--num-heads", type=int, help=f"heads (default: --init-from's, else {d.num_heads})")
    add(
        "--model-option",
        action="append",
        metavar="KEY=JSON",
        help="extra AttnKitConfig keyword, e.g. --model-option backend='\"torch\"' (repeatable)",
    )
    add("--init-from", metavar="PATH", help="start from this saved attnkit model (a run folder, a from_llama save)")
    add("--steps", type=int, help="optimizer steps", default=f"{d.steps}; on CPU: the demo's 600")
    add("--batch-size", type=int, help="global batch size (split over ranks)", default=d.batch_size)
    add("--grad-accum", type=int, help="micro-batches per optimizer step (same global batch)", default=d.grad_accum)
    if single_mixer:
        add("--lr", type=float, help="peak learning rate", default=d.lr)
    add("--weight-decay", type=float, help="AdamW weight decay (matrices only)", default=d.weight_decay)
    add("--warmup-steps", type=int, help="linear warmup steps", default="min(100, steps // 10)")
    add("--min-lr-ratio", type=float, help="final lr / peak lr (cosine)", default=d.min_lr_ratio)
    add("--grad-clip", type=float, help="gradient-norm clip (0: off)", default=d.grad_clip)
    add("--seed", type=int, help="seed of model, data and test sets", default=d.seed)
    add("--device", choices=["auto", "cpu", "cuda"], help="device", default=d.device)
    add("--no-bf16", action="store_true", help="float32 on GPU: no bf16 autocast (nor FSDP2's bf16 parameters)")
    add("--distributed", choices=["ddp", "fsdp"], help="mode under torchrun", default=d.distributed)
    add("--compile", action="store_true", help="torch.compile the model for the training steps")
    add("--cuda-graph", action="store_true", help="on GPU: replay forward+backward as CUDA graphs (small models)")
    add("--grad-checkpointing", action="store_true", help="recompute activations in the backward (less memory)")
    add("--eval-every", type=int, help="evaluate every N steps (0: at the end)", default=d.eval_every)
    add("--eval-batch-size", type=int, help="evaluation chunk size", default=d.eval_batch_size)
    add("--log-every", type=int, help="log every N steps", default=d.log_every)
    add("--checkpoint-every", type=int, help="checkpoint every N steps (0: at the end)", default=d.checkpoint_every)
    add("--tensorboard", action="store_true", help="also log to <out>/tensorboard (needs attnkit[tensorboard])")
    add("--out", help="run folder", default="runs/train")
    add("--resume", action="store_true", help="continue from <out>/checkpoint.pt (it must exist)")
    add("--overwrite", action="store_true", help="move an earlier run in --out aside to <out>.old-<time>, then start")
    add("--stop-at", type=int, help="stop after this step (0: run to --steps)", default=d.stop_at)
    add("--profile", action="store_true", help="print the step-time fraction outside forward+backward")
    add("--quiet", action="store_true", help="no progress lines")


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


def load_config_file(path: str) -> dict:
    """The TrainConfig fields in the YAML or JSON file ``path`` (a mapping of field names to values)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"--config: cannot read {path} ({err.strerror or err})") from None
    import yaml  # pyyaml comes with transformers

    kind = "JSON" if path.endswith(".json") else "YAML"
    try:
        values = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise ValueError(f"--config: {path} is not valid {kind}: {str(err).splitlines()[0]}") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise ValueError(f"--config: {path} must hold a mapping of TrainConfig fields, got {type(values).__name__}")
    from .train import TrainConfig

    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--config: {path} sets {unknown[0]!r}, which is no TrainConfig field; known: {sorted(known)}")
    return values


def _same_name_fields() -> set[str]:
    """Command-line destinations that are TrainConfig fields under the same name."""
    from .train import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} - {"task_options", "model_options", "mixer", "bf16"}


def config_from_args(
    args: argparse.Namespace, mixer=None, lr: float | None = None, out: str | None = None
) -> TrainConfig:
    """The TrainConfig of a ``train`` or ``compare`` run, from four layers, each over the one before:
    TrainConfig's defaults (on CPU the demo's steps, batch size, learning rate and flip-flop length), the
    ``--config`` file, the flags given, and ``mixer``, ``lr``, ``out`` (compare's per-run values).

    With ``init_from``, the model's shape (hidden size, layers, heads, mixer) defaults to the saved model's.
    """
    from .train import TrainConfig
    from .train.distributed import resolve_device

    given = vars(args)
    values = load_config_file(args.config) if args.config else {}
    values.update({k: v for k, v in given.items() if k in _same_name_fields()})
    values.setdefault("out", "runs/train")
    if "mixer" in given:
        values["mixer"] = given["mixer"][0] if len(given["mixer"]) == 1 else given["mixer"]
    if "no_bf16" in given:
        values["bf16"] = False
    task_options = dict(values.get("task_options") or {})
    task_options.update(_options(given.get("task_option", []), "--task-option"))
    if "seq_len" in given:
        task_options["seq_len"] = given["seq_len"]
    model_options = dict(values.get("model_options") or {})
    model_options.update(_options(given.get("model_option", []), "--model-option"))
    values.update(task_options=task_options, model_options=model_options)
    for key, value in (("mixer", mixer), ("lr", lr), ("out", out)):
        if value is not None:
            values[key] = value
    task = values.get("task", TrainConfig.task)
    if resolve_device(values.get("device", TrainConfig.device)) == "cpu":
        for key, value in _cpu_defaults(task).items():
            if key == "task_options":
                values["task_options"] = {**value, **values["task_options"]}
            else:
                values.setdefault(key, value)
    if values.get("init_from"):
        for key, value in _init_from_shape(values).items():
            values.setdefault(key, value)
    return TrainConfig(**values)


def _init_from_shape(values: dict) -> dict:
    """The model shape (hidden size, layers, heads, mixer) of an ``init_from`` run: the saved model's, or for a
    resume the run's own (its ``train_config.json``), so a resume does not need ``init_from`` to exist any more."""
    from .train.hf_folder import read_run_config, saved_model_config

    names = ("hidden_size", "num_layers", "num_heads", "mixer")
    if values.get("resume"):
        run = read_run_config(values["out"])
        return {} if run is None else {k: run[k] for k in names if k in run}
    saved = saved_model_config(values["init_from"])
    return dict(zip(names, (saved.hidden_size, saved.num_hidden_layers, saved.num_heads, saved.mixer)))


def _train(args: argparse.Namespace) -> int:
    from .train import CheckpointError, LaunchError, NonFiniteLossError, RunFolderError, train

    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"attnkit train: {err}", file=sys.stderr)
        return 2
    try:
        result = train(config)
    except (RunFolderError, LaunchError) as err:  # a folder or a torchrun launch that does not fit the run
        print(f"attnkit train: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, NonFiniteLossError) as err:
        print(f"attnkit train: {err}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        _print_run(config, result, args.json)
    return 0


def _print_run(config: TrainConfig, result, as_json: bool) -> None:
    """The run's results table (or final.json) on stdout; the plot of its evaluations beside its files."""
    from .experiments.output import metrics_table, print_results
    from .experiments.plots import plot_runs
    from .train.progress import run_label

    label = run_label(config)
    png = plot_runs({label: config.out}, os.path.join(config.out, "metrics.png"), title=label)
    summary = f"{label}: step {result.step}, loss {result.loss:.4f}, {result.wall_time_s:.1f} s training"
    final = os.path.join(config.out, "final.json")
    print_results(f"{summary}\n{metrics_table(result.metrics)}", final, [final, png], as_json)


def _flat_metrics(metrics: dict[str, dict[str, float]]) -> dict[str, float]:
    return {f"{s}/{k}": v for s, m in metrics.items() for k, v in m.items()}


def _compare_table(rows: list[dict], metrics: list[dict[str, dict[str, float]]]) -> str:
    """A row per run: mixer, lr, final loss, the headline metric per test set (or their mean), training time."""
    from .train.progress import format_metric, headline_values

    heads = [headline_values(m) for m in metrics]
    columns = list(dict.fromkeys(c for _, values in heads for c in values))
    metric = heads[0][0] or ""
    width = max([len(metric), *map(len, columns)])
    lines = [
        f"{metric} on the test sets",
        f"{'mixer':<10} {'lr':>8} {'loss':>8} " + " ".join(f"{c:>{width}}" for c in columns) + f" {'train s':>8}",
    ]
    for row, (name, values) in zip(rows, heads):
        cells = " ".join(f"{format_metric(name, values[c]) if c in values else '-':>{width}}" for c in columns)
        lines.append(f"{row['mixer']:<10} {row['lr']:>8.0e} {row['loss']:>8.4f} {cells} {row['wall_time_s']:>8.1f}")
    return "\n".join(lines)


def _compare(args: argparse.Namespace) -> int:
    from .experiments.output import print_results
    from .experiments.plots import plot_runs
    from .train import CheckpointError, LaunchError, RunFolderError, open_run_folder, train

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
    runs, rows, metrics = {}, [], []
    for (mixer, lr), config in configs.items():
        try:
            result = train(config)
        except LaunchError as err:
            print(f"attnkit compare: {err}", file=sys.stderr)
            return 2
        except CheckpointError as err:
            print(f"attnkit compare: {err}", file=sys.stderr)
            return 1
        runs[f"{mixer} lr={lr:g}"] = config.out
        metrics.append(result.metrics)
        rows.append(
            {
                "mixer": mixer,
                "lr": lr,
                "loss": result.loss,
                "wall_time_s": result.wall_time_s,
                **_flat_metrics(result.metrics),
            }
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "compare.json")
    with open(path, "w") as f:
        json.dump(
            {
                "config": {**dataclasses.asdict(config), "mixer": args.mixers, "lr": args.lrs, "out": args.out},
                "rows": rows,
            },
            f,
            indent=2,
        )
    png = plot_runs(runs, os.path.join(args.out, "compare.png"), title=f"{config.task}: " + ", ".join(runs))
    print_results(_compare_table(rows, metrics), path, [path, png], args.json)
    return 0


def _add_train_command(p: argparse.ArgumentParser) -> None:
    from .experiments.output import add_json_argument

    _add_train_arguments(p, single_mixer=True)
    add_json_argument(p)
    p.set_defaults(func=_train)


def _add_compare_command(p: argparse.ArgumentParser) -> None:
    from .experiments.output import add_json_argument

    p.add_argument("--mixers", nargs="+", default=["path", "rope"], choices=MIXER_NAMES, help="mixers to compare")
    p.add_argument("--lrs", nargs="+", type=float, default=[_train_defaults().lr], help="learning rates to sweep")
    _add_train_arguments(p, single_mixer=False)
    add_json_argument(p)
    p.set_defaults(func=_compare, out="runs/compare")


def _add_demo_command(p: argparse.ArgumentParser) -> None:
    from .experiments import demo

    demo.add_arguments(p)
    p.set_defaults(func=demo.run)


def _add_table_command(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=2, help="batch size B of the timing runs")
    p.add_argument("--seq-len", type=int, default=512, help="sequence length T of the timing runs")
    p.add_argument("--heads", type=int, default=4, help="heads H")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (the median is reported)")
    p.add_argument("--accuracy-t", type=int, default=48, help="sequence length of the accuracy check")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=_table)


def _experiment_adder(module_name: str):
    def add(p: argparse.ArgumentParser) -> None:
        module = importlib.import_module(f".experiments.{module_name}", __package__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)

    return add


# command -> (help, function adding its arguments to its subparser)
COMMANDS = {
    "train": ("train one model on one task", _add_train_command),
    "compare": ("train several mixers (and learning rates); table, JSON and plot", _add_compare_command),
    "demo": ("PaTH vs RoPE on flip-flop against the published numbers (the default)", _add_demo_command),
    "table": ("accuracy and CPU timing table of every mechanism's op", _add_table_command),
    **{name: (help_text, _experiment_adder(module)) for name, (module, help_text) in EXPERIMENTS.items()},
}
DEFAULT_COMMAND = "demo"


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command. Only ``commands`` (default: all) get their arguments, which imports their
    modules; the others are listed by name and help."""
    parser = argparse.ArgumentParser(
        prog="attnkit",
        description=f"Attention beyond RoPE: PaTH, TAPA, VLA. Without a command, runs {DEFAULT_COMMAND!r} "
        f"(its flags work without the command name: attnkit --out DIR).",
    )
    sub = parser.add_subparsers(dest="command")
    for name, (help_text, add_arguments) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if commands is None or name in commands:
            add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = [DEFAULT_COMMAND, *argv]  # the default command, with its own flags
    args = build_parser(argv[:1]).parse_args(argv)
    return args.func(args)
