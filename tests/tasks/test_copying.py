"""Copying: an independent parser of ``$ s | s .``, reproducibility, exact match on the copied half."""

from __future__ import annotations

import pytest

from attnkit.tasks import Copying, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits

PAD, BOS, SEP, EOS = 0, 1, 2, 3


def check_copy(x, y, lengths_allowed):
    for seq, lab in zip(x.tolist(), y.tolist()):
        assert seq[0] == BOS
        n = seq.index(SEP) - 1
        assert n in lengths_allowed
        s = seq[1 : n + 1]
        assert all(4 <= c < 30 for c in s)
        assert seq[n + 2 : 2 * n + 2] == s and seq[2 * n + 2] == EOS
        assert all(c == PAD for c in seq[2 * n + 3 :])
        expected = [-100] * len(seq)
        expected[n + 1 : 2 * n + 2] = s + [EOS]
        assert lab == expected


def test_training_samples():
    task = Copying(min_len=1, max_len=64)
    x, y = task.sample(300, make_generator(0))
    check_shapes(task, x, y, 300)
    assert task.seq_len == 131
    check_copy(x, y, range(1, 65))
    lengths = (x == SEP).nonzero()[:, 1] - 1
    assert lengths.min() < 10 and lengths.max() > 55


def test_test_sets_per_length():
    task = Copying(max_len=16, test_lengths=(8, 64), test_size=10)
    sets = task.test_sets()
    assert list(sets) == ["len8", "len64"]
    for n in (8, 64):
        x, y = sets[f"len{n}"]
        assert x.shape == (10, 2 * n + 3)
        check_copy(x, y, {n})


def test_default_test_lengths_follow_the_training_length():
    assert Copying().test_lengths == (16, 32, 64, 128, 192, 256)
    assert Copying(max_len=8).test_lengths == (2, 4, 8, 16, 24, 32)
    assert list(Copying(max_len=2, test_size=2).test_sets()) == ["len1", "len2", "len4", "len6", "len8"]


def test_reproducible_and_metric():
    check_reproducible(lambda seed: Copying(seed=seed, max_len=8, test_lengths=(4, 16), test_size=4))
    task = Copying(max_len=10)
    x, y = task.sample(8, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y)["sequence_accuracy"] == 1.0
    b, t = (y != -100).nonzero()[-1].tolist()
    logits[b, t] = 0.0
    metrics = task.evaluate(logits, x, y)
    assert metrics["sequence_accuracy"] == pytest.approx(7 / 8)
    assert metrics["accuracy"] == pytest.approx(1 - 1 / int((y != -100).sum()))
