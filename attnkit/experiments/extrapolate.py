"""Length extrapolation of a trained checkpoint: perplexity, or passkey exact match, against evaluation length.

    python -m attnkit extrapolate CHECKPOINT --task lm --lengths 512 1024 2048 4096 8192 [--sliding-stride 256]
    python -m attnkit extrapolate CHECKPOINT --task passkey --lengths 512 1024 2048 4096 8192

``CHECKPOINT`` is a folder written by ``save_pretrained`` (loaded with ``AutoModelForCausalLM``). The data are the
fixed test sets of the tasks in ``attnkit.tasks``:

- ``lm``: ``LanguageModeling`` with ``seq_len = train_len`` and ``eval_multipliers = length / train_len``, so
  every length is scored on the same held-out span, in non-overlapping windows (``len{W}``) and, with
  ``sliding_stride``, in sliding windows (``sliding{W}``). Corpus and tokeniser must be the training ones.
- ``passkey``: ``Passkey`` with ``test_lengths = lengths``: exact match per (length, depth) cell.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from attnkit.tasks import LanguageModeling, Passkey, Task
from attnkit.tasks.passkey import grid

from .output import write_json

TASK_NAMES = ("lm", "passkey")


def load_model(model: str | Path | PreTrainedModel, device: str = "cpu") -> PreTrainedModel:
    """A model given as itself or as a ``save_pretrained`` folder, on ``device``, in eval mode."""
    if not isinstance(model, PreTrainedModel):
        from transformers import AutoModelForCausalLM

        import attnkit.models  # noqa: F401  (registers "attnkit" with the Auto classes)

        model = AutoModelForCausalLM.from_pretrained(str(model))
    return model.to(device).eval()


def build_task(task: str, lengths: Sequence[int], train_len: int, seed: int = 0, **options) -> Task:
    """The test-set task for ``task`` ("lm" or "passkey") at evaluation ``lengths`` (multiples of ``train_len``
    for "lm"); ``options`` go to the task's constructor."""
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


@torch.no_grad()
def extrapolate(
    model: str | Path | PreTrainedModel,
    task: str = "lm",
    lengths: Sequence[int] = (512, 1024, 2048, 4096, 8192),
    train_len: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    seed: int = 0,
    **task_options,
) -> dict:
    """Evaluate ``model`` (a model or a ``save_pretrained`` folder) on ``task``'s test sets at every length.

    Args:
        train_len: the training length (default: the shortest of ``lengths``).
        task_options: constructor keywords of the task, e.g. ``corpus``, ``tokenizer``, ``bpe_path``,
            ``eval_tokens``, ``sliding_stride`` (lm) or ``num_keys``, ``test_size``, ``haystack`` (passkey).

    Returns:
        ``{"task", "train_len", "lengths", "rows"}``; lm rows ``{"set", "length", "window", "loss", "perplexity",
        "accuracy"}`` (``window``: "non-overlapping" or "sliding"), passkey rows ``{"set", "length", "depth",
        "exact_match", "digit_accuracy"}``.
    """
    lengths = sorted(set(int(L) for L in lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths: expected positive integers, got {lengths}")
    train_len = lengths[0] if train_len is None else int(train_len)
    spec = build_task(task, lengths, train_len, seed, **task_options)
    model = load_model(model, device)
    if model.config.vocab_size < spec.vocab_size:
        raise ValueError(
            f"model: vocabulary of {model.config.vocab_size} tokens, the {task} task needs {spec.vocab_size}"
        )

    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids.to(device), use_cache=False).logits

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


def format_results(results: dict) -> str:
    """lm: perplexity per length and window kind; passkey: the length × depth grid of exact match."""
    rows = results["rows"]
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
    if results["task"] == "lm":
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
    parser.add_argument("model", help="checkpoint folder written by save_pretrained")
    parser.add_argument("--task", choices=TASK_NAMES, default="lm", help="lm: perplexity; passkey: exact match")
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192], help="evaluation lengths"
    )
    parser.add_argument(
        "--train-len", type=int, default=None, help="training length (default: the shortest evaluation length)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    parser.add_argument("--device", default="cpu", help="torch device of the model")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task's test sets")
    lm = parser.add_argument_group("lm task")
    lm.add_argument("--corpus", default="default", help="corpus spec of attnkit.tasks.corpus.load_corpus")
    lm.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte", help="tokeniser used in training")
    lm.add_argument("--bpe-path", default=None, help="the training run's BPE file (with --tokenizer bpe)")
    lm.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored at every length")
    lm.add_argument(
        "--sliding-stride", type=int, default=None, help="also score sliding windows with this stride (e.g. 256)"
    )
    pk = parser.add_argument_group("passkey task")
    pk.add_argument("--num-keys", type=int, default=64, help="key names of the passkey vocabulary")
    pk.add_argument("--test-size", type=int, default=16, help="sequences per length × depth cell")
    pk.add_argument("--haystack", choices=("noise", "text"), default="noise", help="filler of the haystack")
    parser.add_argument("--plot", default=None, help="write a PNG plot to this path")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")


def task_options(args: argparse.Namespace) -> dict:
    """The constructor keywords of ``args.task`` from the parsed options."""
    if args.task == "lm":
        return {
            "corpus": args.corpus,
            "tokenizer": args.tokenizer,
            "bpe_path": args.bpe_path,
            "eval_tokens": args.eval_tokens,
            "sliding_stride": args.sliding_stride,
        }
    return {"num_keys": args.num_keys, "test_size": args.test_size, "haystack": args.haystack}


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
    print(f"{args.model}: {args.task}, trained at {results['train_len']}")
    print(format_results(results))
    if args.plot:
        plot_results(results, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        write_json(args.out, {"args": vars(args), **results})
    if results["task"] == "lm" and not all(math.isfinite(r["perplexity"]) for r in results["rows"]):
        print("warning: non-finite perplexity at some length")
    return 0
