"""The report's plots of ``attnkit reproduce``, read back from the saved figures' data (``plot_sweep`` on hand-made
sweep results)."""

from __future__ import annotations

import pytest

from attnkit.experiments.reproduce import path, report, tapa
from attnkit.experiments.reproduce.sweep import Stat, summarise

from .test_reproduce_criteria import fill


def _depth(set_name: str) -> float:
    return float(set_name.split("_d")[1])


def test_by_length_averages_a_passkey_grid_over_its_depths():
    sets = {
        "L64_d0.0": {"exact_match": Stat(1.0, 0, 1)},
        "L64_d0.5": {"exact_match": Stat(0.5, 0, 1)},
        "L256_d0.0": {"exact_match": Stat(0.25, 0, 1)},
        "L256_d1.0": {"exact_match": Stat(0.75, 0, 1)},
    }
    assert report.by_length(sets, "exact_match") == [(64, 0.75), (256, 0.5)]
    lm = {"len128": {"perplexity": Stat(4.0, 0, 1)}, "len64": {"perplexity": Stat(3.0, 0, 1)}}
    assert report.by_length(lm, "perplexity") == [(64, 3.0), (128, 4.0)]


@pytest.mark.parametrize("paper,name", [(path, "multi_needle"), (tapa, "passkey")], ids=["path", "tapa"])
def test_a_passkey_grid_is_plotted_against_its_lengths(paper, name, tmp_path, monkeypatch):
    """Each line's points sit at the haystack lengths (not at the depths the set names end with), at the mean over
    the depth grid."""
    sweep = next(e for e in paper.experiments("smoke") if e.name == name)
    L = next(iter(sweep.settings.values()))["seq_len"]
    records: dict = {}
    fill(sweep, records, lambda model, set_name, seed: (1 - _depth(set_name) / 2) * L / int(set_name[1:].split("_")[0]))
    figures = []
    plt = report._pyplot()
    monkeypatch.setattr(report, "_save", lambda fig, folder, file, plt: figures.append((file, fig)) or file)
    files = report.plot_sweep(summarise(sweep, records), str(tmp_path))
    assert f"{name}_vs_length.png" in files
    fig = dict(figures)[f"{name}_vs_length.png"]
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == list(sweep.models)
    for line in lines:
        assert list(line.get_xdata()) == [L, 2 * L, 4 * L]
        assert list(line.get_ydata()) == pytest.approx([0.75, 0.375, 0.1875])
    plt.close("all")
