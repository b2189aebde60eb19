"""The distributed set-up's checks (issue 18), without launching processes: the global batch splits evenly over the
ranks (a world size that does not divide it is a ValueError naming batch_size, before any process group is joined or
anything is built), and torchrun's environment is read as numbers."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from attnkit.cli import main
from attnkit.train import LaunchError, TrainConfig, train
from attnkit.train.distributed import local_batch_size, setup_distributed


@pytest.mark.parametrize("world, local", [(1, 24), (2, 12), (3, 8), (4, 6), (6, 4), (8, 3), (24, 1)])
def test_the_global_batch_splits_over_the_ranks(world, local):
    assert local_batch_size(24, world) == local


@pytest.mark.parametrize("world", [5, 7, 16, 48])
def test_a_world_size_that_does_not_divide_the_batch_is_refused(world):
    with pytest.raises(ValueError, match=f"^batch_size: the global batch of 24 does not split evenly over {world}"):
        local_batch_size(24, world)


@pytest.fixture
def no_process_group(monkeypatch):
    """torchrun's variables are set by each test; joining a process group is recorded, not done."""
    joined = []
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.append(kwargs))
    return joined


def test_setup_refuses_before_joining_the_group(monkeypatch, no_process_group):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="^batch_size: the global batch of 8 does not split evenly over 3 ranks"):
        setup_distributed("cpu", 8)
    assert no_process_group == []
    monkeypatch.setenv("WORLD_SIZE", "4")
    info = setup_distributed("cpu", 8)
    assert (info.rank, info.world_size, info.local_batch) == (1, 4, 2)
    assert [kwargs["backend"] for kwargs in no_process_group] == ["gloo"]


def test_one_process_takes_the_whole_batch(no_process_group):
    info = setup_distributed("cpu", 7)
    assert (info.rank, info.world_size, info.local_batch, info.enabled) == (0, 1, 7, False)
    assert no_process_group == []


@pytest.mark.parametrize(
    "env, match",
    [
        (dict(WORLD_SIZE="two"), "^WORLD_SIZE: expected an integer >= 1"),
        (dict(WORLD_SIZE="0"), "^WORLD_SIZE:"),
        (dict(WORLD_SIZE="2", RANK="2"), "^RANK: expected a rank below WORLD_SIZE=2"),
        (dict(WORLD_SIZE="2", RANK="-1"), "^RANK:"),
        (dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="x"), "^LOCAL_RANK:"),
    ],
    ids=["world-not-a-number", "world-zero", "rank-too-large", "rank-negative", "local-rank-not-a-number"],
)
def test_torchruns_environment_is_checked(monkeypatch, no_process_group, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        setup_distributed("cpu", 8)
    assert no_process_group == []


def test_train_refuses_before_the_run_folder_or_the_model(monkeypatch, no_process_group, tmp_path):
    """The trainer's first step is the set-up: nothing is written or built for a batch that does not split (the
    check ran after joining the process group before)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    config = TrainConfig(batch_size=8, steps=1, device="cpu", out=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="^batch_size: the global batch of 8 does not split evenly over 3 ranks"):
        train(config)
    assert no_process_group == [] and not (tmp_path / "run").exists()


def test_a_rank_batch_that_grad_accum_does_not_divide_is_refused(monkeypatch, no_process_group, tmp_path, capsys):
    """8 rows over 4 ranks leave 2 a rank: 4 micro-batches do not divide them (the config alone cannot know)."""
    assert local_batch_size(8, 2, grad_accum=4) == 4
    with pytest.raises(LaunchError, match="^grad_accum: 4 micro-batches do not divide a rank's batch of 2"):
        local_batch_size(8, 4, grad_accum=4)
    monkeypatch.setenv("WORLD_SIZE", "4")
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--device", "cpu", "--batch-size", "8", "--grad-accum", "4", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnkit train: grad_accum: 4 micro-batches do not divide"), err
    assert no_process_group == [] and not out.exists()
