"""benchmarks/graph_noise.py on the CPU, where ``cuda_graph`` changes nothing: the four runs agree bit for bit, and the
cache-off run leaves ``torch.autocast`` as it found it."""

from __future__ import annotations

import json
import sys

import torch

from benchmarks import graph_noise


def test_on_a_cpu_every_run_is_the_eager_one(tmp_path, monkeypatch, capsys):
    autocast = torch.autocast
    monkeypatch.setattr(graph_noise, "DEVICE", "cpu")
    monkeypatch.setattr(sys, "argv", ["graph_noise.py", "rope", "--out", str(tmp_path / "noise.json")])
    graph_noise.main()
    assert torch.autocast is autocast
    report = json.loads((tmp_path / "noise.json").read_text())["rope"]
    losses = report["losses"]
    assert set(losses) == {"eager", "eager2", "graphed", "nocache"} and len(losses["eager"]) == 8
    assert all(run == losses["eager"] for run in losses.values())
    assert "model.embed_tokens.weight" in report["params"]
    for row in report["params"].values():
        assert row["graphed_max"] == row["nocache_max"] == row["eager2_max"] == row["nocache_graphed_max"] == 0.0
    assert "== rope: last loss eager" in capsys.readouterr().out
