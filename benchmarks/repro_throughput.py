"""How fast `attnkit reproduce` cells train on one GPU, alone and several at once (issue 20's budget).

    python benchmarks/repro_throughput.py CELL [CELL ...] [--steps 300] [--procs 1 8 16] [--profile]
        [--compile] [--cuda-graph] [--out FILE]

Each CELL is a finished cell record (``reports/<paper>/cells/*.json``) or ``PAPER:PATTERN``, the first full-scale
training cell of ``attnkit reproduce PAPER`` whose name matches the fnmatch ``PATTERN`` (``tapa:zero_shot-tapa_*``),
finished or not, so that a paper's cells can be timed before any has run: its training config is rerun for ``--steps``
steps, with no evaluation until the end, in ``P`` processes at once (each on one CPU thread, as ``run_cells`` gives
them), for each ``P`` of ``--procs``; the cells are dealt round-robin to the processes. It prints each process's
milliseconds a step and the steps a second of all of them together, which divides a call's time into cells.
``--profile`` first runs each cell alone under ``torch.profiler`` and prints its CUDA kernels a step and their summed
time a step (the difference of a run of 20 steps and one of 40, so that the run's fixed costs cancel): the GPU's
floor for that step when nothing else shares the GPU (the twenty-fifth session's numbers, from one run of 20 steps,
include the final evaluation's kernels). ``--compile`` trains every config
under ``torch.compile`` (``TrainConfig.compile``; its compile is in the untimed warm-up), ``--cuda-graph`` with its
forward and backward replayed as CUDA graphs (``TrainConfig.cuda_graph``; captured at each run's first step).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _declared(spec: str) -> tuple[str, dict]:
    """``PAPER:PATTERN`` -> the name and params of the first full-scale training cell of ``PAPER`` that matches."""
    import fnmatch

    from attnkit.experiments.reproduce.command import declared, declared_cells

    paper, pattern = spec.split(":", 1)
    with tempfile.TemporaryDirectory(prefix="repro-throughput-") as tmp:
        cells, _ = declared_cells(declared(paper, "full"), tmp)
    for cell in cells:
        if cell.kind == "train" and "config" in cell.params and fnmatch.fnmatch(cell.name, pattern):
            return cell.name, cell.params
    raise SystemExit(f"{spec}: no full-scale training cell of {paper} matches {pattern!r}")


def _config(cell: str, steps: int) -> dict:
    """The training config of ``cell`` (a record's path or ``PAPER:PATTERN``), set to run ``steps`` steps."""
    params = (
        _declared(cell)[1] if ":" in cell and not Path(cell).exists() else json.loads(Path(cell).read_text())["params"]
    )
    config = dict(params["config"])
    config.update(steps=steps, warmup_steps=min(config.get("warmup_steps") or 0, steps), eval_every=10**9)
    config.update(log_every=max(steps // 3, 1), checkpoint_every=0)
    return config


def _train(config: dict, device: str, start=None) -> float:
    """Seconds a step of ``config``: the last third of its steps, after a two-step run that compiles the kernels
    (and the model, under ``compile``) and warms the allocator."""
    import torch

    from attnkit.tasks import get_task
    from attnkit.train import TrainConfig, train

    torch.set_num_threads(1)
    tokens = config["batch_size"] * get_task(config["task"], seed=0, **config.get("task_options", {})).seq_len
    with tempfile.TemporaryDirectory(prefix="repro-throughput-") as tmp:
        warm = TrainConfig(**{**config, "steps": 2, "warmup_steps": 0}, device=device, out=tmp + "/w", quiet=True)
        train(warm)
        if start is not None:
            start.wait()  # every process starts its timed run together
        train(TrainConfig(**config, device=device, out=tmp + "/r", quiet=True))
        with open(tmp + "/r/metrics.jsonl") as f:
            events = [json.loads(line) for line in f if line.strip()]
    last = [e for e in events if e.get("event") == "train"][-1]
    return tokens / last["tokens_per_s"]


def _child(config: dict, device: str, start, queue) -> None:
    try:
        queue.put(("ok", _train(config, device, start)))
    except Exception as err:  # reported by the parent, which goes on with the other counts
        queue.put(("error", f"{type(err).__name__}: {err}"))


def _profile(config: dict, device: str, steps: int = 20) -> dict:
    """CUDA kernels and their summed time a step: runs of ``steps`` and ``2 * steps`` steps profiled, and their
    difference divided by ``steps``, so that the run's fixed costs (its final evaluation, its checkpoint) cancel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from attnkit.train import TrainConfig, train

    _train({**config, "steps": 2}, device)
    counts = []
    for n in (steps, 2 * steps):
        with tempfile.TemporaryDirectory(prefix="repro-throughput-") as tmp:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                train(TrainConfig(**{**config, "steps": n}, device=device, out=tmp + "/p", quiet=True))
                torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        counts.append((len(kernels), sum(e.device_time for e in kernels)))
    (n1, us1), (n2, us2) = counts
    return {"kernels_a_step": (n2 - n1) / steps, "gpu_ms_a_step": (us2 - us1) / steps / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", nargs="+", help="finished cell records (JSON), or PAPER:PATTERN")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile each model")
    parser.add_argument("--cuda-graph", action="store_true", help="forward+backward as CUDA graphs (TrainConfig)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    options = {"compile": args.compile, "cuda_graph": args.cuda_graph}
    configs = [(Path(c).name, {**_config(c, args.steps), **options}) for c in args.cells]
    rows = []
    if args.profile:
        for name, config in configs:
            row = {"cell": name, "procs": 1, **_profile(config, args.device)}
            print(f"{name}: {row['kernels_a_step']:.0f} kernels a step, {row['gpu_ms_a_step']:.2f} GPU ms a step")
            rows.append(row)
    ctx = mp.get_context("spawn")
    for procs in args.procs:
        start, queue = ctx.Barrier(procs), ctx.Queue()
        dealt = [configs[i % len(configs)] for i in range(procs)]
        workers = [ctx.Process(target=_child, args=(c, args.device, start, queue)) for _, c in dealt]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        results = [queue.get() for _ in workers]
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        step_s = [r for status, r in results if status == "ok"]
        errors = [r for status, r in results if status != "ok"]
        row = {
            "procs": procs,
            "cells": [name for name, _ in dealt],
            "ms_a_step": [round(s * 1e3, 3) for s in step_s],
            "steps_a_second_in_all": sum(1 / s for s in step_s),
            "wall_s": wall,
            "errors": errors,
        }
        rows.append(row)
        median = sorted(step_s)[len(step_s) // 2] * 1e3 if step_s else float("nan")
        print(
            f"{procs:3d} processes: median {median:.2f} ms a step, {row['steps_a_second_in_all']:.0f} steps/s "
            f"in all{', errors: ' + '; '.join(errors) if errors else ''}"
        )
    if args.out:
        import torch

        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__,
                    "options": options,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
