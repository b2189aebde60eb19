"""Chained cells: a child starts from its parent's kept weights (continued training, or a RoPE model converted to
PaTH), the parent runs once, the child's key follows the parent's, chained sweeps resolve the parent's learning
rate on validation, and a killed run resumes through the command."""

from __future__ import annotations

import json
import os
import shutil
import types

import pytest
import torch
import torch.nn.functional as F

from attnkit.cli import main
from attnkit.experiments.reproduce import cells as cells_mod
from attnkit.experiments.reproduce import command
from attnkit.experiments.reproduce.sweep import Budget, Missing, Sweep, summarise
from attnkit.experiments.reproduce.verdicts import Claim, fmt
from attnkit.tasks import get_task
from attnkit.train.hf_folder import load_saved_model
from attnkit.train.trainer import TrainConfig, batch_generator, build_model

from .test_reproduce import fake_record, tiny_sweep

TASK_OPTIONS = {"num_kv_pairs": 2, "test_size": 4, "validation_size": 8}


def config(**overrides) -> dict:
    base = dict(task="mqar_vla", task_options=TASK_OPTIONS, mixer="rope", hidden_size=16, num_layers=1, num_heads=2,
                steps=3, batch_size=4, warmup_steps=1, eval_every=3, log_every=1, lr=3e-3, seed=0)  # fmt: skip
    return {**base, **overrides}


def first_batch_loss(model: torch.nn.Module, cfg: dict) -> float:
    """The loss ``model`` gives the first training batch of a run of ``cfg`` (what its step-1 log reports)."""
    task = get_task(cfg["task"], seed=cfg["seed"], **cfg["task_options"])
    x, y = task.sample(cfg["batch_size"], batch_generator(cfg["seed"], 0))
    with torch.no_grad():
        logits = model(input_ids=x, use_cache=False).logits
    return float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100))


def logged_loss(record: dict, step: int = 1) -> float:
    return next(e["loss"] for e in record["result"]["events"] if e["event"] == "train" and e["step"] == step)


def test_a_child_starts_from_its_parents_final_weights_and_the_parent_runs_once(tmp_path):
    cells_dir = str(tmp_path)
    parent = cells_mod.Cell("pre", "rope", "train", {"config": config()}, keep=True)
    child_cfg = config(steps=2)
    child = cells_mod.Cell("cont", "rope", "train", {"config": child_cfg}, parent=parent)
    converted_cfg = config(steps=2, mixer="path")
    converted = cells_mod.Cell(
        "cont", "path", "train", {"config": converted_cfg, "convert": {"mixer": "path"}}, parent=parent
    )
    lines = []
    summary = cells_mod.run_cells([child, converted], cells_dir, log=lines.append)
    # the parent was not asked for, yet ran first, once
    assert summary.ran == [parent.name, child.name, converted.name] and not summary.failed and not summary.cached

    kept = cells_mod.model_dir(cells_dir, parent)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(kept)) and "checkpoint.pt" not in os.listdir(kept)
    parent_record = cells_mod.load_cell(cells_dir, parent)
    assert parent_record["model"] == os.path.relpath(kept, cells_dir)
    # the kept model is the parent's final model: it scores the parent's recorded validation metrics
    model = load_saved_model(kept).eval()
    task = get_task("mqar_vla", seed=0, **TASK_OPTIONS)
    with torch.no_grad():
        metrics = task.evaluate_model(lambda x: model(input_ids=x, use_cache=False).logits, split="validation")
    assert metrics == parent_record["result"]["validation"]

    # the child starts there: its first logged loss is the kept model's loss on that batch, not a fresh model's
    child_record = cells_mod.load_cell(cells_dir, child)
    assert child_record["cell"]["parent"] == {"name": parent.name, "key": parent.key}
    start = first_batch_loss(model, child_cfg)
    assert logged_loss(child_record) == pytest.approx(start, abs=1e-5)
    fresh = build_model(TrainConfig(**child_cfg), task.vocab_size, task.seq_len).eval()
    assert abs(first_batch_loss(fresh, child_cfg) - start) > 1e-3

    # the converted child starts from the RoPE weights with PaTH's own weights fresh
    record = cells_mod.load_cell(cells_dir, converted)["result"]
    assert record["converted"]["mixer"] == "path"
    assert {name.rsplit(".", 2)[-2] for name in record["converted"]["fresh"]} == {
        "beta_proj", "w_conv", "w_down", "w_up"
    }  # fmt: skip
    target = str(tmp_path / "converted")
    fresh_names = cells_mod.convert_model(kept, target, "path", seed=0)
    assert fresh_names == record["converted"]["fresh"]
    path_model = load_saved_model(target).eval()
    shared = {k: v for k, v in model.state_dict().items()}
    for name, value in path_model.state_dict().items():
        if name in fresh_names:
            assert name not in shared
        else:
            assert torch.equal(value, shared[name]), name
    assert logged_loss(cells_mod.load_cell(cells_dir, converted)) == pytest.approx(
        first_batch_loss(path_model, converted_cfg), abs=1e-5
    )

    again = cells_mod.run_cells([child, converted], cells_dir, log=lines.append)
    assert not again.ran and sorted(again.cached) == sorted([child.name, converted.name])


def test_a_childs_key_includes_its_parents_and_parents_must_keep_their_model():
    parent = cells_mod.Cell("pre", "rope", "train", {"config": config()}, keep=True)
    other = cells_mod.Cell("pre", "rope", "train", {"config": config(lr=1e-2)}, keep=True)
    params = {"config": config(steps=2)}
    child = cells_mod.Cell("cont", "rope", "train", params, parent=parent)
    # keeping the weights does not change a result, so it is not part of the key; the parent is
    assert cells_mod.Cell("pre", "rope", "train", {"config": config()}).key == parent.key
    assert cells_mod.Cell("cont", "rope", "train", params, parent=parent).key == child.key
    assert cells_mod.Cell("cont", "rope", "train", params, parent=other).key != child.key
    assert cells_mod.Cell("cont", "rope", "train", params).key != child.key
    with pytest.raises(ValueError, match="keeps its model"):
        cells_mod.Cell("cont", "rope", "train", params, parent=cells_mod.Cell("pre", "rope", "train", params))
    probe = cells_mod.Cell("pre", "s0", "state_norm", {}, keep=True)
    with pytest.raises(ValueError, match="parent"):
        cells_mod.Cell("cont", "rope", "train", params, parent=probe)


def test_an_interrupted_parent_or_child_is_rerun_and_nothing_else(tmp_path):
    cells_dir = str(tmp_path)
    parent = cells_mod.Cell("pre", "rope", "train", {"config": config()}, keep=True)
    child = cells_mod.Cell("cont", "rope", "train", {"config": config(steps=2)}, parent=parent)
    cells_mod.run_cells([child], cells_dir, log=lambda line: None)
    # killed after the parent's model was written, before its record: the parent runs again, then the child
    os.remove(cells_mod.cell_path(cells_dir, parent))
    os.remove(cells_mod.cell_path(cells_dir, child))
    summary = cells_mod.run_cells([child], cells_dir, log=lambda line: None)
    assert summary.ran == [parent.name, child.name]
    # the kept models serve the children still to run: without them (a later session given only the records)
    # nothing reruns while every child has finished, and a child that has to run first reruns its parent
    stamps = {c.name: os.path.getmtime(cells_mod.cell_path(cells_dir, c)) for c in (parent, child)}
    shutil.rmtree(cells_mod.model_dir(cells_dir, parent))
    assert cells_mod.is_finished(cells_dir, parent) and not cells_mod.has_model(cells_dir, parent)
    summary = cells_mod.run_cells([parent, child], cells_dir, log=lambda line: None)
    assert not summary.ran and summary.cached == [parent.name, child.name]
    assert {c.name: os.path.getmtime(cells_mod.cell_path(cells_dir, c)) for c in (parent, child)} == stamps
    os.remove(cells_mod.cell_path(cells_dir, child))
    summary = cells_mod.run_cells([parent, child], cells_dir, log=lambda line: None)
    assert summary.ran == [parent.name, child.name] and not summary.cached
    assert cells_mod.has_model(cells_dir, parent)
    # a parent that diverged has no model: its record finishes it, and its children fail without a start point
    diverged = cells_mod.Cell("pre", "diverged", "train", {"config": config(lr=1.0)}, keep=True)
    record = {"cell": {"key": diverged.key}, "result": {"status": "diverged"}, "wall_s": 0.0}
    with open(cells_mod.cell_path(cells_dir, diverged), "w") as f:
        json.dump(record, f)
    stranded = cells_mod.Cell("cont", "stranded", "train", {"config": config()}, parent=diverged)
    summary = cells_mod.run_cells([diverged, stranded], cells_dir, log=lambda line: None)
    assert summary.cached == [diverged.name] and list(summary.failed) == [stranded.name]
    assert "no kept model" in summary.failed[stranded.name]
    # a failing parent fails its children without running them
    bad = cells_mod.Cell("pre", "bad", "train", {"config": config(task="sudoku")}, keep=True)
    orphan = cells_mod.Cell("cont", "orphan", "train", {"config": config()}, parent=bad)
    summary = cells_mod.run_cells([orphan], cells_dir, log=lambda line: None)
    assert set(summary.failed) == {bad.name, orphan.name} and "parent" in summary.failed[orphan.name]
    with pytest.raises(ValueError, match="no kept model"):
        cells_mod.run_cell(orphan, cells_dir)


def chained(parent: Sweep, **overrides) -> Sweep:
    options = dict(name="cont", title="cont", models={"a": {"mixer": "linear", "from": "a"}}, parent=parent,
                   budget=Budget(steps=2, batch_size=4, evals=1))  # fmt: skip
    return tiny_sweep(**{**options, **overrides})


def test_a_chained_sweep_continues_the_parent_its_parent_chose_on_validation():
    parent = tiny_sweep(keep=("a",))
    child = chained(parent, models={"a": {"mixer": "linear", "from": "a"}, "a2pb": {"mixer": "deltanet", "from": "a"}})
    assert child.cells() == [] and child.cells({}) == []  # nothing to continue yet
    records = {}
    for lr, val in zip(parent.lrs, (0.2, 0.7, 0.4)):
        for seed in parent.seeds:
            records[parent.cell("a", "n2", lr, seed).name] = fake_record(val, val)
    cells = child.cells(records)
    assert len(cells) == 2 * 3 * 2
    for cell in cells:
        seed = cell.params["config"]["seed"]
        assert cell.parent.name == parent.cell("a", "n2", 3e-3, seed).name and cell.parent.keep
        assert ("convert" in cell.params) == cell.label.startswith("a2pb")
        assert cell.params["config"]["mixer"] == ("deltanet" if cell.label.startswith("a2pb") else "linear")
    assert {c.params["config"]["lr"] for c in cells} == set(child.lrs)
    # a parent whose choice changes (here: its validation scores) makes other children
    moved = dict(records)
    for seed in parent.seeds:
        moved[parent.cell("a", "n2", 1e-2, seed).name] = fake_record(0.9, 0.9)
    assert not {c.key for c in child.cells(moved)} & {c.key for c in cells}
    # summarise reads the children at the parent's chosen learning rate
    for cell in cells:
        records[cell.name] = fake_record(cell.params["config"]["lr"], 0.5)
    result = summarise(child, records)
    assert result.choice("a", "n2").parent_lr == 3e-3 and result.choice("a", "n2").lr == 1e-2
    assert summarise(child, {}).finished == 0
    with pytest.raises(Missing, match="waits for its parent"):
        summarise(child, {}).stat("a", "n2")


def test_chained_sweep_declarations_are_checked():
    parent = tiny_sweep(keep=("a",))
    with pytest.raises(ValueError, match="keep"):
        tiny_sweep(keep=("z",))
    with pytest.raises(ValueError, match="parent"):
        tiny_sweep(models={"a": {"mixer": "linear", "from": "a"}})
    with pytest.raises(ValueError, match="from"):
        chained(parent, models={"b": {"mixer": "linear", "from": "b"}})
    with pytest.raises(ValueError, match="shape"):
        chained(parent, arch={"hidden_size": 32, "num_layers": 1, "num_heads": 2})
    with pytest.raises(ValueError, match="seeds"):
        chained(parent, seeds=(0,))
    with pytest.raises(ValueError, match="one setting"):
        chained(tiny_sweep(keep=("a",), settings={"n2": {"num_kv_pairs": 2}, "n3": {"num_kv_pairs": 3}}))


def toy_paper() -> types.SimpleNamespace:
    budget = Budget(steps=2, batch_size=4, evals=1)
    options = dict(task="mqar_vla", settings={"n2": {"num_kv_pairs": 2}}, lrs=(1e-3, 3e-3, 1e-2), seeds=(0,),
                   metric="accuracy", task_options={"test_size": 4, "validation_size": 4},
                   arch={"hidden_size": 16, "num_layers": 1, "num_heads": 2}, budget=budget)  # fmt: skip
    pre = Sweep(name="pre", title="pretrain", models={"rope": {"mixer": "rope"}}, keep=("rope",), **options)
    cont = Sweep(name="cont", title="continue", parent=pre, models={
        "path": {"mixer": "path", "from": "rope"}, "rope": {"mixer": "rope", "from": "rope"}
    }, **options)  # fmt: skip

    def decide(results):
        stats = {m: results["cont"].stat(m, "n2") for m in ("path", "rope")}
        return "CONFIRMED", "it ran", fmt(stats)

    claim = Claim("X1", "converted beats continued", "-", "criterion", ("pre", "cont"), decide, trained=False)
    return types.SimpleNamespace(
        TITLE="toy", SCALE_NOTES={"smoke": "toy"}, experiments=lambda scale: [pre, cont], CLAIMS=[claim]
    )


def test_the_command_runs_chains_in_stages_and_resumes_a_killed_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(command.PAPERS, "toy", toy_paper())
    args = ["reproduce", "toy", "--scale", "smoke", "--out", str(tmp_path)]
    assert main(args) == 0
    data = json.loads((tmp_path / "toy" / "report.json").read_text())
    assert data["run"]["ran"] == 3 + 6 and data["claims"][0]["verdict"] == "CONFIRMED"
    report = (tmp_path / "toy" / "report.md").read_text()
    assert "Chained: each model continues a model of `pre`" in report and "path (from rope at lr " in report
    assert "kept for a chained stage" in report and "start from the parent converted" in report
    cells_dir = str(tmp_path / "toy" / "cells")
    experiments = command.declared("toy", "smoke")
    cells, _ = command.declared_cells(experiments, cells_dir)
    assert len(cells) == 9 and all(cells_mod.is_finished(cells_dir, c) for c in cells)
    children = [c for c in cells if c.parent is not None]
    assert {c.parent.name for c in children} == {
        experiments[0].cell("rope", "n2", summarise(experiments[0], _).choice("rope", "n2").lr, 0).name
    }

    # a run killed during the second stage: two children unfinished; --resume runs those two only
    stamps = {c.name: os.path.getmtime(cells_mod.cell_path(cells_dir, c)) for c in cells}
    for c in children[:2]:
        os.remove(cells_mod.cell_path(cells_dir, c))
    assert main(args) == 2  # finished cells need --resume
    assert main([*args, "--resume"]) == 0
    again = json.loads((tmp_path / "toy" / "report.json").read_text())
    assert again["run"]["ran"] == 2 and again["run"]["cached"] == 7
    rerun = {c.name for c in children[:2]}
    assert all(
        os.path.getmtime(cells_mod.cell_path(cells_dir, c)) == stamps[c.name] for c in cells if c.name not in rerun
    )
    # killed in the first stage: a parent lost its record; the stage-one cells and then its children run again
    chosen = children[0].parent
    os.remove(cells_mod.cell_path(cells_dir, chosen))
    assert main([*args, "--resume"]) == 0
    assert json.loads((tmp_path / "toy" / "report.json").read_text())["run"]["ran"] == 1
    capsys.readouterr()
    assert main(["reproduce", "toy", "--out", str(tmp_path / "fresh"), "--list"]) == 0
    out = capsys.readouterr().out
    assert out.count("pending toy pre-") == 3 and "waiting toy 6 cells of chained or laddered experiments" in out
