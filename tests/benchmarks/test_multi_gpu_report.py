"""``benchmarks/multi_gpu_report.py``: the loss and throughput comparison of distributed runs with the single run."""

from __future__ import annotations

import json

import pytest

from benchmarks import multi_gpu_report as report


def write_run(folder, losses, tps):
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"event": "start"}) + "\n")
        for step, (loss, t) in enumerate(zip(losses, tps), start=1):
            f.write(json.dumps({"event": "train", "step": step, "loss": loss, "tokens_per_s": t}) + "\n")
        f.write(json.dumps({"event": "eval", "step": len(losses), "test": {}}) + "\n")


def test_report_compares_with_the_single_run(tmp_path):
    steps = 8
    write_run(tmp_path / "vla-single", [2.0] * steps, [1000.0] * steps)
    write_run(tmp_path / "vla-ddp", [2.0] * 6 + [2.01, 2.0], [10.0] * 5 + [1900.0] * 3)
    write_run(tmp_path / "vla-fsdp", [2.0] * steps, [1700.0] * steps)
    (tmp_path / "vla-fsdp" / "final.json").write_text(json.dumps({"precision": "bfloat16 autocast, FSDP2 bf16"}))
    result = report.report(tmp_path, world_size=2)
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["ddp"]["max_rel_loss_diff"] == pytest.approx(0.005) and rows["ddp"]["worst_step"] == 7
    assert rows["ddp"]["speedup"] == pytest.approx(1.9), "the first steps (compilation) are left out"
    assert rows["fsdp"]["max_rel_loss_diff"] == 0 and rows["fsdp"]["speedup"] == pytest.approx(1.7)
    assert json.loads((tmp_path / "multi_gpu.json").read_text())["world_size"] == 2
    assert "| vla | ddp | 8 |" in (tmp_path / "multi_gpu.md").read_text()
    assert rows["fsdp"]["precision"] == "bfloat16 autocast, FSDP2 bf16" and rows["ddp"]["precision"] is None


def test_report_needs_a_single_run(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 1
    assert "no <mixer>-single run" in capsys.readouterr().err


def test_runs_without_common_steps_are_refused(tmp_path):
    write_run(tmp_path / "a", [1.0], [1.0])
    with pytest.raises(ValueError, match="no logged step"):
        report.compare(report.train_events(tmp_path / "a"), {})
