"""The PaTH memory count: the launchers run on CPU tensors without the interpreter and without their kernels, every
buffer counted from its allocation to its free, the set alive at the peak named by call site."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import path_memory

ROOT = Path(__file__).resolve().parents[2]


def test_counter_follows_allocations_and_frees():
    counter = path_memory.Allocations()
    with counter:
        a = torch.empty(1000, dtype=torch.float32)
        b = a.view(10, 100)  # a view shares its storage: not counted
        a.add_(1)  # in place: not counted
        c = torch.empty(500, dtype=torch.float32)
        del c
        d = torch.empty(100, dtype=torch.float32)
    assert counter.peak == 6000 and counter.current == 4400
    assert sorted(r[0] for r in counter.at_peak.values()) == [2000, 4000]
    del a, b, d
    assert counter.current == 0


def test_report_of_a_small_path_fox_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "memory.json"
    script = [sys.executable, str(ROOT / "benchmarks" / "path_memory.py"), "--gate", "--batch", "1"]
    script += ["--seq-len", "2048", "--out", str(out)]
    done = subprocess.run(script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["D"] for r in rows] == [64, 128]
    for row in rows:
        assert row["leaked_bytes"] == 0  # every buffer of the step is freed by its end
        assert sum(b["bytes"] for b in row["at_peak"]) == row["peak_bytes"]
        # The backward's float32 [B, T, H, K] buffers (two bf16 units each) are alive at the peak, by call site.
        sites = " ".join(b["site"] for b in row["at_peak"])
        assert "parallel.py" in sites and "backward_super.py" in sites
        assert 8 < row["peak_units"] < 60
    done = subprocess.run(
        [*script[:2], "--head-dims", "64"], env={**env, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode != 0 and "TRITON_INTERPRET" in done.stderr


def test_a_setting_changes_what_is_counted(tmp_path):
    """``--setting`` patches a ``path_tune.LOCAL`` row's attributes while counting: float32 working buffers hold
    more at the peak than the default's float16 ones (at T = 32k, D = 64, bf16 units); an unknown label is
    refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = [sys.executable, str(ROOT / "benchmarks" / "path_memory.py"), "--gate", "--batch", "1", "--seq-len"]
    script += ["32768", "--head-dims", "64", "--top", "0"]
    peaks = []
    for setting in ([], ["--setting", "working buffers in float32"]):
        out = tmp_path / "memory.json"
        done = subprocess.run(
            [*script, *setting, "--out", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(out.read_text())["rows"]
        assert row["setting"] == (setting[1] if setting else None)
        peaks.append(row["peak_units"])
    assert peaks[1] > peaks[0] + 1.5, peaks
    done = subprocess.run([*script, "--setting", "no such row"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode != 0 and "--setting" in done.stderr


def test_the_local_adjoint_holds_no_buffer_it_does_not_read(tmp_path):
    """At the chunk-local adjoint's launch (bf16 inputs, float32 ``w`` as the layers hand them, D = 64 with
    superblocks) the float16 ``[B, T, H, K]`` buffers are the forward's ``K̃``, ``k̂`` and ``x`` and the bf16 one its
    ``x̂``, all four kept by autograd for the backward (``forward.keeps_carried``; held to its end): the backward makes
    no copy of its own, and its working copies of the queries are dropped with the tuple of the kernels between
    chunks. The float32 ones are ``M W`` (the forward's), ``dv``, ``dx`` and ``dK̃``, whose storage ``dw`` takes: no
    fifth for ``dw``; ``dv``'s sum comes out in bf16 from this launch, beside ``dq`` and ``dk``. The local adjoint's
    launch is not the peak."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the GPU's chunks, no kernel run
    out = tmp_path / "memory.json"
    script = [sys.executable, str(ROOT / "benchmarks" / "path_memory.py"), "--gate", "--batch", "1", "--seq-len"]
    script += ["4096", "--head-dims", "64", "--top", "0", "--phases", "--out", str(out)]
    done = subprocess.run(script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "path_local_bwd_kernel" in done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    (local,) = [p for p in row["phases"] if p["kernel"] == "path_local_bwd_kernel"]
    shapes = [(b["dtype"], tuple(b["shape"])) for b in local["alive"]]
    assert shapes.count(("float16", (1, 4096, 16, 64))) == 3, shapes
    assert shapes.count(("bfloat16", (1, 4096, 16, 64))) == 5, shapes  # o, x̂, and dq, dk, dv (the launch's outputs)
    assert shapes.count(("float32", (1, 4096, 16, 64))) == 4, shapes
    assert local["units"] < max(p["units"] for p in row["phases"])
