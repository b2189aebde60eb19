"""benchmarks/repro_throughput.py on the CPU: a finished cell's config trains for a few steps, alone and two at once."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import repro_throughput

ROOT = Path(__file__).resolve().parents[2]
CELL = next((ROOT / "reports" / "vla" / "cells").glob("mqar-softmax_n4_lr=0.001_s0-*.json"))


def test_config_keeps_the_cell_and_times_its_last_third():
    config = repro_throughput._config(str(CELL), steps=30)
    cell = json.loads(CELL.read_text())["params"]["config"]
    assert {k: config[k] for k in ("task", "mixer", "hidden_size", "batch_size", "lr")} == {
        k: cell[k] for k in ("task", "mixer", "hidden_size", "batch_size", "lr")
    }
    assert config["steps"] == 30 and config["log_every"] == 10 and config["warmup_steps"] <= 30


def test_a_declared_cell_is_named_by_paper_and_pattern():
    """``PAPER:PATTERN`` takes the first full-scale training cell that matches, finished or not."""
    config = repro_throughput._config("vla:mqar-vla_n24_lr=0.001_s1-*", steps=30)
    assert (config["task"], config["mixer"], config["lr"], config["seed"]) == ("mqar_vla", "vla", 0.001, 1)
    assert config["task_options"]["num_kv_pairs"] == 24 and config["steps"] == 30
    with pytest.raises(SystemExit, match="no full-scale training cell"):
        repro_throughput._config("vla:no-such-cell-*", steps=30)


def test_runs_processes_at_once_on_the_cpu(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rt.json"
    argv = ["repro_throughput.py", str(CELL), "--steps", "3", "--procs", "1", "2", "--device", "cpu", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    repro_throughput.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["procs"] for r in rows] == [1, 2]
    assert all(not r["errors"] and len(r["ms_a_step"]) == r["procs"] for r in rows)
    assert all(ms > 0 for r in rows for ms in r["ms_a_step"])
    assert " 2 processes: median" in capsys.readouterr().out
