"""The PaTH tuning sweep's CPU smoke run: every configuration runs through the interpreter, is held to the
default one and lands in the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import path_tune


def test_smoke_run_on_cpu(tmp_path, capsys):
    assert (
        path_tune.main(["--device", "cpu", "--quick", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)])
        == 0
    )
    cells = json.loads((tmp_path / "path_tune.json").read_text())["cells"]
    assert [(c["D"], c["T"]) for c in cells] == [(16, 40)]
    rows = cells[0]["fwd"] + cells[0]["bwd"]
    assert len(rows) == 5 and cells[0]["fwd"][-1]["solve_rows"] == 16  # two launches, one UT-solve block size
    for row in rows:
        assert row["error"] is None and row["ms"] > 0 and row["err"] < 1e-5
    # The sweep patches the backward's configuration and must put it back.
    from attnkit.ops.path.triton import backward

    assert backward.backward_config(16) == (16, 1) and not backward.carries_key_tile(16)
    assert [r["key_tile"] for r in cells[0]["bwd"]] == [False, True]  # the rule's choice, then the key-tile kernel
    # The between-superblock sweep: its default (programs a superblock left open), then one program a key tile.
    assert [(r["tile"], r["tiles_per_program"]) for r in cells[0]["super"]] == [(16, 0), (16, 1)]
    for sup in cells[0]["super"]:
        assert sup["error"] is None and sup["err"] < 1e-5
    from attnkit.ops.path.triton import backward_super

    assert backward_super.launch_config(16, 16) == dict(tile=16, tiles_per_program=0, num_warps=1, num_stages=1)
    from attnkit.ops.path.triton import prepare

    assert prepare.SOLVE_ROWS == 16
    out = capsys.readouterr().out
    assert "fwd+bwd chunk=32 num_warps=4 key_tile=False" in out and "key_tile=True" in out
    assert "fwd+bwd super tile=16 tiles_per_program=1 num_warps=1 num_stages=1" in out


def test_carry_only_on_cpu(tmp_path, capsys):
    """--carry-only: the forward's two carries, then forward+backward with each carry precision (every gradient's
    error against the default's), and the precision put back."""
    argv = ["--device", "cpu", "--carry-only", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)]
    assert path_tune.main(argv) == 0
    cell = json.loads((tmp_path / "path_tune.json").read_text())["cells"][0]
    assert [r["carry_precision"] for r in cell["fwd"]] == ["tf32x3", "tf32", "bf16x3"]
    assert all(r["err_torch"] < 1e-5 for r in cell["fwd"])  # the interpreter's carries are exact
    assert [r["carry_precision"] for r in cell["bwd"]] == ["tf32x3", "tf32", "bf16x3"]
    for row in cell["bwd"]:
        assert row["error"] is None and row["ms"] > 0 and row["err"] < 1e-5
        assert set(row["errs"]) == {"o", "dq", "dk", "dv", "dw", "dbeta", "dg"}
    from attnkit.ops.path.triton import prepare

    assert prepare.CARRY_16BIT == "bf16x3"
    assert "fwd+bwd carry_precision=tf32:" in capsys.readouterr().out


def test_span_only_on_cpu(tmp_path, capsys):
    """--span-only: the forward and forward+backward with each superblock span, keyed ``superblock``, and the span put
    back (under the interpreter every span is two chunks: the rows run, their times say nothing)."""
    argv = ["--device", "cpu", "--span-only", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)]
    assert path_tune.main(argv) == 0
    cell = json.loads((tmp_path / "path_tune.json").read_text())["cells"][0]
    assert [r.get("superblock") for r in cell["fwd"]] == [None, *path_tune.SPAN]
    assert [r["superblock"] for r in cell["bwd"]] == path_tune.SPAN
    for row in cell["fwd"][1:] + cell["bwd"]:
        assert row["error"] is None and row["err"] < 1e-5
    from attnkit.ops.path.triton import prepare

    assert prepare.SUPERBLOCK == 512
    assert "fwd+bwd superblock=256:" in capsys.readouterr().out


def test_local_only_on_cpu(tmp_path, capsys):
    """--local-only: forward+backward with each local-adjoint and inner-carry precision, compiled in two child
    processes (--jobs 2), then here every output and gradient held to the PyTorch backend (under the interpreter every
    setting is exact) and timed, and the settings put back."""
    argv = ["--device", "cpu", "--local-only", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)]
    argv += ["--jobs", "2"]
    assert path_tune.main(argv) == 0
    cell = json.loads((tmp_path / "path_tune.json").read_text())["cells"][0]
    assert [r["setting"] for r in cell["local"]] == [label for label, *_ in path_tune.LOCAL]
    for row in cell["local"]:
        assert row["error"] is None and row["ms"] > 0 and row["err"] < 1e-4
        assert set(row["errs"]) == {"o", "dq", "dk", "dv", "dw", "dbeta", "dg"}
    from attnkit.ops.path.triton import backward, local, prepare

    assert local.LOCAL_GRADS_16BIT == "bf16" and prepare.INNER_CARRY_16BIT == "tf32"
    assert backward.INNER_LOW_GRAD is None and backward.INNER_EVERY is None and local.LOCAL_SOLVE == "bf16x3"
    assert backward.INNER_STAGES == 1
    assert backward.INNER_RECOMPUTE is True and backward.INNER_CARRY_LOW is True
    from attnkit.ops.path import parallel

    assert parallel.KEEP_PREPARED is True
    from attnkit.ops.path.triton import backward_super

    assert backward_super.PAIR_16BIT is None
    assert "fwd+bwd local setting=local solve by substitution:" in capsys.readouterr().out


def test_local_errors_without_a_check_build_no_reference(monkeypatch):
    """A child process of --jobs (``check`` False) runs each setting's kernels and keeps its failure, and builds no
    PyTorch reference (at T = 32k four children's references filled an 80 GB GPU)."""
    from benchmarks import path_accuracy

    backends = []
    run = path_accuracy.run
    monkeypatch.setattr(path_accuracy, "run", lambda xs, do, backend: backends.append(backend) or run(xs, do, backend))
    rows = path_tune.local_errors(16, 40, torch.device("cpu"), [0, 1], 1, torch.float32, check=False)
    assert rows == {0: dict(error=None), 1: dict(error=None)} and backends == ["triton", "triton"]
    rows = path_tune.local_errors(16, 40, torch.device("cpu"), [0], 1, torch.float32)
    assert backends[2:] == ["torch", "triton"] and rows[0]["err"] < 1e-4


def test_local_pick_narrows_the_rows(tmp_path):
    """--local-pick: only the settings whose labels hold one of the strings are checked and timed, in LOCAL's order;
    a string no label holds is refused by name."""
    argv = ["--device", "cpu", "--local-only", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)]
    assert path_tune.main([*argv, "--local-pick", "chunks of 64", "default"]) == 0
    cell = json.loads((tmp_path / "path_tune.json").read_text())["cells"][0]
    assert [r["setting"] for r in cell["local"]] == ["default", "chunks of 64 at K = 128"]
    for row in cell["local"]:
        assert row["error"] is None and row["ms"] > 0 and row["err"] < 1e-4
    with pytest.raises(SystemExit):
        path_tune.main([*argv, "--local-pick", "no such setting"])


def test_local_row_that_fails_to_time_keeps_the_others(tmp_path, monkeypatch):
    """A setting that passes the error check but fails at the timing's inputs (out of resources, say) gets that
    error on its row, without a time; the other rows are timed and the table prints."""
    calls = []

    def bench(fn, device):
        calls.append(len(calls))
        if len(calls) == 2:
            raise RuntimeError("out of resource: shared memory, Required: 245760")
        return 1.0

    monkeypatch.setattr(path_tune, "bench", bench)
    cell = path_tune.local_cell(16, 40, torch.device("cpu"), pick=[0, 1, 2])
    rows = cell["local"]
    assert [r.get("ms") for r in rows] == [1.0, None, 1.0]
    assert rows[0]["error"] is None and "out of resource" in rows[1]["error"] and "ms" not in rows[1]
    assert "out of resource" in path_tune.table([cell])
