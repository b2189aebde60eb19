"""Laddered sweeps (``Sweep.stop_at``): the fewest layers reaching a score, each mixer's depths run shallowest first
and none above the first that reaches it."""

from __future__ import annotations

import pytest

from attnkit.experiments.reproduce import command, path
from attnkit.experiments.reproduce.report import _sweep_section
from attnkit.experiments.reproduce.sweep import Budget, Sweep, summarise
from tests.experiments.test_reproduce_criteria import record

LRS = (1e-3, 3e-3, 1e-2)


def ladder(depths=(1, 2, 3), **kw) -> Sweep:
    return Sweep(
        name="words",
        title="fewest layers",
        task="group_words",
        models={f"{m} {d}L": {"mixer": m, "arch": {"num_layers": d}} for m in ("path", "rope") for d in depths},
        settings={"A5 k8": {"group": "A5", "k": 8}},
        budget=Budget(steps=2, batch_size=2),
        lrs=LRS,
        seeds=(0,),
        metric="sequence_accuracy",
        stop_at=0.9,
        **kw,
    )


def finish(sweep: Sweep, records: dict, cells: list, test: dict[str, float], diverged: bool = False) -> None:
    """Records for ``cells``: the middle learning rate validates best; ``test``: model -> its test score."""
    for cell in cells:
        model, lr = " ".join(cell.label.split()[:2]), cell.params["config"]["lr"]
        rec = record(sweep.metric, 0.5 if lr == LRS[1] else 0.1, {"test": test[model]})
        if diverged:
            rec["result"]["status"] = "diverged"
        records[cell.name] = rec


def test_depths_run_only_until_one_reaches_the_score():
    sweep, records = ladder(), {}
    cells = sweep.cells(records)
    assert sorted({" ".join(c.label.split()[:2]) for c in cells}) == ["path 1L", "rope 1L"]
    assert summarise(sweep, records).choices[("path 2L", "A5 k8")].waiting
    finish(sweep, records, cells, {"path 1L": 0.5, "rope 1L": 0.1})
    new = [c for c in sweep.cells(records) if c.name not in records]
    assert sorted({" ".join(c.label.split()[:2]) for c in new}) == ["path 2L", "rope 2L"]
    finish(sweep, records, new, {"path 2L": 0.95, "rope 2L": 0.2})
    new = [c for c in sweep.cells(records) if c.name not in records]
    assert {" ".join(c.label.split()[:2]) for c in new} == {"rope 3L"} and len(new) == len(LRS)
    finish(sweep, records, new, {"rope 3L": 0.3})
    assert all(c.name in records for c in sweep.cells(records))

    result = summarise(sweep, records)
    above = result.choices[("path 3L", "A5 k8")]
    assert above.not_needed.startswith("not needed: path 2L reached sequence_accuracy 0.95")
    assert result.total == result.finished == 5 * len(LRS)  # the depth not needed is not counted
    assert path._fewest_layers(result, "path", "A5 k8") == 2
    assert path._fewest_layers(result, "rope", "A5 k8") is None
    section = "\n".join(_sweep_section(result, []))
    assert "| path 3L | A5 k8 | — | — | — | — | not needed: path 2L" in section and "Laddered:" in section


def test_a_depth_that_diverged_everywhere_falls_short():
    sweep, records = ladder(depths=(1, 2)), {}
    finish(sweep, records, sweep.cells(records), {"path 1L": 0.0, "rope 1L": 0.0}, diverged=True)
    assert {" ".join(c.label.split()[:2]) for c in sweep.cells(records) if c.name not in records} == {
        "path 2L",
        "rope 2L",
    }


def test_declared_cells_declares_a_ladder_from_its_own_records(monkeypatch):
    """The command declares a laddered experiment until its own finished cells declare no more."""
    sweep, store = ladder(), {}
    finish(sweep, store, sweep.cells({}), {"path 1L": 0.95, "rope 1L": 0.1})
    monkeypatch.setattr(command, "load_cell", lambda cells_dir, cell: store.get(cell.name))
    cells, records = command.declared_cells([sweep], "unused")
    labels = {" ".join(c.label.split()[:2]) for c in cells}
    assert labels == {"path 1L", "rope 1L", "rope 2L"} and len(records) == 2 * len(LRS)
    assert command.waiting_count([sweep], cells, records) == len(LRS)  # rope 3L waits for rope 2L


def test_ladders_are_declared_shallowest_first():
    with pytest.raises(ValueError, match="stop_at: the rungs of a ladder are declared shallowest first"):
        ladder(depths=(2, 1))
