"""Test set-up shared by every test.

Inside attnkit code, ``torch.empty`` and ``torch.empty_like`` return tensors filled with NaN (as
flash-linear-attention's tests do), so an implementation that reads memory it never wrote fails loudly.

Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter: ``TRITON_INTERPRET=1`` must be
set before anything imports triton, so it is set here, first.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# TRITON_INTERPRET=0 on a CPU machine: benchmarks/precompile.py --pytest, whose launches compile for the GPU machine.
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "0":
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET could be set"
    os.environ.setdefault("TRITON_INTERPRET", "1")

_empty = torch.empty
_empty_like = torch.empty_like


def _called_from_attnkit() -> bool:
    module = sys._getframe(2).f_globals.get("__name__", "")
    return module == "attnkit" or module.startswith("attnkit.")


def _poison(x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point() or x.is_complex():
        x.fill_(float("nan"))
    return x


def _poisoned_empty(*args, **kwargs):
    x = _empty(*args, **kwargs)
    return _poison(x) if _called_from_attnkit() else x


def _poisoned_empty_like(*args, **kwargs):
    x = _empty_like(*args, **kwargs)
    return _poison(x) if _called_from_attnkit() else x


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", _poisoned_empty_like)
    yield


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)
    yield


def pytest_runtest_logreport(report):
    """For the GPU steps (``benchmarks/run_gpu.sh``), whose pytest runs a time limit may cut before pytest's summary.
    ``ATTNKIT_FAILURE_LOG=FILE``: each failure's traceback is appended to ``FILE`` as it happens.
    ``ATTNKIT_DONE_LOG=FILE``: each test that passed or was skipped is appended to ``FILE`` by its node id (the
    controller writes both under xdist)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    failures, done = os.environ.get("ATTNKIT_FAILURE_LOG"), os.environ.get("ATTNKIT_DONE_LOG")
    if failures and report.failed:
        with open(failures, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
    finished = report.skipped or (report.passed and report.when == "call")
    if done and finished:
        with open(done, "a") as log:
            log.write(report.nodeid + "\n")


def pytest_collection_modifyitems(config, items):
    """``ATTNKIT_SKIP_FILE=FILE``: the tests ``FILE`` lists by node id (an earlier call's ``ATTNKIT_DONE_LOG``) are
    deselected, so that a GPU test file too slow for one call finishes over several."""
    path = os.environ.get("ATTNKIT_SKIP_FILE")
    if not path or not os.path.exists(path):
        return
    with open(path) as listed:
        done = {line.strip() for line in listed if line.strip()}  # node ids may hold spaces
    deselected = [item for item in items if item.nodeid in done]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid not in done]
