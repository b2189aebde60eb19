"""The experiment commands on tiny inputs: state-norm probe, length extrapolation and the CPU benchmark."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from attnkit.experiments import bench, extrapolate, probe_state
from attnkit.models import AttnKitConfig, AttnKitForCausalLM

MODULES = [probe_state, extrapolate, bench]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_help(module, capsys):
    parser = argparse.ArgumentParser(prog=module.__name__)
    module.add_arguments(parser)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "--out" in capsys.readouterr().out
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, f"{action.dest} has no help text"


def test_probe_state_linear_grows_vla_bounded(tmp_path):
    rows = probe_state.probe_state(mixers=("vla", "linear", "deltanet"), lengths=(1000, 10000))
    norm = {(r["mixer"], r["T"]): r["state_norm"] for r in rows}
    assert norm[("linear", 10000)] >= 5 * norm[("linear", 1000)]
    assert all(math.isfinite(v) for v in norm.values())
    assert norm[("vla", 1000)] < 100 and norm[("vla", 10000)] < 100
    assert norm[("deltanet", 10000)] < 100


def test_probe_state_run_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    probe_state.add_arguments(parser)
    out = tmp_path / "probe.json"
    args = parser.parse_args(["--mixers", "linear", "--lengths", "64", "128", "--out", str(out)])
    assert probe_state.run(args) == 0
    assert "linear" in capsys.readouterr().out
    assert [r["T"] for r in json.loads(out.read_text())["rows"]] == [64, 128]


@pytest.fixture
def tiny_checkpoint(tmp_path):
    config = AttnKitConfig(vocab_size=280, hidden_size=32, num_hidden_layers=1, num_heads=2, mixer="rope")
    path = tmp_path / "model"
    AttnKitForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture
def tiny_corpus(tmp_path):
    words = ["the", "grass", "is", "green", "and", "sky", "blue", "sun", "yellow", "here", "we", "go"]
    text = " ".join(words[(i * 7 + i // 3) % len(words)] for i in range(4000))
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def test_extrapolate_lm(tiny_checkpoint, tiny_corpus):
    results = extrapolate.extrapolate(
        tiny_checkpoint,
        task="lm",
        lengths=(32, 64, 128),
        corpus=str(tiny_corpus),
        eval_tokens=512,
        sliding_stride=16,
    )
    rows = results["rows"]
    assert {(r["length"], r["window"]) for r in rows} == {
        (L, w) for L in (32, 64, 128) for w in ("non-overlapping", "sliding")
    }
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows)
    assert "perplexity" in extrapolate.format_results(results)


def test_extrapolate_passkey(tiny_checkpoint):
    results = extrapolate.extrapolate(tiny_checkpoint, task="passkey", lengths=(32, 64), num_keys=8, test_size=2)
    rows = results["rows"]
    assert len(rows) == 2 * 11
    assert all(0.0 <= r["exact_match"] <= 1.0 and 0.0 <= r["digit_accuracy"] <= 1.0 for r in rows)
    assert "exact match" in extrapolate.format_results(results)


def test_extrapolate_run_cli(tiny_checkpoint, tiny_corpus, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    extrapolate.add_arguments(parser)
    out, plot = tmp_path / "lm.json", tmp_path / "lm.png"
    args = parser.parse_args(
        [str(tiny_checkpoint), "--corpus", str(tiny_corpus), "--out", str(out), "--plot", str(plot)]
        + "--lengths 32 64 --eval-tokens 256".split()
    )
    assert extrapolate.run(args) == 0
    assert "non-overlapping" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["rows"]) == 2
    assert plot.stat().st_size > 0


def test_extrapolate_rejects_bad_lengths(tiny_checkpoint):
    with pytest.raises(ValueError, match="multiples"):
        extrapolate.extrapolate(tiny_checkpoint, task="lm", lengths=(32, 48), train_len=32)


def test_bench_cpu_tiny(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        "--cpu --batch 1 --seq-len 32 --heads 2 --head-dim 16 --repeats 1 --mechanisms sdpa+rope linear".split()
        + ["--out", str(out)]
    )
    assert bench.run(args) == 0
    assert "linear" in capsys.readouterr().out
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == ["sdpa+rope", "linear"]


def test_bench_gpu_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert bench.bench_gpu() == 2
    assert "CUDA" in capsys.readouterr().out
