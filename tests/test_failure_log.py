"""``ATTNKIT_FAILURE_LOG``, ``ATTNKIT_DONE_LOG`` and ``ATTNKIT_SKIP_FILE`` (``tests/conftest.py``): the GPU steps'
pytest runs keep each failure's traceback and each finished test in files as they happen, and a later run skips what
an earlier one finished."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


SAMPLE = """
import pytest


def test_passes():
    assert True


def test_skips():
    pytest.skip("not here")


def test_fails():
    assert 1 + 1 == 3, "arithmetic"
"""


def run_sample(tmp_path, **env):
    env = os.environ | env | {"PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", "test_sample.py"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_failures_and_finished_tests_are_logged_as_they_happen(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    failures, done = tmp_path / "failures.log", tmp_path / "done.txt"
    ran = run_sample(tmp_path, ATTNKIT_FAILURE_LOG=str(failures), ATTNKIT_DONE_LOG=str(done))
    assert ran.returncode == 1, ran.stdout[-2000:]
    text = failures.read_text()
    assert "test_sample.py::test_fails (call)" in text and "arithmetic" in text
    assert "test_passes" not in text
    assert done.read_text().splitlines() == ["test_sample.py::test_passes", "test_sample.py::test_skips"]


def test_a_later_run_skips_what_an_earlier_one_finished(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "done.txt").write_text("test_sample.py::test_passes\ntest_sample.py::test_skips\n")
    ran = run_sample(tmp_path, ATTNKIT_SKIP_FILE=str(tmp_path / "done.txt"))
    assert ran.returncode == 1 and "1 failed, 2 deselected" in ran.stdout, ran.stdout[-2000:]
