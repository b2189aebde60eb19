"""Cells: the independent runs a reproduction is made of, each cached as a small JSON file.

A cell is one training run with its evaluation (kind ``"train"``) or one measurement without training (a probe of
``probes.PROBES``). It is defined by its ``kind`` and ``params`` (JSON values only: everything that determines the
result); its key is a hash of them, so a cell whose definition changes is a new cell and an old result is never
reused for it. ``run_cells`` runs the cells that have no result file yet, in this process or in ``jobs`` worker
processes (cells are independent, so many tiny models can share one GPU), and each result is written atomically
to ``<cells dir>/<name>.json`` the moment it finishes: an interrupted run loses only the cells in flight, and a
finished cell is never run again.

Chains: a train cell may name a ``parent`` train cell and start from its trained weights (continued pretraining,
or a RoPE model converted to PaTH and trained on). The parent ``keep``s its final model, in Hugging Face format
without the optimizer state, in ``<cells dir>/models/<name>/`` (written before its record); the child trains with
``init_from`` pointing at it (after converting it to another mixer when ``params["convert"]`` asks, see
``convert_model``). The child's key includes its parent's key, so a changed parent never reuses a stale child.
The kept models serve only the children still to run: a parent with its record has finished, and ``run_cells``
runs it again (once, before the child) only when a child has to run and the parent's model is not there (a run
killed between the two writes, or a later session given the records without the models).
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
import shutil
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
    setting, learning rate, seed); ``kind``: ``"train"`` or a probe name; ``params``: its definition;
    ``parent``: the train cell whose final weights this one starts from; ``keep``: keep this cell's trained model
    for its children (where the weights are kept does not change the result, so it is not part of the key)."""

    experiment: str
    label: str
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    parent: Cell | None = None
    keep: bool = False

    def __post_init__(self) -> None:
        if self.parent is not None and not (self.kind == self.parent.kind == "train" and self.parent.keep):
            raise ValueError(
                f"parent: cell {self.experiment} {self.label} may start only from a train cell that keeps its model, "
                f"got {self.parent.experiment} {self.parent.label} (kind {self.parent.kind!r}, keep "
                f"{self.parent.keep})"
            )

    @property
    def key(self) -> str:
        definition = {"kind": self.kind, "params": self.params}
        if self.parent is not None:
            definition["parent"] = self.parent.key
        blob = json.dumps(definition, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9.+=-]+", "_", f"{self.experiment}-{self.label}").strip("_")
        return f"{slug}-{self.key}"


def cell_path(cells_dir: str, cell: Cell) -> str:
    return os.path.join(cells_dir, cell.name + ".json")


def model_dir(cells_dir: str, cell: Cell) -> str:
    """Where a cell that ``keep``s its model keeps it (a folder ``load_saved_model`` and ``init_from`` read)."""
    return os.path.join(cells_dir, "models", cell.name)


def is_finished(cells_dir: str, cell: Cell) -> bool:
    """Whether ``cell`` has its record (never run again)."""
    return load_cell(cells_dir, cell) is not None


def has_model(cells_dir: str, cell: Cell) -> bool:
    """Whether ``cell``'s kept model is there for a child to start from."""
    return os.path.isfile(os.path.join(model_dir(cells_dir, cell), "model.safetensors"))


def _can_continue(cells_dir: str, parent: Cell) -> bool:
    """Whether a child of ``parent`` can start without running the parent again: the parent has finished and kept
    its model, or has finished without one to keep (diverged; the child then fails, see ``run_cell``)."""
    record = load_cell(cells_dir, parent)
    return record is not None and (record["result"]["status"] != "ok" or has_model(cells_dir, parent))


def shares_records(cell: Cell) -> bool:
    """Whether ``cell`` may take the record of an identical cell of another experiment: one that neither starts from
    nor keeps a model (its record is the whole of it), whose definition (``kind`` and ``params``, the key's blob) is
    the same. Such a cell runs once: an experiment that repeats another's run (the capacity sweep's n = 16 and 24 are
    the MQAR sweep's) reads that run's record."""
    return cell.parent is None and not cell.keep


def _shared_record(cells_dir: str, cell: Cell) -> dict | None:
    """The record of a cell of another experiment with ``cell``'s definition, or None."""
    if not shares_records(cell):
        return None
    suffix = f"-{cell.key}.json"
    try:
        names = sorted(n for n in os.listdir(cells_dir) if n.endswith(suffix) and not n.startswith("."))
    except FileNotFoundError:
        return None
    definition = json.loads(json.dumps({"kind": cell.kind, "params": cell.params}, default=str))
    for name in names:
        with open(os.path.join(cells_dir, name)) as f:
            record = json.load(f)
        ident = record.get("cell", {})
        if (
            ident.get("key") == cell.key
            and "parent" not in ident
            and {"kind": ident.get("kind"), "params": record.get("params")} == definition
        ):
            return record
    return None


def load_cell(cells_dir: str, cell: Cell) -> dict | None:
    """The cached record of ``cell`` (``{"cell", "result", ...}``), or None when it has not finished. A cell without
    its own record takes that of an identical cell of another experiment (:func:`shares_records`)."""
    path = cell_path(cells_dir, cell)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return _shared_record(cells_dir, cell)
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


def convert_model(source: str, target: str, mixer: str, seed: int) -> list[str]:
    """Save in the folder ``target`` the attnkit model of ``source`` converted to ``mixer`` the way
    ``attnkit.models.from_llama`` converts a Llama model: every weight the two mixers share (embeddings, norms,
    MLPs, the q/k/v/o projections) is copied; what the new mixer adds (PaTH's transition and gate projections)
    keeps its fresh initialisation, seeded by ``seed``, and is what training on learns. Returns the names of the
    fresh weights."""
    from ...models import AttnKitForCausalLM
    from ...train.hf_folder import load_saved_model, saved_model_config, write_hf_model

    trained = load_saved_model(source)
    torch.manual_seed(seed)
    model = AttnKitForCausalLM(saved_model_config(source, mixer=mixer))
    fresh, unused = model.load_state_dict(trained.state_dict(), strict=False)
    if unused:
        raise ValueError(f"convert: a {mixer!r} model has no place for {sorted(unused)} of the model in {source}")
    os.makedirs(target, exist_ok=True)
    write_hf_model(target, model.config, model.state_dict())
    return sorted(fresh)


def _keep_model(run_dir: str, target: str) -> None:
    """Copy the run's final Hugging Face model (its snapshot without the optimizer state) to the folder ``target``
    in one rename, replacing what a run of the same cell killed before its record was written left there."""
    from ...train.checkpoint import SNAPSHOT
    from ...train.trainer import CHECKPOINT_NAME

    source = os.path.join(run_dir, SNAPSHOT)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in sorted(os.listdir(source)):
        if name != CHECKPOINT_NAME:
            shutil.copyfile(os.path.join(source, name), os.path.join(tmp, name))
    if os.path.exists(target):
        shutil.rmtree(target)
    os.replace(tmp, target)


def _run_train(
    params: dict, device: str, init_from: str | None = None, keep: str | None = None, cuda_graph: bool = False
) -> dict:
    """Train and evaluate ``params["config"]``, starting from the model saved in ``init_from`` (converted first
    when ``params["convert"]`` names another mixer) and keeping the final model in ``keep``; ``cuda_graph``: its
    steps as CUDA graphs where the config allows them (``TrainConfig.cuda_graph``: the same training to rounding,
    faster for the small models; not part of the cell's identity)."""
    from ...tasks import get_task
    from ...train import NonFiniteLossError, TrainConfig, train
    from ...train.config import cuda_graph_conflict

    if "convert" in params and init_from is None:
        raise ValueError("convert: a cell converts its parent's model, and this one has no parent")
    if init_from is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a quiet cell: no bar for loading the parent's weights
    extra = {}
    with tempfile.TemporaryDirectory(prefix="attnkit-cell-") as tmp:
        run_dir = os.path.join(tmp, "run")
        if "convert" in params:
            converted = os.path.join(tmp, "converted")
            fresh = convert_model(init_from, converted, seed=params["config"]["seed"], **params["convert"])
            init_from, extra["converted"] = converted, {**params["convert"], "fresh": fresh}
        asked = params["config"]
        graphs = cuda_graph and str(device).startswith("cuda") and cuda_graph_conflict(asked) is None
        config = TrainConfig(**asked, init_from=init_from, device=device, out=run_dir, quiet=True, cuda_graph=graphs)
        try:
            result = train(config)
        except NonFiniteLossError as err:
            # a learning rate that diverges is a result of the sweep, not a failure of the cell
            return {"status": "diverged", "reason": str(err), "events": _metrics_events(run_dir)}
        events = _metrics_events(run_dir)
        if keep is not None:
            _keep_model(run_dir, keep)
    task = get_task(config.task, seed=config.seed, **config.task_options)
    if "probes" in params:
        from .probes import TRAINED_PROBES

        asked = params["probes"]
        extra["probes"] = {name: TRAINED_PROBES[name](result.model, task, **kw) for name, kw in asked.items()}
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
        "cuda_graph": graphs,
        **extra,
    }


def run_cell(cell: Cell, cells_dir: str, device: str = "auto", cuda_graph: bool = False) -> dict:
    """Run ``cell`` and write its record to ``cells_dir``; returns the record. A cell with a parent starts from the
    parent's kept model, which must be there; a cell that keeps its model writes it before its record.
    ``cuda_graph``: a training cell's steps as CUDA graphs on a GPU (:func:`_run_train`)."""
    from ...train.distributed import resolve_device
    from .probes import PROBES

    device = resolve_device(device)
    t0 = time.perf_counter()
    identity = {"experiment": cell.experiment, "label": cell.label, "kind": cell.kind, "key": cell.key}
    if cell.parent is not None:
        if not has_model(cells_dir, cell.parent):
            raise ValueError(
                f"cell {cell.name}: its parent {cell.parent.name} has no kept model (not run, diverged, or its model "
                "was removed); run it first"
            )
        identity["parent"] = {"name": cell.parent.name, "key": cell.parent.key}
    if cell.kind == "train":
        parent = model_dir(cells_dir, cell.parent) if cell.parent is not None else None
        keep = model_dir(cells_dir, cell) if cell.keep else None
        result = _run_train(cell.params, device, parent, keep, cuda_graph)
    elif cell.kind in PROBES:
        result = {"status": "ok", **PROBES[cell.kind](**cell.params)}
    else:
        raise ValueError(f"cell {cell.name}: unknown kind {cell.kind!r}; expected 'train' or one of {sorted(PROBES)}")
    record = {
        "format": CELL_FORMAT,
        "cell": identity,
        "params": cell.params,
        "result": result,
        "wall_s": time.perf_counter() - t0,
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if cell.keep and result["status"] == "ok":
        record["model"] = os.path.relpath(model_dir(cells_dir, cell), cells_dir)
    _write_atomic(cell_path(cells_dir, cell), record)
    return record


def device_name(device: str) -> str:
    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()})"


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


def _worker(cell: Cell, cells_dir: str, device: str, cuda_graph: bool = False) -> dict:
    try:
        return run_cell(cell, cells_dir, device, cuda_graph)
    except Exception:  # reported by the parent; the cell stays unfinished
        return {"error": traceback.format_exc(limit=4)}


@dataclass
class RunSummary:
    ran: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # left for later: past the deadline
    wall_s: float = 0.0

    def merge(self, other: RunSummary) -> None:
        """Add the cells and the wall time of a later stage of the same invocation."""
        self.ran += other.ran
        self.cached += other.cached
        self.failed.update(other.failed)
        self.skipped += other.skipped
        self.wall_s += other.wall_s


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_cells(
    cells: Iterable[Cell],
    cells_dir: str,
    jobs: int = 1,
    device: str = "auto",
    deadline: float | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    stop_at: float | None = None,
    cuda_graph: bool = False,
) -> RunSummary:
    """Run every cell of ``cells`` that has not finished in ``cells_dir``, each after its parent.

    A child that has to run needs its parent's kept model: a parent without its record, or without its model, runs
    first, once, whether or not ``cells`` lists it; a child starts only when its parent has finished, and is
    ``failed`` (or ``skipped``) with it when it fails (or is skipped).
    ``jobs > 1`` runs that many worker processes (spawned, each with ``cpu_count() // jobs`` torch threads);
    ``deadline`` (a ``time.time()``) stops starting new cells once passed (the unstarted ones are ``skipped``).
    ``cuda_graph``: training cells replay their steps as CUDA graphs on a GPU (:func:`run_cell`).
    ``stop_at`` (a ``time.time()``): when the caller will stop the run, killing what still runs. A cell starts only if
    its siblings' longest wall time (:func:`sibling_key`: the same experiment, kind, model and setting at another
    learning rate or seed, finished before or during this run), with a tenth more, fits before it; else it is
    ``skipped``, so that no call spends its end on cells it will kill. A cell with no finished sibling takes the
    longest wall time of its experiment's finished cells of its kind instead (another model or setting: the next
    rung of a ladder, the next n of a sweep, whose cells a call would otherwise start in its last minutes, to be
    killed while they slow the others down); one whose experiment has none finished is left to ``deadline``.
    A cell that raises is reported in ``failed`` and left unfinished; the others go on.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: expected a positive integer, got {jobs!r}")
    t0 = time.perf_counter()
    summary = RunSummary()
    todo: list[Cell] = []  # parents before their children

    def need(cell: Cell) -> None:
        if cell.name in unfinished:
            return
        if cell.parent is not None and not _can_continue(cells_dir, cell.parent):
            need(cell.parent)
        unfinished.add(cell.name)
        todo.append(cell)

    longest: dict[tuple[str, ...], float] = {}  # sibling_key (or its experiment and kind) -> the longest wall time

    def timed(cell: Cell, record: dict) -> None:
        if "wall_s" in record:
            for key in (sibling_key(cell), sibling_key(cell)[:2]):  # its siblings', and its experiment's
                longest[key] = max(longest.get(key, 0.0), float(record["wall_s"]))

    unfinished: set[str] = set()
    runs: dict[str, str] = {}  # key -> the cell that runs it, for identical cells of several experiments
    twins: dict[str, str] = {}  # a cell that reads the record of an identical one run here -> that one's name
    cells = list(cells)
    for cell in cells:
        record = load_cell(cells_dir, cell)  # is_finished's read, kept for the siblings' wall times
        if record is not None:
            timed(cell, record)
        elif shares_records(cell) and runs.get(cell.key, cell.name) != cell.name:
            twins[cell.name] = runs[cell.key]
        else:
            need(cell)
            if shares_records(cell):
                runs[cell.key] = cell.name
    summary.cached = [cell.name for cell in cells if cell.name not in unfinished and cell.name not in twins]
    total, waiting = len(todo), list(todo)

    def fits(cell: Cell) -> bool:
        key = sibling_key(cell)
        estimate = longest.get(key, longest.get(key[:2]))
        return stop_at is None or estimate is None or time.time() + 1.1 * estimate <= stop_at

    def done(cell: Cell, record: dict) -> None:
        unfinished.discard(cell.name)
        if "error" in record:
            summary.failed[cell.name] = record["error"]
            log(f"[{len(summary.ran) + len(summary.failed)}/{total}] {cell.experiment} {cell.label}: FAILED")
            log(record["error"])
            return
        summary.ran.append(cell.name)
        timed(cell, record)
        log(f"[{len(summary.ran) + len(summary.failed)}/{total}] {cell.experiment} {cell.label}: {brief(record)}")

    def drop_orphans() -> None:
        """The children of failed or skipped cells share their fate; past the deadline nothing more starts."""
        past = deadline is not None and time.time() > deadline
        changed = True
        while changed:
            changed = False
            for cell in list(waiting):
                parent = cell.parent.name if cell.parent is not None else None
                if past or parent in summary.skipped or not fits(cell):
                    waiting.remove(cell)
                    unfinished.discard(cell.name)
                    summary.skipped.append(cell.name)
                    changed = True
                elif parent in summary.failed:
                    waiting.remove(cell)
                    done(cell, {"error": f"its parent {parent} failed"})
                    changed = True

    def next_ready() -> Cell | None:
        for cell in waiting:
            if (cell.parent is None or cell.parent.name not in unfinished) and fits(cell):
                waiting.remove(cell)
                return cell
        return None

    if jobs == 1 or len(todo) <= 1:
        while waiting:
            drop_orphans()
            cell = next_ready()
            if cell is None:
                break
            done(cell, _worker(cell, cells_dir, device, cuda_graph))
    else:
        threads = max(1, cpu_count() // jobs)
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, context, _init_worker, (threads,)) as pool:
            running: dict[concurrent.futures.Future, Cell] = {}
            while waiting or running:
                drop_orphans()
                while len(running) < jobs and (cell := next_ready()) is not None:
                    running[pool.submit(_worker, cell, cells_dir, device, cuda_graph)] = cell
                if not running:
                    break
                finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    done(running.pop(future), future.result())
    for twin, runner in twins.items():  # a twin shares its runner's fate
        if runner in summary.failed:
            summary.failed[twin] = summary.failed[runner]
        else:
            (summary.ran if runner in summary.ran else summary.skipped).append(twin)
    summary.wall_s = time.perf_counter() - t0
    return summary


def sibling_key(cell: Cell) -> tuple[str, str, str]:
    """What a cell shares with the cells whose wall time predicts its own: its experiment, kind, and label without the
    learning rate and seed that sweeps append (``"{model} {setting} lr=… s…"``)."""
    return cell.experiment, cell.kind, re.sub(r" lr=\S+ s\d+$", "", cell.label)


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
