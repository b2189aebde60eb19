"""``attnkit reproduce {path,tapa,vla,all}``: run a paper's cells (or the ones missing) and write its report."""

from __future__ import annotations

import argparse
import fnmatch
import os
import shlex
import sys
import time

from . import path, tapa, vla
from .cells import Cell, RunSummary, cpu_count, is_finished, load_cell, run_cells
from .probes import Probe, summarise_probe
from .sweep import summarise
from .verdicts import judge

PAPERS = {"path": path, "tapa": tapa, "vla": vla}
SCALES = ("smoke", "full")
# Tiny models scale badly over threads, and threads that wait on each other stall when other processes share the
# cores: on a CPU, one single-threaded process per core runs the cells fastest.
AUTO_JOBS = 8


def default_jobs(device: str) -> int:
    """``--jobs 0``: one worker per CPU core (at most ``AUTO_JOBS``) on a CPU run, one on a GPU."""
    from ...train.distributed import resolve_device

    return min(cpu_count(), AUTO_JOBS) if resolve_device(device) == "cpu" else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paper", choices=[*PAPERS, "all"], help="the paper whose claims to reproduce")
    parser.add_argument("--scale", choices=SCALES, default="smoke", help="smoke: CPU minutes; full: the GPU budgets")
    parser.add_argument("--out", default="runs/reproduce", help="folder; each paper writes <out>/<paper>/")
    parser.add_argument(
        "--resume", action="store_true", help="reuse the finished cells in the folder (never rerun), run the rest"
    )
    parser.add_argument("--cells", default=None, metavar="PATTERN", help="run only cells whose name matches (fnmatch)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help=f"cells run at once, each in its own process (default 0: one per CPU core, at most {AUTO_JOBS}, on "
        "a CPU run; 1 with a GPU)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="device of every cell")
    parser.add_argument(
        "--max-minutes", type=float, default=0.0, help="start no cell after this many minutes (0: no limit)"
    )
    parser.add_argument(
        "--stop-minutes",
        type=float,
        default=0.0,
        help="the run will be stopped after this many minutes: start no cell whose siblings took longer than what is "
        "left (0: no such limit)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="on a GPU, replay each training cell's steps as CUDA graphs (the same training to rounding, faster "
        "for small models)",
    )
    parser.add_argument("--list", action="store_true", help="list the cells and whether each has finished; run none")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="write the report from the finished cells and run none (the rest are NOT RUN): after a run that a time "
        "limit killed",
    )


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this invocation."""
    words = ["attnkit", "reproduce", args.paper, "--scale", args.scale, "--out", args.out, "--jobs", str(args.jobs)]
    if args.cells:
        words += ["--cells", args.cells]
    if args.device != "auto":
        words += ["--device", args.device]
    if args.resume:
        words.append("--resume")
    if args.max_minutes > 0:
        words += ["--max-minutes", f"{args.max_minutes:g}"]
    if args.stop_minutes > 0:
        words += ["--stop-minutes", f"{args.stop_minutes:g}"]
    if args.cuda_graph:
        words.append("--cuda-graph")
    if args.report_only:
        words.append("--report-only")
    return " ".join(shlex.quote(w) for w in words)


def declared(paper: str, scale: str) -> list:
    """The experiments (sweeps and probes) of ``paper`` at ``scale``."""
    return PAPERS[paper].experiments(scale)


def declared_cells(experiments: list, cells_dir: str) -> tuple[list[Cell], dict[str, dict]]:
    """The cells of ``experiments`` that can be declared now, and the finished ones' records.

    A chained sweep's cells exist once its parent sweep has chosen the learning rate of each model it continues,
    and a laddered sweep's deeper rungs once the shallower ones have chosen theirs and fallen short, so they appear
    as those cells finish: a run declares, runs what is missing and declares again. An experiment is declared until
    its own finished cells declare no more."""
    before: set[str] = set()
    cells: list[Cell] = []
    records: dict[str, dict] = {}
    for experiment in experiments:
        parent = getattr(experiment, "parent", None)
        if parent is not None and parent.name not in before:
            raise ValueError(f"{experiment.name}: parent: {parent.name} is not an experiment listed before it")
        before.add(experiment.name)
        known: set[str] = set()
        while new := [cell for cell in experiment.cells(records) if cell.name not in known]:
            for cell in new:
                known.add(cell.name)
                cells.append(cell)
                if (record := load_cell(cells_dir, cell)) is not None:
                    records[cell.name] = record
            if not getattr(experiment, "stop_at", None):
                break  # only a ladder's own records declare more of it
    return cells, records


def waiting_count(experiments: list, cells: list[Cell], records: dict[str, dict]) -> int:
    """Cells that cannot be declared yet: of chained sweeps whose parents have not finished, and the rungs of
    laddered sweeps above rungs still running (``records``: the finished cells', as :func:`declared_cells` gives)."""
    declared = {c.name for c in cells}
    total = sum(len(e.settings) * len(e.models) * len(e.lrs) * len(e.seeds) for e in experiments if _chained(e))
    chained = total - sum(c.name in declared for c in cells if c.parent is not None)
    rungs = 0
    for e in experiments:
        if getattr(e, "stop_at", None) is not None:
            waiting = sum(bool(choice.waiting) for choice in summarise(e, records).choices.values())
            rungs += waiting * len(e.lrs) * len(e.seeds)
    return chained + rungs


def _chained(experiment) -> bool:
    return getattr(experiment, "parent", None) is not None


def run(args: argparse.Namespace) -> int:
    if args.jobs < 0:
        print(f"attnkit reproduce: --jobs: expected 0 (automatic) or more, got {args.jobs}", file=sys.stderr)
        return 2
    args.jobs = args.jobs or default_jobs(args.device)
    papers = list(PAPERS) if args.paper == "all" else [args.paper]
    plans = {}
    for paper in papers:
        experiments = declared(paper, args.scale)
        cells_dir = os.path.join(args.out, paper, "cells")
        cells, records = declared_cells(experiments, cells_dir)
        finished = [c for c in cells if is_finished(cells_dir, c)]
        if args.list:
            for c in cells:
                print(f"{'done   ' if c in finished else 'pending'} {paper} {c.name}")
            if waiting := waiting_count(experiments, cells, records):
                print(
                    f"waiting {paper} {waiting} cells of chained or laddered experiments, declared once the cells "
                    "they follow finish"
                )
            continue
        if finished and not (args.resume or args.report_only):
            print(
                f"attnkit reproduce: {cells_dir} already holds {len(finished)} finished cells of this scale: pass "
                "--resume to reuse them (they are never rerun), or choose another --out",
                file=sys.stderr,
            )
            return 2
        plans[paper] = (experiments, cells_dir)
    if args.list:
        return 0
    t0 = time.time()
    deadline = t0 + 60 * args.max_minutes if args.max_minutes > 0 else None
    stop_at = t0 + 60 * args.stop_minutes if args.stop_minutes > 0 else None
    if args.report_only:  # a deadline already past: no cell starts, and the unfinished ones are left for later
        deadline = 0.0
    failed = 0
    for paper, (experiments, cells_dir) in plans.items():
        summary = RunSummary()
        tried: set[str] = set()
        while True:  # chained cells are declared once their parents have finished: run in stages
            cells, records = declared_cells(experiments, cells_dir)
            selected = [c for c in cells if args.cells is None or fnmatch.fnmatch(c.name, args.cells)]
            new = [c for c in selected if c.name not in tried]
            if not new:
                break
            tried.update(c.name for c in new)
            waiting = waiting_count(experiments, cells, records)
            print(
                f"attnkit reproduce {paper} ({args.scale}): {len(new)} of {len(cells)} cells"
                + (f" ({waiting} more wait for the cells they follow)" if waiting else ""),
                file=sys.stderr,
            )
            summary.merge(
                run_cells(new, cells_dir, args.jobs, args.device, deadline, stop_at=stop_at, cuda_graph=args.cuda_graph)
            )
        failed += len(summary.failed)
        cells, records = declared_cells(experiments, cells_dir)
        results = {
            e.name: summarise_probe(e, records) if isinstance(e, Probe) else summarise(e, records) for e in experiments
        }
        outcomes = {claim.id: judge(claim, results) for claim in PAPERS[paper].CLAIMS}
        run_info = {
            "command": command_line(args),
            "ran": len(summary.ran),
            "cached": len(summary.cached),
            "failed": len(summary.failed),
            "skipped": len(summary.skipped),
            "wall_s": summary.wall_s,
            "jobs": args.jobs,
            "devices": sorted({r["device"] for r in records.values()}),
            "failures": summary.failed,
        }
        from .report import write_report

        report = write_report(os.path.join(args.out, paper), PAPERS[paper], args.scale, results, outcomes, run_info)
        verdicts = ", ".join(f"{cid} {o.verdict}" for cid, o in outcomes.items())
        print(f"wrote {report}: {verdicts}")
    print(f"attnkit reproduce: {time.time() - t0:.0f} s", file=sys.stderr)
    return 1 if failed else 0
