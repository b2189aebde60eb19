"""``ATTNKIT_FAILURE_LOG`` (``tests/conftest.py``): the GPU steps' pytest runs keep each failure's traceback in a
file as it happens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_failures_are_logged_as_they_happen(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_passes():\n    assert True\n\n\ndef test_fails():\n    assert 1 + 1 == 3, 'arithmetic'\n"
    )
    log = tmp_path / "failures.log"
    env = os.environ | {"ATTNKIT_FAILURE_LOG": str(log), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider", str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    text = log.read_text()
    assert "test_sample.py::test_fails (call)" in text and "arithmetic" in text
    assert "test_passes" not in text
