"""Plots of training runs from their folders' ``metrics.jsonl``: the task's metric against step, from the
evaluations during training (a panel per test set, or their mean when there are many), beside the training loss.

The figures are titled, the legend sits outside the panels, fractions read as percents on linear axes, and loss
and perplexity get a log axis with plain-number labels when they span a decade (a linear one otherwise).
``run_figure`` builds the ``matplotlib.figure.Figure`` (no pyplot state); ``plot_runs`` builds and saves it.
"""

from __future__ import annotations

import json
import os

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator, PercentFormatter

from ..registry import FRACTION_METRICS
from ..train.progress import MAX_SETS_SHOWN, headline_metric

MEAN = "mean"  # the panel of the mean over many test sets
LOG_SPAN = 10.0  # a number axis is logarithmic when its values span this factor


def read_metrics(run_dir: str) -> list[dict]:
    """The events of ``<run_dir>/metrics.jsonl``, in order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_metrics(event: dict) -> dict[str, dict[str, float]]:
    """``{test set: {metric: value}}`` of an ``"eval"`` event."""
    return {k: v for k, v in event.items() if isinstance(v, dict)}


def eval_series(events: list[dict], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """``{test set: (steps, values)}`` of ``metric`` over the eval events, and the mean over the sets under
    ``"mean"`` when there are more than ``MAX_SETS_SHOWN`` sets."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for event in events:
        if event.get("event") != "eval":
            continue
        values = {s: m[metric] for s, m in eval_metrics(event).items() if metric in m}
        if len(values) > MAX_SETS_SHOWN:
            values = {MEAN: float(np.mean(list(values.values())))}
        for set_name, value in values.items():
            steps, ys = series.setdefault(set_name, ([], []))
            steps.append(event["step"])
            ys.append(value)
    return series


def _plain(value: float) -> str:
    return np.format_float_positional(value, precision=4, trim="-")


class PlainLogFormatter(LogFormatter):
    """Labels the ticks that ``LogFormatter`` labels, as plain numbers (0.7, 2, 300) instead of ``7×10⁻¹``."""

    def __call__(self, x: float, pos: int | None = None) -> str:
        return _plain(x) if super().__call__(x, pos) else ""


def _number_axis(ax: Axes, values: list[float]) -> None:
    """A log axis with plain labels when ``values`` span a decade or more, a linear one otherwise (where a log
    axis would show a tick or two)."""
    positive = [v for v in values if v > 0 and np.isfinite(v)]
    if positive and max(positive) >= LOG_SPAN * min(positive):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def run_figure(
    runs: dict[str, str],
    title: str,
    published: dict[str, dict[str, float]] | None = None,
    published_note: str = "published",
    loss_panel: bool = True,
) -> Figure:
    """The figure of ``{label: run folder}``: the headline metric per test set against step, and the loss.

    The title is ``"<title>: <metric> during training"``.

    ``published``: ``{label: {test set: value}}`` drawn as dashed lines in the run's colour, labelled
    ``"<label> (<published_note>)"``.
    """
    events = {label: read_metrics(run_dir) for label, run_dir in runs.items()}
    evals = [eval_metrics(e) for run in events.values() for e in run if e.get("event") == "eval"]
    metric = headline_metric(name for ev in evals for values in ev.values() for name in values)
    series = {label: eval_series(run, metric) for label, run in events.items()} if metric else {}
    sets = list(dict.fromkeys(s for run in series.values() for s in run))
    n = len(sets) + loss_panel
    fig = Figure(figsize=(3.6 * max(n, 1) + 1.8, 3.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, max(n, 1), squeeze=False)[0])
    colors = {label: f"C{i}" for i, label in enumerate(runs)}
    fraction = metric in FRACTION_METRICS
    for ax, set_name in zip(axes, sets):
        for label, run in series.items():
            if set_name in run:
                ax.plot(*run[set_name], marker="o", markersize=3, color=colors[label], label=label)
        for label, values in (published or {}).items():
            if set_name in values:
                note = f"{label} ({published_note})"
                ax.axhline(values[set_name], linestyle="--", linewidth=1.2, color=colors.get(label, "k"), label=note)
        name = f"mean of the test sets' {metric}" if set_name == MEAN else f"{set_name}"
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(metric.replace("_", " "))
        if fraction:
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))
            ax.set_ylim(bottom=0.0)
        else:
            _number_axis(ax, [v for run in series.values() for v in run.get(set_name, ([], []))[1]])
    if loss_panel:
        ax = axes[len(sets)]
        losses = []
        for label, run in events.items():
            train = [e for e in run if e.get("event") == "train"]
            losses += [e["loss"] for e in train]
            ax.plot([e["step"] for e in train], [e["loss"] for e in train], color=colors[label], label=label)
        ax.set_title("training loss", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        _number_axis(ax, losses)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=9)
    fig.suptitle(f"{title}: {metric.replace('_', ' ')} during training" if metric else title)
    return fig


def save_figure(fig: Figure, path: str) -> str:
    """Write ``fig`` as a PNG at ``path`` (parent folders created); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_runs(runs: dict[str, str], path: str, title: str, **options) -> str:
    """``run_figure(runs, title, **options)`` saved at ``path``; returns ``path``."""
    return save_figure(run_figure(runs, title, **options), path)
