"""The PaTH probe (``benchmarks/path_probe.py``) under the interpreter: one line, OK with every error under its bar,
and FAIL with exit status 1 where the kernels disagree with the PyTorch backend."""

from __future__ import annotations

import pytest
import torch

from benchmarks import path_probe


@pytest.fixture
def interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("probes the GPU's kernels there (run_gpu.sh pathsmall)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_probe_passes_the_model_shape(interpreter, capsys):
    assert path_probe.main(["--dtype", "float16", "--gate", "--heads", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("OK B=2 T=24 HQ=4 H=2 K=16 V=16 float16 w float32 gate:"), line
    assert [part.split()[0] for part in line.split(": ")[1].split(" d")] == ["o", "q", "k", "v", "w", "beta", "g"]


def test_probe_fails_where_the_kernels_are_wrong(interpreter, capsys, monkeypatch):
    from attnkit.ops.path.triton import local

    monkeypatch.setattr(local, "LOCAL_SOLVE", local.LOCAL_SOLVE)  # restored after the probe's --set
    fn = local.local_bwd_fn
    monkeypatch.setattr(local, "local_bwd_fn", lambda *args: tuple(2 * g for g in fn(*args)))  # dq, dk, dw, dβ doubled
    assert path_probe.main(["--dtype", "float32", "--set", "attnkit.ops.path.triton.local.LOCAL_SOLVE=None"]) == 1
    line = capsys.readouterr().out.strip()
    assert line.startswith("FAIL B=2 T=24") and "{'attnkit.ops.path.triton.local.LOCAL_SOLVE': None}" in line, line
    assert local.LOCAL_SOLVE is None
