"""Length extrapolation of a trained model: perplexity, passkey exact match or a task's metric against length.

    python -m attnkit extrapolate RUN                      # a run folder of `attnkit train --out RUN`
    python -m attnkit extrapolate CHECKPOINT --task lm --lengths 512 1024 2048 4096 8192 [--sliding-stride 256]
    python -m attnkit extrapolate CHECKPOINT --task passkey --lengths 512 1024 2048 4096 8192

``CHECKPOINT`` is a folder written by ``save_pretrained`` (loaded with ``AutoModelForCausalLM``). A run folder is
one too, and it also knows how it was trained: its task, task options (corpus, tokeniser) and training length
are the defaults, and the lengths default to 1, 2, 4, 8 and 16 times the training length. The data are the fixed
test sets of the tasks in ``attnkit.tasks``:

- ``lm``: ``LanguageModeling`` with ``seq_len = train_len`` and ``eval_multipliers = length / train_len``, so
  every length is scored on the same held-out span, in non-overlapping windows (``len{W}``) and, with
  ``sliding_stride``, in sliding windows (``sliding{W}``). Corpus and tokeniser must be the training ones (a BPE
  run's tokeniser is read from its folder).
- ``passkey``: ``Passkey`` with ``test_lengths = lengths``: exact match per (length, depth) cell.
- any other task with a ``seq_len`` option (flip-flop, MQAR, MQRAR): its test sets rebuilt at every length.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from attnkit.tasks import TASKS, LanguageModeling, Passkey, Task, get_task
from attnkit.tasks.passkey import grid
from attnkit.train.hf_folder import read_run_config

from .output import write_json

TASK_NAMES = tuple(name for name, cls in TASKS.items() if "seq_len" in inspect.signature(cls).parameters)
MULTIPLIERS = (1, 2, 4, 8, 16)
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192)
# Options of a run's task that the extrapolation sets itself.
_LENGTH_OPTIONS = ("seq_len", "eval_multipliers", "test_lengths")


def load_model(model: str | Path | PreTrainedModel, device: str = "cpu") -> PreTrainedModel:
    """A model given as itself or as a ``save_pretrained`` folder, on ``device``, in eval mode."""
    if not isinstance(model, PreTrainedModel):
        from transformers import AutoModelForCausalLM

        import attnkit.models  # noqa: F401  (registers "attnkit" with the Auto classes)

        model = AutoModelForCausalLM.from_pretrained(str(model))
    return model.to(device).eval()


def run_defaults(folder: str | Path) -> dict[str, Any]:
    """``{"task", "train_len", "task_options"}`` of the run whose folder is ``folder`` (empty for a plain
    ``save_pretrained`` folder): what ``extrapolate`` assumes unless told otherwise."""
    run = read_run_config(folder)
    if run is None:
        return {}
    options = {k: v for k, v in run["task_options"].items() if k not in _LENGTH_OPTIONS}
    if run["task"] == "lm" and options.get("tokenizer") == "bpe":
        options["bpe_path"] = os.path.join(folder, "tokenizer.json")  # the run's own BPE
    train_len = run["task_options"].get("seq_len", inspect.signature(TASKS[run["task"]]).parameters["seq_len"].default)
    return {"task": run["task"], "train_len": train_len, "task_options": options}


def build_task(task: str, lengths: Sequence[int], train_len: int, seed: int = 0, **options) -> Task:
    """The test-set task for ``task`` ("lm" or "passkey") at evaluation ``lengths`` (multiples of ``train_len``
    for "lm"); ``options`` go to the task's constructor. Other tasks are built once per length (``seq_len``)."""
    if task == "lm":
        bad = [L for L in lengths if L % train_len]
        if bad:
            raise ValueError(
                f"lengths: {bad} are not multiples of train_len={train_len} (lm windows are m · train_len)"
            )
        return LanguageModeling(
            seed=seed, seq_len=train_len, eval_multipliers=tuple(L // train_len for L in lengths), **options
        )
    if task == "passkey":
        return Passkey(seed=seed, seq_len=train_len, test_lengths=tuple(lengths), **options)
    raise ValueError(f"task: expected one of {TASK_NAMES}, got {task!r}")


def _length_results(task: str, lengths: Sequence[int], seed: int, batch_size: int, logits_fn, vocab: int, options):
    """A task without its own extrapolation sets: every test set rebuilt at every length."""
    rows = []
    for length in lengths:
        spec = get_task(task, seed=seed, **{**options, "seq_len": length})
        if vocab < spec.vocab_size:
            raise ValueError(f"model: vocabulary of {vocab} tokens, the {task} task needs {spec.vocab_size}")
        for set_name, metrics in spec.evaluate_model(logits_fn, batch_size=batch_size).items():
            rows.append({"set": f"L{length}_{set_name}", "length": length, "test_set": set_name, **metrics})
    return rows


@torch.no_grad()
def extrapolate(
    model: str | Path | PreTrainedModel,
    task: str | None = None,
    lengths: Sequence[int] | None = None,
    train_len: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    seed: int = 0,
    **task_options,
) -> dict:
    """Evaluate ``model`` (a model, a ``save_pretrained`` folder or a run folder) on ``task``'s test sets at
    every length.

    Args:
        task: one of ``TASK_NAMES`` (default: a run folder's task, else "lm").
        lengths: evaluation lengths (default: ``MULTIPLIERS`` times ``train_len`` when that is known, else
            ``DEFAULT_LENGTHS``).
        train_len: the training length (default: a run folder's, else the shortest of ``lengths``).
        task_options: constructor keywords of the task, e.g. ``corpus``, ``tokenizer``, ``bpe_path``,
            ``eval_tokens``, ``sliding_stride`` (lm) or ``num_keys``, ``test_size``, ``haystack`` (passkey); a run
            folder's task options are the defaults (when ``task`` is the run's).

    Returns:
        ``{"task", "train_len", "lengths", "rows"}``; lm rows ``{"set", "length", "window", "loss", "perplexity",
        "accuracy"}`` (``window``: "non-overlapping" or "sliding"), passkey rows ``{"set", "length", "depth",
        "exact_match", "digit_accuracy"}``, other tasks' rows ``{"set", "length", "test_set", <its metrics>}``.
    """
    run = {} if isinstance(model, PreTrainedModel) else run_defaults(model)
    if run and task in (None, run["task"]):
        task, task_options = run["task"], {**run["task_options"], **task_options}
        train_len = run["train_len"] if train_len is None else train_len
    task = task or "lm"
    if lengths is None:
        lengths = [m * int(train_len) for m in MULTIPLIERS] if train_len is not None else DEFAULT_LENGTHS
    lengths = sorted(set(int(L) for L in lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths: expected positive integers, got {lengths}")
    train_len = lengths[0] if train_len is None else int(train_len)
    if task not in TASK_NAMES:
        raise ValueError(f"task: expected one of {TASK_NAMES}, got {task!r}")
    model = load_model(model, device)

    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids.to(device), use_cache=False).logits

    if task not in ("lm", "passkey"):
        rows = _length_results(task, lengths, seed, batch_size, logits_fn, model.config.vocab_size, task_options)
        return {"task": task, "train_len": train_len, "lengths": lengths, "rows": rows}
    spec = build_task(task, lengths, train_len, seed, **task_options)
    if model.config.vocab_size < spec.vocab_size:
        raise ValueError(
            f"model: vocabulary of {model.config.vocab_size} tokens, the {task} task needs {spec.vocab_size}"
        )
    results = spec.evaluate_model(logits_fn, batch_size=batch_size)
    rows = []
    for set_name, metrics in results.items():
        if task == "lm":
            window = "sliding" if set_name.startswith("sliding") else "non-overlapping"
            length = int(set_name.removeprefix("sliding").removeprefix("len"))
            rows.append({"set": set_name, "length": length, "window": window, **metrics})
        else:
            length, depth = set_name[1:].split("_d")
            rows.append({"set": set_name, "length": int(length), "depth": float(depth), **metrics})
    return {"task": task, "train_len": train_len, "lengths": lengths, "rows": rows}


def _metric_names(rows: list[dict]) -> list[str]:
    return [k for k in rows[0] if k not in ("set", "length", "test_set")] if rows else []


def format_results(results: dict) -> str:
    """lm: perplexity per length and window kind; passkey: the length × depth grid of exact match; other tasks:
    every metric per length and test set."""
    rows = results["rows"]
    if results["task"] not in ("lm", "passkey"):
        names = _metric_names(rows)
        lines = [f"{'length':>8} {'× train':>8} {'test set':>16} " + " ".join(f"{n:>16}" for n in names)]
        for r in rows:
            cells = " ".join(f"{r[n]:>16.4f}" for n in names)
            lines.append(f"{r['length']:>8} {r['length'] / results['train_len']:>8.3g} {r['test_set']:>16} {cells}")
        return "\n".join(lines)
    if results["task"] == "lm":
        lines = [f"{'length':>8} {'× train':>8} {'window':>16} {'loss':>8} {'perplexity':>11} {'accuracy':>9}"]
        for r in sorted(rows, key=lambda r: (r["window"], r["length"])):
            lines.append(
                f"{r['length']:>8} {r['length'] / results['train_len']:>8.3g} {r['window']:>16} "
                f"{r['loss']:>8.4f} {r['perplexity']:>11.3f} {r['accuracy']:>9.3f}"
            )
        return "\n".join(lines)
    table = grid({r["set"]: r for r in rows})
    depths = sorted({d for cells in table.values() for d in cells})
    lines = ["exact match, length × needle depth"]
    lines.append(f"{'length':>8}" + "".join(f"{d:>6.1f}" for d in depths) + f"{'mean':>7}")
    for length in sorted(table):
        cells = table[length]
        lines.append(
            f"{length:>8}" + "".join(f"{cells[d]:>6.2f}" for d in depths) + f"{sum(cells.values()) / len(cells):>7.2f}"
        )
    return "\n".join(lines)


def plot_results(results: dict, path: str) -> None:
    """lm: perplexity against length (log-log); passkey: the exact-match heat map. A PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    if results["task"] not in ("lm", "passkey"):
        metric = _metric_names(rows)[0]
        for set_name in dict.fromkeys(r["test_set"] for r in rows):
            mine = [r for r in rows if r["test_set"] == set_name]
            ax.plot([r["length"] for r in mine], [r[metric] for r in mine], marker="o", label=set_name)
        ax.axvline(results["train_len"], color="grey", linestyle=":", label="train length")
        ax.set(xscale="log", xlabel="evaluation length (tokens)", ylabel=metric, title=results["task"])
        ax.legend()
    elif results["task"] == "lm":
        for window in dict.fromkeys(r["window"] for r in rows):
            mine = sorted((r for r in rows if r["window"] == window), key=lambda r: r["length"])
            ax.plot([r["length"] for r in mine], [r["perplexity"] for r in mine], marker="o", label=window)
        ax.axvline(results["train_len"], color="grey", linestyle=":", label="train length")
        ax.set(xscale="log", yscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity")
        ax.legend()
    else:
        table = grid({r["set"]: r for r in rows})
        lengths = sorted(table)
        depths = sorted({d for cells in table.values() for d in cells})
        image = ax.imshow(
            [[table[L][d] for d in depths] for L in lengths], vmin=0, vmax=1, aspect="auto", cmap="viridis"
        )
        ax.set_xticks(range(len(depths)), [f"{d:.1f}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(L) for L in lengths])
        ax.set(xlabel="needle depth", ylabel="length (tokens)", title="passkey exact match")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a run folder (attnkit train --out), or a folder written by save_pretrained")
    parser.add_argument(
        "--task",
        choices=TASK_NAMES,
        default=None,
        help="lm: perplexity; passkey: exact match (default: the run's, or lm)",
    )
    parser.add_argument(
        "--lengths",
        nargs="+",
        type=int,
        default=None,
        help=f"evaluation lengths (default: {', '.join(map(str, MULTIPLIERS))} x the training length, or "
        f"{' '.join(map(str, DEFAULT_LENGTHS))})",
    )
    parser.add_argument(
        "--train-len", type=int, default=None, help="training length (default: the run's, or the shortest length)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--device", default="cpu", help="torch device of the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task's test sets")
    lm = parser.add_argument_group("lm task")
    # Task options default to None: the run's value, else the task's own default.
    lm.add_argument("--corpus", default=None, help="corpus spec of attnkit.tasks.corpus.load_corpus (default)")
    lm.add_argument("--tokenizer", choices=("byte", "bpe"), default=None, help="tokeniser used in training (byte)")
    lm.add_argument("--bpe-path", default=None, help="the training run's BPE file (with --tokenizer bpe)")
    lm.add_argument("--eval-tokens", type=int, default=None, help="held-out tokens scored at every length (32768)")
    lm.add_argument(
        "--sliding-stride", type=int, default=None, help="also score sliding windows with this stride (e.g. 256)"
    )
    pk = parser.add_argument_group("passkey task")
    pk.add_argument("--num-keys", type=int, default=None, help="key names of the passkey vocabulary (64)")
    pk.add_argument("--test-size", type=int, default=None, help="sequences per length × depth cell (16)")
    pk.add_argument("--haystack", choices=("noise", "text"), default=None, help="filler of the haystack (noise)")
    parser.add_argument("--plot", default=None, help="write a PNG plot to this path")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")


def task_options(args: argparse.Namespace) -> dict:
    """The constructor keywords given on the command line for the lm or passkey task (the others have none)."""
    names = {
        "lm": ("corpus", "tokenizer", "bpe_path", "eval_tokens", "sliding_stride"),
        "passkey": ("num_keys", "test_size", "haystack"),
    }
    task = args.task or run_defaults(args.model).get("task", "lm")
    return {k: getattr(args, k) for k in names.get(task, ()) if getattr(args, k) is not None}


def run(args: argparse.Namespace) -> int:
    results = extrapolate(
        args.model,
        task=args.task,
        lengths=args.lengths,
        train_len=args.train_len,
        batch_size=args.batch_size,
        device=args.device,
        seed=args.seed,
        **task_options(args),
    )
    print(f"{args.model}: {results['task']}, trained at {results['train_len']}")
    print(format_results(results))
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        write_json(args.out, {"args": vars(args), **results})
    if results["task"] == "lm" and not all(math.isfinite(r["perplexity"]) for r in results["rows"]):
        print("warning: non-finite perplexity at some length")
    return 0
