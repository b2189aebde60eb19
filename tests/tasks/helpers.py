"""Helpers shared by the task tests: hand-made logits and the reproducibility checks every task must pass."""

from __future__ import annotations

import torch

from attnkit.tasks import Task, make_generator


def one_hot_logits(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits ``[B, T, V]`` whose argmax is ``targets`` (positions with -100 predict token 0)."""
    logits = torch.zeros(*targets.shape, vocab_size)
    logits.scatter_(-1, targets.clamp(min=0).unsqueeze(-1), 10.0)
    return logits


def check_reproducible(make_task) -> None:
    """Same seed -> same tensors; another seed -> others; test sets fixed across calls and instances."""
    task = make_task(0)
    a = task.sample(8, make_generator(1))
    b = task.sample(8, make_generator(1))
    c = task.sample(8, make_generator(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    first = task.test_sets()
    assert task.test_sets() is first
    again = make_task(0).test_sets()
    other = make_task(1).test_sets()
    assert first.keys() == again.keys()
    for name in first:
        assert torch.equal(first[name][0], again[name][0]) and torch.equal(first[name][1], again[name][1])
        assert first[name][0].dtype == first[name][1].dtype == torch.int64
    assert any(not torch.equal(first[name][0], other[name][0]) for name in first)


def check_shapes(task: Task, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> None:
    assert x.shape == y.shape == (batch_size, task.seq_len)
    assert x.dtype == y.dtype == torch.int64
    assert 0 <= int(x.min()) and int(x.max()) < task.vocab_size
    scored = y[y != -100]
    assert scored.numel() > 0 and 0 <= int(scored.min()) and int(scored.max()) < task.vocab_size
