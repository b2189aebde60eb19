"""The plots of runs (attnkit.experiments.plots): read back from the Figure they are drawn on, not from pixels."""

from __future__ import annotations

import json

import pytest

from attnkit.experiments import demo
from attnkit.experiments.plots import plot_runs, run_figure

FLIPFLOP = {  # step -> {set: read_error}
    10: {"in_distribution": 0.30, "sparse": 0.45, "dense": 0.05},
    20: {"in_distribution": 0.10, "sparse": 0.20, "dense": 0.01},
    30: {"in_distribution": 0.00, "sparse": 0.01, "dense": 0.00},
}


def _run_folder(path, evals, losses, metric="read_error"):
    """A run folder whose metrics.jsonl holds ``losses`` ({step: loss}) and ``evals`` ({step: {set: value}})."""
    path.mkdir(parents=True)
    events = [{"event": "train", "step": s, "loss": v, "lr": 1e-3, "grad_norm": 1.0} for s, v in losses.items()]
    events += [
        {"event": "eval", "step": s, **{k: {metric: v, "other": 0.5} for k, v in sets.items()}}
        for s, sets in evals.items()
    ]
    events.sort(key=lambda e: e["step"])
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(path)


@pytest.fixture
def runs(tmp_path):
    worse = {s: {k: min(v * 2 + 0.05, 1.0) for k, v in sets.items()} for s, sets in FLIPFLOP.items()}
    return {
        "path": _run_folder(tmp_path / "path", FLIPFLOP, {5: 1.2, 10: 0.9, 20: 0.7, 30: 0.65}),
        "rope": _run_folder(tmp_path / "rope", worse, {5: 1.3, 10: 0.95, 20: 0.7, 30: 0.64}),
    }


def _labels(ax, minor=False):
    return [t.get_text() for t in (ax.get_yticklabels(minor=minor)) if t.get_text()]


def _overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_metric_per_test_set_beside_the_loss(runs):
    fig = run_figure(runs, "flipflop")
    fig.canvas.draw()
    assert fig._suptitle.get_text() == "flipflop: read error during training"
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["in_distribution", "sparse", "dense", "training loss"]
    for ax, set_name in zip(axes, ["in_distribution", "sparse", "dense"]):
        path, rope = ax.get_lines()
        assert list(path.get_xdata()) == [10, 20, 30]
        assert list(path.get_ydata()) == [FLIPFLOP[s][set_name] for s in (10, 20, 30)]
        assert rope.get_label() == "rope" and rope.get_color() != path.get_color()
        assert ax.get_yscale() == "linear" and ax.get_ylim()[0] == 0.0
        assert _labels(ax) and all(label.endswith("%") for label in _labels(ax))
    loss = axes[3].get_lines()[0]
    assert list(loss.get_xdata()) == [5, 10, 20, 30] and list(loss.get_ydata()) == [1.2, 0.9, 0.7, 0.65]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["path", "rope"]
    box = legend.get_window_extent()
    assert not any(_overlaps(box, ax.get_window_extent()) for ax in axes)  # outside the data


def test_log_axes_read_as_plain_numbers(tmp_path):
    evals = {10: {"test": 300.0}, 20: {"test": 40.0}, 30: {"test": 2.5}}
    run = _run_folder(tmp_path / "lm", evals, {10: 6.0, 20: 3.5, 30: 0.3}, metric="perplexity")
    fig = run_figure({"lm": run}, "lm")
    fig.canvas.draw()
    assert fig._suptitle.get_text() == "lm: perplexity during training"
    for ax in fig.axes:
        assert ax.get_yscale() == "log"
        labels = _labels(ax) + _labels(ax, minor=True)
        assert labels and all(label.replace(".", "").isdigit() for label in labels), labels
    assert {"1", "10", "100"} <= set(_labels(fig.axes[0]))
    assert "0.3" in _labels(fig.axes[1]) + _labels(fig.axes[1], minor=True)


def test_a_loss_within_a_decade_gets_a_linear_axis(runs):
    fig = run_figure(runs, "flipflop")
    assert fig.axes[-1].get_yscale() == "linear"


def test_many_test_sets_are_plotted_as_their_mean(tmp_path):
    evals = {s: {f"L{i}": i / 10 + s / 100 for i in range(6)} for s in (10, 20)}
    run = _run_folder(tmp_path / "pk", evals, {10: 1.0, 20: 0.5}, metric="exact_match")
    fig = run_figure({"pk": run}, "passkey", loss_panel=False)
    (ax,) = fig.axes
    assert ax.get_title() == "mean of the test sets' exact_match"
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.35, 0.45])


def test_the_demo_plot_puts_the_published_numbers_beside_ours(runs, tmp_path):
    setting = {"seq_len": 64, "steps": 30}
    png = plot_runs(
        runs,
        str(tmp_path / "demo.png"),
        title=demo.plot_title(setting),
        published=demo.published_fractions(["path", "rope"]),
        published_note="published, T=512",
    )
    assert (tmp_path / "demo.png").stat().st_size > 0 and png == str(tmp_path / "demo.png")
    fig = run_figure(runs, demo.plot_title(setting), published=demo.published_fractions(["path", "rope"]))
    assert fig._suptitle.get_text().startswith("Flip-flop, ours (T=64, 30 steps) against PaTH Table 1 (T=512)")
    for ax, i in zip(fig.axes, range(3)):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines) == {"path", "rope", "path (published)", "rope (published)"}
        assert lines["rope (published)"].get_ydata()[0] == pytest.approx(demo.PUBLISHED["rope"][i] / 100)
        assert lines["rope (published)"].get_linestyle() == "--"
        assert lines["rope (published)"].get_color() == lines["rope"].get_color()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "path",
        "rope",
        "path (published)",
        "rope (published)",
    ]
