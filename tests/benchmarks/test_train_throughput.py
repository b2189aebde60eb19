"""``benchmarks/train_throughput.py`` on CPU: arguments, the ratio to RoPE, and a smoke run on tiny models."""

from __future__ import annotations

import json

import pytest

from benchmarks import train_throughput as tt

TINY = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--heads", "2", "--vocab", "128"]
TINY += ["--seq-lens", "32", "--tokens", "64", "--steps", "2", "--warmup", "1", "--backend", "torch"]
TINY += ["--dtype", "float32"]


def test_parse_args_defaults():
    args = tt.parse_args(["--out", "x/run.json"])
    assert (args.layers, args.hidden, args.heads, args.vocab) == (4, 1024, 16, 32000)
    assert args.seq_lens == [4096, 16384] and args.tokens == 16384 and args.mixers == list(tt.MIXERS)
    assert (args.steps, args.warmup, args.backend, args.dtype, args.fla) == (5, 2, "auto", "bfloat16", False)
    assert args.png == "x/run.png"


@pytest.mark.parametrize(
    "argv",
    [
        ["--seq-lens", "3000"],
        ["--heads", "3"],
        ["--steps", "0"],
        ["--mixers", "llama"],
        ["--backend", "cuda"],
        ["--profile", "-1"],
        ["--warmup", "-1"],
    ],
)
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tt.parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_ratios_to_rope():
    rows = [
        {"name": "rope", "T": 32, "tokens_per_s": 100.0, "x_rope": None},
        {"name": "path", "T": 32, "tokens_per_s": 50.0, "x_rope": None},
        {"name": "path", "T": 64, "tokens_per_s": 40.0, "x_rope": None},  # no RoPE row at this T
        {"name": "vla", "T": 32, "tokens_per_s": None, "x_rope": None},  # failed
    ]
    tt.add_ratios(rows)
    assert [r["x_rope"] for r in rows] == [1.0, 0.5, None, None]


def test_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    """Two mixers timed, one that raises and FLA's anchors (stood in for by a builder that raises, so the test needs
    no FLA) recorded as errors, the rest of the run unaffected."""

    def attnkit_model(mixer, args):
        if mixer == "nope":
            raise RuntimeError("boom")
        return build_attnkit(mixer, args)

    def fla_model(name, args):
        raise ModuleNotFoundError("No module named 'fla'")

    build_attnkit = tt.attnkit_model
    monkeypatch.setattr(tt, "attnkit_model", attnkit_model)
    monkeypatch.setattr(tt, "fla_model", fla_model)
    out = tmp_path / "run.json"
    assert tt.main([*TINY, "--mixers", "rope", "nope", "path", "--fla", "--out", str(out)]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0
    payload = json.loads(out.read_text())
    env = payload["environment"]
    assert {"device", "torch", "triton", "transformers", "commit", "command"} <= set(env)
    assert env["command"].startswith("python benchmarks/train_throughput.py --device cpu")
    rows = {r["name"]: r for r in payload["rows"]}
    assert list(rows) == ["rope", "nope", "path", *tt.FLA_MODELS]
    for name in ("rope", "path"):
        row = rows[name]
        assert row["error"] is None and row["tokens_per_s"] > 0 and row["ms"] > 0 and len(row["step_ms"]) == 2
        assert (row["T"], row["B"], row["tokens"]) == (32, 2, 64) and row["params"] > 0 and row["loss"] > 0
        assert row["peak_mem_bytes"] is None  # CPU
    assert rows["rope"]["x_rope"] == 1.0 and rows["path"]["x_rope"] > 0
    assert rows["nope"]["error"] == "RuntimeError: boom" and rows["nope"]["tokens_per_s"] is None
    assert all(rows[n]["error"].startswith("ModuleNotFoundError") for n in tt.FLA_MODELS)
    assert all(rows[n]["source"] == "fla" for n in tt.FLA_MODELS) and rows["path"]["source"] == "attnkit"
    table = capsys.readouterr().out
    assert "nope failed at T=32: RuntimeError: boom" in table and "1.00x" in table


def test_print_kernels(capsys):
    """--profile's table: the total of every kernel, then the ``top`` largest only."""
    kernels = [{"kernel": "big", "us": 1500.0, "calls": 2.0}, {"kernel": "small", "us": 500.0, "calls": 1.0}]
    tt.print_kernels(kernels, 1)
    out = capsys.readouterr().out
    assert "2.00 ms of GPU kernels a step, 2 distinct" in out
    assert "2x  big" in out and "small" not in out
    tt.print_kernels([], 5)
    assert capsys.readouterr().out == ""
