"""``attnkit reproduce``: cells, the learning-rate sweep, the verdict rules, and each paper's smoke scale end to end
(report structure, every claim with a verdict, cells cached and never rerun)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from attnkit.cli import main
from attnkit.experiments.reproduce import cells as cells_mod
from attnkit.experiments.reproduce.command import PAPERS, declared_cells, waiting_count
from attnkit.experiments.reproduce.sweep import Budget, Diverged, Missing, Stat, Sweep, summarise
from attnkit.experiments.reproduce.verdicts import VERDICTS, Claim, judge


def tiny_sweep(**overrides) -> Sweep:
    options = dict(
        name="toy",
        title="toy",
        task="mqar_vla",
        models={"a": {"mixer": "linear"}, "b": {"mixer": "deltanet"}},
        settings={"n2": {"num_kv_pairs": 2}},
        budget=Budget(steps=3, batch_size=4, evals=1),
        lrs=(1e-3, 3e-3, 1e-2),
        seeds=(0, 1),
        metric="accuracy",
        task_options={"test_size": 4, "validation_size": 4},
        arch={"hidden_size": 16, "num_layers": 1, "num_heads": 2},
    )
    options.update(overrides)
    return Sweep(**options)


def fake_record(val: float, test: float, loss: float = 1.0, status: str = "ok") -> dict:
    result = {"status": status, "final_loss": loss, "events": [], "variants": {}}
    if status == "ok":
        result.update(validation={"validation": {"accuracy": val}}, test={"n2": {"accuracy": test}})
    return {"result": result, "wall_s": 1.0}


def test_sweep_declarations_keep_the_budget_the_same_for_every_model():
    with pytest.raises(ValueError, match="at least 3 learning rates"):
        tiny_sweep(lrs=(1e-3, 1e-2))
    with pytest.raises(ValueError, match="budget is the sweep's"):
        tiny_sweep(models={"a": {"mixer": "linear", "steps": 10}})
    sweep = tiny_sweep()
    configs = [c.params["config"] for c in sweep.cells()]
    assert len(configs) == 2 * 3 * 2
    budget = {(c["steps"], c["batch_size"], c["warmup_steps"], c["eval_every"]) for c in configs}
    assert budget == {(3, 4, 1, 3)}
    assert len({c.key for c in sweep.cells()}) == len(configs)
    # a cell's key is its definition: another budget is another cell
    other = tiny_sweep(budget=Budget(steps=4, batch_size=4, evals=1)).cells()
    assert not {c.key for c in other} & {c.key for c in sweep.cells()}


def test_summarise_picks_the_best_validation_lr_and_reports_its_test_metric():
    sweep = tiny_sweep()
    records = {}
    # model a: lr 3e-3 best on validation (though 1e-2 is best on test: the test split must not choose)
    for lr, (val, test) in {1e-3: (0.2, 0.2), 3e-3: (0.8, 0.5), 1e-2: (0.6, 0.9)}.items():
        for seed, shift in ((0, 0.0), (1, 0.1)):
            records[sweep.cell("a", "n2", lr, seed).name] = fake_record(val + shift, test + shift)
    # model b: a tie on validation goes to the lower training loss; one diverged lr scores worst
    for lr, loss in {1e-3: 2.0, 3e-3: 1.0}.items():
        for seed in (0, 1):
            records[sweep.cell("b", "n2", lr, seed).name] = fake_record(0.5, loss / 10, loss)
    records[sweep.cell("b", "n2", 1e-2, 0).name] = fake_record(0, 0, status="diverged")
    records[sweep.cell("b", "n2", 1e-2, 1).name] = fake_record(0.99, 0.99)
    result = summarise(sweep, records)
    a, b = result.choice("a", "n2"), result.choice("b", "n2")
    assert a.lr == 3e-3 and a.scores[3e-3] == pytest.approx(0.85)
    assert result.stat("a", "n2").mean == pytest.approx(0.55) and result.stat("a", "n2").n == 2
    assert result.stat("a", "n2").spread == pytest.approx(0.1 / 2**0.5)
    assert b.lr == 3e-3 and b.diverged == [1e-2]
    assert result.finished == result.total == 12

    del records[sweep.cell("a", "n2", 1e-2, 1).name]
    partial = summarise(sweep, records)
    assert partial.finished == 11 and partial.choices[("a", "n2")].lr is None
    with pytest.raises(Missing, match="1 of 3 learning rates"):
        partial.stat("a", "n2")
    with pytest.raises(Missing, match="not run at this scale"):
        partial.stat("a", "n64")
    for lr in sweep.lrs:
        for seed in sweep.seeds:
            records[sweep.cell("a", "n2", lr, seed).name] = fake_record(0, 0, status="diverged")
    with pytest.raises(Diverged):
        summarise(sweep, records).stat("a", "n2")


def test_judge_applies_the_shared_rules():
    sweep = tiny_sweep()

    class Result:
        def __init__(self, seeds):
            self.sweep = tiny_sweep(seeds=seeds)

    def decided(results):
        return "CONFIRMED", "it holds", "a 1 ± 0"

    claim = Claim("X", "x", "1", "rule", ("toy",), decided)
    assert judge(claim, {"toy": Result((0, 1))}).verdict == "CONFIRMED"
    one_seed = judge(claim, {"toy": Result((0,))})
    assert one_seed.verdict == "INCONCLUSIVE" and "CONFIRMED" in one_seed.reason
    assert judge(Claim("X", "x", "1", "rule", ("toy",), decided, trained=False), {"toy": Result((0,))}).verdict == (
        "CONFIRMED"
    )
    assert judge(claim, {}).verdict == "NOT RUN"

    def missing(results):
        raise Missing("cells pending")

    def diverged(results):
        raise Diverged("every learning rate diverged")

    outcome = judge(Claim("Y", "y", "1", "rule", ("toy",), missing), {"toy": sweep})
    assert (outcome.verdict, outcome.reason) == ("NOT RUN", "cells pending")
    assert judge(Claim("D", "d", "1", "rule", ("toy",), diverged), {"toy": sweep}).verdict == "INCONCLUSIVE"
    assert judge(Claim("Z", "z", "1", "rule", not_run="no op"), {}).reason == "no op"
    with pytest.raises(ValueError, match="not_run"):
        Claim("W", "w", "1", "rule")
    assert str(Stat(0.5, 0.01, 2)) == "0.5 ± 0.01"


def test_run_cells_caches_and_never_reruns(tmp_path):
    sweep = tiny_sweep(seeds=(0,), models={"a": {"mixer": "linear"}})
    cells = sweep.cells()
    lines = []
    first = cells_mod.run_cells(cells[:2], str(tmp_path), log=lines.append)
    assert sorted(first.ran) == sorted(c.name for c in cells[:2]) and not first.failed
    record = cells_mod.load_cell(str(tmp_path), cells[0])
    assert record["result"]["status"] == "ok" and record["params"] == cells[0].params
    assert set(record["result"]["validation"]) == {"validation"} and set(record["result"]["test"]) == {"n2"}
    stamps = {c.name: os.path.getmtime(cells_mod.cell_path(str(tmp_path), c)) for c in cells[:2]}
    again = cells_mod.run_cells(cells, str(tmp_path), deadline=time.time() - 1, log=lines.append)
    assert sorted(again.cached) == sorted(stamps) and again.skipped == [cells[2].name] and not again.ran
    assert {c: os.path.getmtime(cells_mod.cell_path(str(tmp_path), cells[i])) for i, c in enumerate(stamps)} == stamps
    with open(cells_mod.cell_path(str(tmp_path), cells[2]), "w") as f:
        json.dump({"cell": {"key": "another"}}, f)
    with pytest.raises(ValueError, match="holds another cell"):
        cells_mod.run_cells(cells, str(tmp_path))
    with pytest.raises(ValueError, match="jobs"):
        cells_mod.run_cells(cells, str(tmp_path), jobs=0)


def test_identical_cells_of_two_experiments_run_once_and_share_the_record(tmp_path):
    """A cell whose definition (kind and params) is another experiment's reads that one's record: both pending, one
    runs; a cell of another definition (another lr), or one that keeps its model, never takes it."""
    one = tiny_sweep(seeds=(0,), lrs=(1e-3, 3e-3, 1e-2), models={"a": {"mixer": "linear"}}).cells()
    two = tiny_sweep(name="twin", seeds=(0,), lrs=(1e-3, 3e-3, 1e-2), models={"a": {"mixer": "linear"}}).cells()
    assert [c.key for c in one] == [c.key for c in two] and one[0].name != two[0].name
    lines = []
    summary = cells_mod.run_cells([one[0], two[0], two[1]], str(tmp_path), log=lines.append)
    assert summary.ran == [one[0].name, two[1].name, two[0].name] and not summary.cached and not summary.failed
    assert not os.path.exists(cells_mod.cell_path(str(tmp_path), two[0]))
    shared = cells_mod.load_cell(str(tmp_path), two[0])
    assert shared == cells_mod.load_cell(str(tmp_path), one[0]) and cells_mod.is_finished(str(tmp_path), two[0])
    assert cells_mod.load_cell(str(tmp_path), one[1]) == cells_mod.load_cell(str(tmp_path), two[1])
    assert cells_mod.load_cell(str(tmp_path), one[2]) is None  # another lr: another definition, not run
    again = cells_mod.run_cells(two[:2], str(tmp_path), log=lines.append)
    assert sorted(again.cached) == sorted(c.name for c in two[:2]) and not again.ran
    kept = cells_mod.Cell(two[0].experiment, two[0].label, two[0].kind, two[0].params, keep=True)
    assert kept.key == one[0].key and cells_mod.load_cell(str(tmp_path), kept) is None
    # a file named with the key whose record is another definition is not taken
    forged = cells_mod.load_cell(str(tmp_path), two[1])
    forged = {**forged, "params": {**forged["params"], "seed": 99}}
    os.remove(cells_mod.cell_path(str(tmp_path), two[1]))
    with open(os.path.join(str(tmp_path), f"other-{two[1].key}.json"), "w") as f:
        json.dump(forged, f)
    assert cells_mod.load_cell(str(tmp_path), two[1]) is None


def test_run_cells_starts_no_cell_its_siblings_say_will_not_finish(tmp_path):
    """``stop_at``: a cell whose finished siblings (same model and setting, another learning rate or seed) took longer
    than what is left is skipped, with its children; a cell with no finished sibling takes its experiment's longest
    time (another model's here) instead, and one whose experiment has no finished cell still runs; the siblings run
    when enough time is left."""
    models = {"a": {"mixer": "linear"}, "b": {"mixer": "deltanet"}, "c": {"mixer": "vla"}}
    cells = tiny_sweep(seeds=(0,), lrs=(1e-3, 3e-3, 1e-2), models=models).cells()
    a, b, c = ([x for x in cells if x.label.startswith(f"{m} ")] for m in "abc")
    other = tiny_sweep(name="other", seeds=(0,), lrs=(1e-3, 3e-3, 1e-2), models={"d": {"mixer": "rope"}}).cells()
    assert cells_mod.sibling_key(a[0]) == cells_mod.sibling_key(a[1]) != cells_mod.sibling_key(b[0])
    cells_mod.run_cells([a[0], b[0]], str(tmp_path))
    path = cells_mod.cell_path(str(tmp_path), a[0])
    with open(path) as f:
        record = json.load(f)
    record["wall_s"] = 1000.0  # a sibling that took longer than the 100 s left
    with open(path, "w") as f:
        json.dump(record, f)
    todo = [a[0], b[0], a[1], b[1], c[0], other[0]]  # the finished ones' records give the times
    summary = cells_mod.run_cells(todo, str(tmp_path), stop_at=time.time() + 100, log=lambda line: None)
    assert summary.cached == [a[0].name, b[0].name]
    assert sorted(summary.skipped) == sorted([a[1].name, c[0].name])  # its sibling's time; its experiment's
    assert sorted(summary.ran) == sorted([b[1].name, other[0].name])  # b's own sibling was quick; none finished
    summary = cells_mod.run_cells(a[:2], str(tmp_path), stop_at=time.time() + 2000, log=lambda line: None)
    assert summary.ran == [a[1].name] and not summary.skipped


def claims_table(report: str) -> dict[str, str]:
    """``{claim id: verdict cell}`` from the claims table of report.md."""
    section = report.split("## Claims", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| id")]
    return {row.split(" | ")[0][2:]: row.rsplit(" | ", 1)[1].rstrip(" |") for row in rows}


DECIDED_AT_SMOKE = {
    "path": ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8"),
    "tapa": ("T1", "T2", "T3", "T4", "T5"),
    "vla": tuple(f"V{i}" for i in range(1, 11)),
}


@pytest.mark.parametrize("paper", list(PAPERS))
def test_smoke_scale_writes_a_complete_report_and_resumes_without_rerunning(paper, tmp_path, capsys):
    args = ["reproduce", paper, "--scale", "smoke", "--out", str(tmp_path), "--jobs", "2"]
    t0 = time.perf_counter()
    assert main(args) == 0
    wall = time.perf_counter() - t0
    folder = tmp_path / paper
    report = (folder / "report.md").read_text()
    data = json.loads((folder / "report.json").read_text())
    module = PAPERS[paper]
    table = claims_table(report)
    assert list(table) == [c.id for c in module.CLAIMS]
    for claim in data["claims"]:
        verdict = re.match(r"\*\*([A-Z ]+)\*\*: (.+)", table[claim["id"]])
        assert verdict and verdict.group(1) == claim["verdict"] in VERDICTS, table[claim["id"]]
        assert claim["reason"] and verdict.group(2).startswith(claim["reason"][:20].replace("|", "\\|"))
        assert claim["published"] and claim["criterion"]
        if claim["verdict"] != "NOT RUN":
            assert claim["ours"] != "—"
    verdicts = {c["id"]: c["verdict"] for c in data["claims"]}
    # claims whose experiments exist run at smoke scale: stick-breaking (PaTH P4), Proposition 2 (VLA V10), the
    # chained ones (TAPA T1, PaTH P8) and retrieval with variable tracking (PaTH P7)
    assert all(verdicts[i] != "NOT RUN" for i in DECIDED_AT_SMOKE[paper]), verdicts
    if paper == "vla":  # random inputs, no training: the norm of I − α̂ k̂ᵀ exceeds 1 while its radius is 1
        v10 = next(c for c in data["claims"] if c["id"] == "V10")
        assert v10["verdict"] == "REFUTED" and "radius" in v10["ours"], v10
    # every declared cell finished and is cached (the chained ones too); every plot the report links exists
    declared, records = declared_cells(module.experiments("smoke"), str(folder / "cells"))
    assert waiting_count(module.experiments("smoke"), declared, records) == 0
    assert all(cells_mod.is_finished(str(folder / "cells"), c) for c in declared)
    assert data["run"]["ran"] == len(declared) and data["run"]["failed"] == 0
    for png in re.findall(r"!\[[^]]*\]\(([^)]+)\)", report):
        assert (folder / png).stat().st_size > 0
    assert "## Run" in report and data["environment"]["commit"]
    assert all(f"### {e.name}" in report for e in module.experiments("smoke"))
    print(f"{paper} smoke: {wall:.0f} s")

    stamps = {p: p.stat().st_mtime for p in (folder / "cells").iterdir()}
    assert main(args) == 2  # a folder with finished cells needs --resume
    assert "--resume" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    again = json.loads((folder / "report.json").read_text())
    assert again["run"]["ran"] == 0 and again["run"]["cached"] == len(declared)
    assert {p: p.stat().st_mtime for p in (folder / "cells").iterdir()} == stamps
    assert [c["verdict"] for c in again["claims"]] == [c["verdict"] for c in data["claims"]]


def test_jobs_default_to_one_single_threaded_process_per_core_on_a_cpu(tmp_path, capsys):
    from attnkit.experiments.reproduce.command import AUTO_JOBS, default_jobs

    assert default_jobs("cpu") == min(cells_mod.cpu_count(), AUTO_JOBS) >= 1
    assert main(["reproduce", "vla", "--out", str(tmp_path), "--jobs", "-1"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_a_partial_full_run_reports_its_finished_cells_and_the_rest_as_not_run(tmp_path):
    """What a GPU call that its time limit killed leaves (``run_gpu.sh reproduce``): some cells' records and no
    report. ``--report-only`` writes the report from them and runs nothing."""
    module = PAPERS["vla"]
    cells_dir = str(tmp_path / "vla" / "cells")
    declared, _ = declared_cells(module.experiments("full"), cells_dir)
    finished = [c for c in declared if c.experiment == "mqar" and " n4 " in c.label]
    finished.append(next(c for c in declared if c.experiment == "state_norm"))
    for cell in finished:
        if cell.kind == "train":
            curve = [{"event": "eval", "split": "validation", "step": 4000, "validation": {"accuracy": 0.95}}]
            result = fake_record(0.95, 0.97)["result"] | {"test": {"n4": {"accuracy": 0.97}}, "events": curve}
        else:
            norms = {m: {str(t): float(t) for t in cell.params["lengths"]} for m in cell.params["mixers"]}
            result = {"status": "ok", "norms": norms}
        identity = {"experiment": cell.experiment, "label": cell.label, "kind": cell.kind, "key": cell.key}
        record = {"cell": identity, "params": cell.params, "result": result, "wall_s": 60.0, "device": "NVIDIA H200"}
        cells_mod._write_atomic(cells_mod.cell_path(cells_dir, cell), record)

    args = ["reproduce", "vla", "--scale", "full", "--out", str(tmp_path), "--jobs", "2"]
    assert main([*args, "--report-only"]) == 0
    assert len(os.listdir(cells_dir)) == len(finished)  # nothing ran
    data = json.loads((tmp_path / "vla" / "report.json").read_text())
    assert (data["run"]["ran"], data["run"]["cached"]) == (0, len(finished))
    assert data["run"]["skipped"] == len(declared) - len(finished)
    report = (tmp_path / "vla" / "report.md").read_text()
    table = claims_table(report)
    assert all(verdict.startswith("**NOT RUN**: ") and "not run" in verdict for verdict in table.values()), table
    assert "| vla | n4 | 0.95 | 0.95 | 0.95 | 0.95 | 0.0003 | n4 0.97 ± 0 |" in report
    assert "| vla | n8 | pending | pending | pending | pending | — | — |" in report
    assert "1 of 3 finished" in report and f"{len(declared) - len(finished)} left for later" in report
    assert "cell devices: NVIDIA H200" in report
    assert data["run"]["command"].endswith("--jobs 2 --report-only")  # the invocation that wrote it, not a run
    for png in re.findall(r"!\[[^]]*\]\(([^)]+)\)", report):
        assert (tmp_path / "vla" / png).stat().st_size > 0
