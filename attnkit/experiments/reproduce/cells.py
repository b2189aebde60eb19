"""Cells: the independent runs a reproduction is made of, each cached as a small JSON file.

A cell is one training run with its evaluation (kind ``"train"``) or one measurement without training (a probe of
``probes.PROBES``). It is defined by its ``kind`` and ``params`` (JSON values only: everything that determines the
result); its key is a hash of them, so a cell whose definition changes is a new cell and an old result is never
reused for it. ``run_cells`` runs the cells that have no result file yet, in this process or in ``jobs`` worker
processes (cells are independent, so many tiny models can share one GPU), and each result is written atomically
to ``<cells dir>/<name>.json`` the moment it finishes: an interrupted run loses only the cells in flight, and a
finished cell is never run again.
"""

from __future__ import annotations

import concurrent.futures
import copy
import hashlib
import json
import multiprocessing
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

CELL_FORMAT = 1


@dataclass(frozen=True, eq=False)
class Cell:
    """One run. ``experiment``: the experiment it belongs to; ``label``: a readable name within it (model,
    setting, learning rate, seed); ``kind``: ``"train"`` or a probe name; ``params``: its definition."""

    experiment: str
    label: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        blob = json.dumps({"kind": self.kind, "params": self.params}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.+=-]+", "_", f"{self.experiment}-{self.label}").strip("_")
        return f"{slug}-{self.key}"


def cell_path(cells_dir: str, cell: Cell) -> str:
    return os.path.join(cells_dir, cell.name + ".json")


def load_cell(cells_dir: str, cell: Cell) -> dict | None:
    """The cached record of ``cell`` (``{"cell", "result", ...}``), or None when it has not finished."""
    path = cell_path(cells_dir, cell)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a cell record ({err}); move it aside to rerun the cell") from None
    if record.get("cell", {}).get("key") != cell.key:
        raise ValueError(f"{path}: holds another cell (key {record.get('cell', {}).get('key')!r}, not {cell.key!r})")
    return record


def _write_atomic(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)


def _metrics_events(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _evaluate_variants(result, task, batch_size: int, variants: dict[str, dict]) -> dict[str, dict]:
    """Test metrics of the trained weights with other mixer arguments (e.g. RoPE scaled by PI, NTK or YaRN)."""
    from ...models import AttnKitForCausalLM

    out = {}
    for name, mixer_kwargs in variants.items():
        model_config = copy.deepcopy(result.model.config)
        merged = copy.deepcopy(model_config.mixer_kwargs)
        for mixer, extra in mixer_kwargs.items():
            merged[mixer] = {**merged.get(mixer, {}), **extra}
        model_config.mixer_kwargs = merged
        model = AttnKitForCausalLM(model_config).to(result.model.device)
        model.load_state_dict(result.model.state_dict())
        model.eval()

        def logits_fn(x: torch.Tensor, model=model) -> torch.Tensor:
            return model(input_ids=x.to(model.device), use_cache=False).logits

        out[name] = task.evaluate_model(logits_fn, batch_size=batch_size)
    return out


def _run_train(params: dict, device: str) -> dict:
    from ...tasks import get_task
    from ...train import NonFiniteLossError, TrainConfig, train

    with tempfile.TemporaryDirectory(prefix="attnkit-cell-") as run_dir:
        config = TrainConfig(**params["config"], device=device, out=run_dir, quiet=True)
        try:
            result = train(config)
        except NonFiniteLossError as err:
            # a learning rate that diverges is a result of the sweep, not a failure of the cell
            return {"status": "diverged", "reason": str(err), "events": _metrics_events(run_dir)}
        events = _metrics_events(run_dir)
    task = get_task(config.task, seed=config.seed, **config.task_options)
    return {
        "status": "ok",
        "test": result.metrics,
        "validation": result.validation_metrics,
        "variants": _evaluate_variants(result, task, config.eval_batch_size, params.get("variants", {})),
        "seq_len": task.seq_len,
        "final_loss": result.loss,
        "events": events,
        "train_wall_s": result.wall_time_s,
        "tokens_per_s": result.tokens_per_s,
        "parameters": sum(p.numel() for p in result.model.parameters()),
    }


def run_cell(cell: Cell, cells_dir: str, device: str = "auto") -> dict:
    """Run ``cell`` and write its record to ``cells_dir``; returns the record."""
    from ...train.distributed import resolve_device
    from .probes import PROBES

    device = resolve_device(device)
    t0 = time.perf_counter()
    if cell.kind == "train":
        result = _run_train(cell.params, device)
    elif cell.kind in PROBES:
        result = {"status": "ok", **PROBES[cell.kind](**cell.params)}
    else:
        raise ValueError(f"cell {cell.name}: unknown kind {cell.kind!r}; expected 'train' or one of {sorted(PROBES)}")
    record = {
        "format": CELL_FORMAT,
        "cell": {"experiment": cell.experiment, "label": cell.label, "kind": cell.kind, "key": cell.key},
        "params": cell.params,
        "result": result,
        "wall_s": time.perf_counter() - t0,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_atomic(cell_path(cells_dir, cell), record)
    return record


def device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _worker(cell: Cell, cells_dir: str, device: str) -> dict:
    try:
        return run_cell(cell, cells_dir, device)
    except Exception:  # reported by the parent; the cell stays unfinished
        return {"error": traceback.format_exc(limit=4)}


@dataclass
class RunSummary:
    ran: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # left for later: past the deadline
    wall_s: float = 0.0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_cells(
    cells: Iterable[Cell],
    cells_dir: str,
    jobs: int = 1,
    device: str = "auto",
    deadline: float | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> RunSummary:
    """Run every cell of ``cells`` without a record in ``cells_dir``.

    ``jobs > 1`` runs that many worker processes (spawned, each with ``cpu_count() // jobs`` torch threads);
    ``deadline`` (a ``time.time()``) stops starting new cells once passed (the unstarted ones are ``skipped``).
    A cell that raises is reported in ``failed`` and left unfinished; the others go on.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected a positive integer, got {jobs!r}")
    t0 = time.perf_counter()
    summary = RunSummary()
    todo = []
    for cell in cells:
        (summary.cached if load_cell(cells_dir, cell) is not None else todo).append(cell)
    summary.cached = [c.name for c in summary.cached]
    total = len(todo)

    def done(cell: Cell, record: dict) -> None:
        if "error" in record:
            summary.failed[cell.name] = record["error"]
            log(f"[{len(summary.ran) + len(summary.failed)}/{total}] {cell.experiment} {cell.label}: FAILED")
            log(record["error"])
            return
        summary.ran.append(cell.name)
        log(f"[{len(summary.ran) + len(summary.failed)}/{total}] {cell.experiment} {cell.label}: {brief(record)}")

    def past_deadline() -> bool:
        return deadline is not None and time.time() > deadline

    if jobs == 1 or len(todo) <= 1:
        for cell in todo:
            if past_deadline():
                summary.skipped.append(cell.name)
                continue
            done(cell, _worker(cell, cells_dir, device))
    else:
        threads = max(1, cpu_count() // jobs)
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, context, _init_worker, (threads,)) as pool:
            pending = list(reversed(todo))
            running: dict[concurrent.futures.Future, Cell] = {}
            while pending or running:
                while pending and len(running) < jobs and not past_deadline():
                    cell = pending.pop()
                    running[pool.submit(_worker, cell, cells_dir, device)] = cell
                if past_deadline():
                    summary.skipped.extend(c.name for c in reversed(pending))
                    pending = []
                if not running:
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    done(running.pop(future), future.result())
    summary.wall_s = time.perf_counter() - t0
    return summary


def brief(record: dict) -> str:
    """One line on a finished cell: its status, test metrics in short, and its wall time."""
    result = record["result"]
    if result["status"] != "ok":
        return f"{result['status']} ({record['wall_s']:.1f} s)"
    parts = []
    for set_name, metrics in result.get("test", {}).items():
        first = next(iter(metrics.items()), None)
        if first:
            parts.append(f"{set_name} {first[0]} {first[1]:.3g}")
    shown = ", ".join(parts[:3]) + (", ..." if len(parts) > 3 else "")
    return f"{shown or 'done'} ({record['wall_s']:.1f} s)"
