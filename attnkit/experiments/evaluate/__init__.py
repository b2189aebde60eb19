"""lm-eval-harness on attnkit models: ``attnkit eval RUN --tasks T1,T2``.

    attnkit eval runs/train --tasks lambada_openai,hellaswag --device cuda --batch-size 16 --out results.json
    attnkit eval runs/train --tasks my_task --include-path my_tasks/ --limit 100

``RUN`` is a run folder of ``attnkit train`` or any ``save_pretrained`` folder of an attnkit model with its
tokenizer (or one given by ``--tokenizer``). ``lm_eval.simple_evaluate`` evaluates it as lm-eval model
``"attnkit"``: ``AttnKitLM`` (``lm.py``), lm-eval's ``HFLM`` for attnkit models. ``--tasks`` takes lm-eval's
task, group and tag names (or YAML paths); ``--include-path`` adds a folder of task YAML files, and when every
task is found there lm-eval's own thousands of tasks are not indexed. stdout gets lm-eval's results table;
``--out`` gets the results as JSON (with every request's inputs and outputs under ``"samples"`` with
``--log-samples``).

lm-eval-harness is the ``eval`` extra: ``pip install 'attnkit[eval]'``. This module imports it only when a
command runs, so the CLI starts without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..output import write_json

DTYPES = ("auto", "float32", "bfloat16", "float16")
INSTALL_HINT = "pip install 'attnkit[eval]'"


def _batch_size(value: int | str) -> int | str:
    """A positive integer, or lm-eval's ``"auto"`` / ``"auto:N"`` (the largest batch that fits, re-detected N
    times)."""
    text = str(value)
    if text == "auto" or (text.startswith("auto:") and text[5:].replace(".", "", 1).isdigit()):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(f"batch_size: expected a positive integer, 'auto' or 'auto:N', got {value!r}")


def _device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when available, else ``"cpu"``; a CUDA device must exist."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise ValueError(f"device: {err}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} requested but CUDA is not available")
    return device


def _import_lm_eval() -> None:
    """lm-eval-harness and its HF model class (which needs accelerate), or an ImportError with the install hint."""
    try:
        import lm_eval.models.huggingface  # noqa: F401
    except ImportError as err:
        raise ImportError(f"lm-eval-harness is not installed ({err}): {INSTALL_HINT}") from err


def _task_manager(tasks: list[str], include_path: str | None, metadata: dict):
    """lm-eval's ``TaskManager`` for ``tasks``: only ``include_path`` when it holds every task (indexing lm-eval's
    own tasks takes seconds), else both. Unknown names raise a ValueError. ``metadata`` reaches every task (as
    ``simple_evaluate`` passes its ``model_args``: some tasks read ``pretrained``)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise ValueError(f"include_path: {include_path!r} is not a folder")
        manager = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(name in manager.all_tasks for name in tasks):
            return manager
    manager = TaskManager(include_path=include_path, metadata=metadata)
    unknown = [name for name in tasks if name not in manager.all_tasks and not Path(name).is_file()]
    if unknown:
        where = " or in " + include_path if include_path else ""
        raise ValueError(f"tasks: {unknown} are not lm-eval tasks, groups or tags{where} (see `lm-eval ls tasks`)")
    return manager


def evaluate(
    model: str | Path,
    tasks: list[str],
    include_path: str | Path | None = None,
    batch_size: int | str = 1,
    device: str = "auto",
    dtype: str = "auto",
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    max_length: int | None = None,
    tokenizer: str | Path | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
) -> dict:
    """lm-eval-harness ``tasks`` on the attnkit model in the folder ``model``.

    Args:
        model: a ``save_pretrained`` folder (a run folder of ``attnkit train``).
        include_path: a folder of extra lm-eval task YAML files.
        batch_size: requests per forward pass, or ``"auto"``.
        device: torch device, or ``"auto"`` (CUDA when available).
        dtype: weights' dtype, ``"auto"`` being the saved one.
        limit: examples per task (a fraction below 1), for quick checks.
        num_fewshot: few-shot examples (default: each task's own).
        max_length: longest input in tokens (default: the config's ``max_position_embeddings``); longer inputs
            are truncated from the left, and rolling log-likelihoods use windows of this length.
        tokenizer: a tokenizer folder, when ``model`` has none.
        log_samples: keep every request's inputs and outputs under ``"samples"``.
        bootstrap_iters: bootstrap resamples of the metrics' standard errors (0: none).

    Returns:
        lm-eval's results dict (``"results"``, ``"groups"``, ``"configs"``, ``"n-shot"``, ``"config"``, ...).
    """
    _import_lm_eval()
    names = [t.strip() for t in tasks if t.strip()]
    if not names:
        raise ValueError(f"tasks: expected at least one task name, got {tasks!r}")
    folder = Path(model)
    if not (folder / "config.json").is_file():
        raise ValueError(f"model: {str(model)!r} is not a save_pretrained folder (no config.json)")
    if tokenizer is None and not (folder / "tokenizer_config.json").is_file():
        raise ValueError(f"model: {str(model)!r} has no tokenizer (no tokenizer_config.json); pass tokenizer")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length: expected a positive integer, got {max_length}")
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"num_fewshot: expected a non-negative integer, got {num_fewshot}")
    if limit is not None and not limit > 0:
        raise ValueError(f"limit: expected a positive number, got {limit}")
    batch_size = _batch_size(batch_size)
    device = _device(device)
    model_args = {"pretrained": str(model), "dtype": dtype}
    if tokenizer is not None:
        model_args["tokenizer"] = str(tokenizer)
    if max_length is not None:
        model_args["max_length"] = max_length
    manager = _task_manager(names, None if include_path is None else str(include_path), model_args)

    from lm_eval import simple_evaluate

    from . import lm  # noqa: F401  (registers the model "attnkit" with lm-eval)

    return simple_evaluate(
        model="attnkit",
        model_args=model_args,
        batch_size=batch_size,
        device=device,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
    )


def format_results(results: dict) -> str:
    """lm-eval's markdown table of every task's metrics (and of the groups', when there are groups)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    return table + ("\n" + make_table(results, "groups") if results.get("groups") else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="run folder or save_pretrained folder of an attnkit model")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks, groups or tags")
    parser.add_argument("--include-path", default=None, help="folder of extra lm-eval task YAML files")
    parser.add_argument("--batch-size", default="1", help="requests per forward pass, or auto")
    parser.add_argument("--device", default="auto", help="torch device; auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="weights' dtype; auto: the saved one")
    parser.add_argument("--limit", type=float, default=None, help="examples per task (below 1: a fraction)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (None: each task's own)")
    parser.add_argument(
        "--max-length", type=int, default=None, help="longest input in tokens (None: max_position_embeddings)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, when the model folder has none")
    parser.add_argument("--bootstrap-iters", type=int, default=100000, help="resamples of the stderr (0: none)")
    parser.add_argument("--log-samples", action="store_true", help="add every request's outputs to --out")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")


def run(args: argparse.Namespace) -> int:
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    try:
        results = evaluate(
            args.model,
            tasks=args.tasks.split(","),
            include_path=args.include_path,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            limit=limit,
            num_fewshot=args.num_fewshot,
            max_length=args.max_length,
            tokenizer=args.tokenizer,
            log_samples=args.log_samples,
            bootstrap_iters=args.bootstrap_iters,
        )
    except ImportError as err:
        print(f"attnkit eval: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"attnkit eval: {err}", file=sys.stderr)
        return 2
    print(f"{args.model}: lm-eval {', '.join(results['results'])}")
    print(format_results(results))
    if args.out:
        write_json(args.out, {"args": vars(args), **results})
    return 0
