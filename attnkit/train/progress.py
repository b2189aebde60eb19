"""What a run shows a person while it trains: a header line, the steps' progress and every evaluation.

On a terminal, tqdm bars on stderr: one of the steps, with the loss, learning rate and ETA, and one of each
evaluation's batches. Anywhere else (a CI log, a file) plain lines instead, one every ``log_every`` steps and one
per evaluation, so a log holds no carriage-return updates. Only rank 0 shows anything, and ``quiet`` silences all
of it. Every line starts with the run's label (task, mixer, learning rate, seed), so the runs of a sweep can be
told apart. Results go elsewhere: to the run folder, and to stdout through the command line's tables.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch
from tqdm import tqdm

from ..registry import FRACTION_METRICS, HEADLINE_METRICS

MAX_SETS_SHOWN = 4  # more test sets than this are summarised by their mean


def run_label(config: Any) -> str:
    """``"flipflop path lr=0.003 seed=0"``: what tells a run from the others of a sweep (a ``TrainConfig``)."""
    mixer = config.mixer if isinstance(config.mixer, str) else "+".join(config.mixer)
    return f"{config.task} {mixer} lr={config.lr:g} seed={config.seed}"


def headline_metric(names: Iterable[str]) -> str | None:
    """The metric that matters among the metric ``names`` a task reports: the first of ``HEADLINE_METRICS``."""
    names = set(names)
    return next((name for name in HEADLINE_METRICS if name in names), None)


def format_metric(name: str, value: float) -> str:
    """A fraction metric (error, accuracy) as a percent, any other (loss, perplexity) as a number."""
    return f"{100 * value:.2f}%" if name in FRACTION_METRICS else f"{value:.4f}"


def headline_values(metrics: dict[str, dict[str, float]]) -> tuple[str | None, dict[str, float]]:
    """The headline metric of ``{set: {metric: value}}`` and its value per set, or ``{"mean of N sets": mean}``
    when there are more than ``MAX_SETS_SHOWN`` sets."""
    name = headline_metric(n for values in metrics.values() for n in values)
    values = {s: m[name] for s, m in metrics.items() if name in m}
    if len(values) > MAX_SETS_SHOWN:
        values = {f"mean of {len(values)} sets": sum(values.values()) / len(values)}
    return name, values


def summarize_metrics(metrics: dict[str, dict[str, float]]) -> str:
    """``"read_error in_distribution 0.00%, sparse 1.20%, dense 0.00%"``: see ``headline_values``."""
    name, values = headline_values(metrics)
    if name is None:
        return ", ".join(f"{s}: {v}" for s, v in metrics.items())
    return f"{name} " + ", ".join(f"{s} {format_metric(name, v)}" for s, v in values.items())


def format_profile(profile: dict[str, float], timings: dict[str, float], steps: int) -> str:
    step_time = max(sum(v for k, v in timings.items() if k != "eval"), 1e-9)
    return (
        f"profile: {steps} steps, {100 * profile['outside_forward_backward']:.1f}% of step time outside "
        f"forward+backward (data+log+checkpoint {100 * profile['data_log_checkpoint']:.1f}%, optimizer "
        f"{100 * timings['optimizer'] / step_time:.1f}%); eval {timings['eval']:.2f}s not counted"
    )


def _backend(model: torch.nn.Module, device: torch.device) -> str:
    backend = getattr(getattr(model, "config", None), "backend", "auto")
    if backend == "auto":
        return "auto (PyTorch on CPU)" if device.type == "cpu" else "auto (Triton kernels where the mixer has them)"
    return backend


class RunProgress:
    """The progress of one training run on ``stream`` (stderr); silent when ``enabled`` is False.

    ``bars`` chooses tqdm bars (default: when ``stream`` is a terminal) over plain lines.
    """

    def __init__(
        self,
        config: Any,
        start_step: int,
        end_step: int,
        enabled: bool = True,
        stream: IO[str] | None = None,
        bars: bool | None = None,
    ) -> None:
        self.label = run_label(config)
        self.config, self.enabled = config, enabled
        self.stream = sys.stderr if stream is None else stream
        self.bars = enabled and (self.stream.isatty() if bars is None else bars)
        self.start_step, self.end_step = start_step, end_step
        self._t0 = time.perf_counter()
        self._bar: tqdm | None = None
        self._eval_s = 0.0  # seconds spent evaluating, left out of the ETA
        self._last_eval_s = 0.0

    def _print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def header(self, task: Any, model: torch.nn.Module, device: torch.device, precision: str) -> None:
        """One line: task, T, parameter count, device, backend and ``precision`` (e.g. "float32"); then the steps'
        bar starts."""
        params = sum(p.numel() for p in model.parameters())
        where = f"{device.type} ({torch.get_num_threads()} threads)" if device.type == "cpu" else str(device)
        self._print(
            f"[{self.label}] task {task.name}, T={task.seq_len}, {params:,} parameters, {where}, "
            f"backend {_backend(model, device)}, {precision}; steps {self.start_step}->{self.end_step} of "
            f"{self.config.steps}"
        )
        if self.bars:
            self._bar = tqdm(
                total=self.config.steps,
                initial=self.start_step,
                desc=self.label,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                mininterval=0.5,
            )
        self._t0 = time.perf_counter()

    def step(self, done: int, loss: float, lr: float) -> None:
        """After every step: moves the bar and shows the loss and learning rate."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e}", refresh=False)
            self._bar.update(done - self._bar.n)

    def log(self, done: int, loss: float, lr: float, tokens_per_s: float) -> None:
        """At every logged step: a plain line with an ETA (without bars), the throughput on the bar (with)."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss {loss:.4f} lr {lr:.2e} tok/s {tokens_per_s:,.0f}", refresh=False)
            return
        elapsed = time.perf_counter() - self._t0 - self._eval_s
        left = elapsed / max(done - self.start_step, 1) * (self.end_step - done)
        self._print(
            f"[{self.label}] step {done:>6}/{self.config.steps} loss {loss:.4f} lr {lr:.2e} "
            f"tok/s {tokens_per_s:,.0f} eta {tqdm.format_interval(left)}"
        )

    @contextmanager
    def evaluation(self, batches: int) -> Iterator[Callable[[], None]]:
        """Around one evaluation of ``batches`` model calls; yields the callable each call makes (a bar's tick)."""
        bar = None
        if self.bars:
            bar = tqdm(
                total=batches, desc=f"{self.label} eval", unit="batch", file=self.stream, leave=False, mininterval=0.5
            )
        t0 = time.perf_counter()
        try:
            yield (lambda: bar.update()) if bar is not None else (lambda: None)
        finally:
            if bar is not None:
                bar.close()
            self._last_eval_s = time.perf_counter() - t0
            self._eval_s += self._last_eval_s

    def evaluated(self, step: int, metrics: dict[str, dict[str, float]], split: str = "test") -> None:
        """After an evaluation: one line with the split, its headline metric per set and how long it took."""
        took = f"{self._last_eval_s:.1f} s"
        self._print(f"[{self.label}] eval at step {step}, {split} ({took}): {summarize_metrics(metrics)}")

    def close(self) -> None:
        """Ends the steps' bar (later lines, such as the final evaluation's, print plainly)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
