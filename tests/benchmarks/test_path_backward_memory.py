"""``benchmarks/path_backward_memory.py``: the PyTorch part of PaTH's backward, one head at a time, peaks well
below all heads at once (each run in its own process)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "path_backward_memory.py"


def peak_mib(budget: int) -> tuple[int, float]:
    argv = [sys.executable, str(SCRIPT), "--seq-len", "4096", "--heads", "8", "--budget", str(budget)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600).stdout
    found = re.search(r"(\d+) heads a slice, peak (\d+) MiB", out)
    assert found, out
    return int(found[1]), float(found[2])


def test_one_head_at_a_time_uses_less_memory():
    heads_all, whole = peak_mib(1 << 40)
    heads_one, sliced = peak_mib(1)
    assert (heads_all, heads_one) == (8, 1)
    assert whole > 200 and sliced < 0.5 * whole, (whole, sliced)  # ~320 and ~85 MiB


def aten_ops(seq_len: int) -> int:
    argv = [sys.executable, str(SCRIPT), "--seq-len", str(seq_len), "--heads", "2", "--budget", "1", "--count-ops"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600).stdout
    found = re.search(r"(\d+) ATen operators, (\d+) a slice of heads \(2 slices\)", out)
    assert found, out
    return int(found[1])


def test_operators_a_slice_do_not_grow_with_the_length():
    """The backward's PyTorch part dispatches as many operators at 4k as at 1k (no Python loop over chunks or
    superblocks: on a GPU each operator is host time, and short sequences are bound by it)."""
    assert aten_ops(1024) == aten_ops(4096)
