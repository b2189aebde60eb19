"""The report of ``attnkit reproduce``: its plots, read back from the figures' data (``plot_sweep`` on hand-made sweep
results), and its claims table's rows for the papers' own settings."""

from __future__ import annotations

import pytest

from attnkit.experiments.reproduce import path, report, tapa
from attnkit.experiments.reproduce.sweep import Stat, summarise
from attnkit.experiments.reproduce.verdicts import judge, with_paper_scale

from .test_reproduce import claims_table
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


ORIGINALS = {path: ("P5", "P6", "P7", "P8"), tapa: ("T1", "T2", "T3", "T4")}


@pytest.mark.parametrize("paper", list(ORIGINALS), ids=["path", "tapa"])
def test_each_scaled_down_analog_keeps_the_papers_setting_as_a_not_run_row(paper, tmp_path):
    """Where the paper's setting needs weights or a scale we do not have, the report shows the original claim beside
    its analog, NOT RUN with the reason."""
    outcomes = {claim.id: judge(claim, {}) for claim in paper.CLAIMS}
    run = {"command": "test", "devices": [], "ran": 0, "cached": 0, "failed": 0, "skipped": 0, "wall_s": 0, "jobs": 1}
    text = open(report.write_report(str(tmp_path), paper, "full", {}, outcomes, run)).read()
    table = claims_table(text)
    ids = list(table)
    for analog in ORIGINALS[paper]:
        original = f"{analog}-paper"
        assert ids.index(original) == ids.index(analog) + 1, ids
        assert table[original].startswith("**NOT RUN**: ") and f"the scaled-down analog is {analog}" in table[original]
        assert "GPU" in table[original]
        assert f"- **{original}**: Not run: " in text
    assert sum(claim.decide is None for claim in paper.CLAIMS) == len(ORIGINALS[paper])


def test_paper_scale_rows_name_claims_that_exist():
    with pytest.raises(ValueError, match="not claims here"):
        with_paper_scale(path.ANALOGS, {"P42": ("somewhere", "no reason")})
