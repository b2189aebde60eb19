"""MQRAR-N: an independent checker that replays the assignments, reproducibility, accuracy."""

from __future__ import annotations

import pytest

from attnkit.tasks import MQRAR, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits


def check_mqrar(x, y, task):
    K, P = task.num_keys, task.num_assignments
    for seq, lab in zip(x.tolist(), y.tolist()):
        history = {}
        for j in range(P):
            key, value = seq[2 * j], seq[2 * j + 1]
            assert 1 <= key <= K and K < value < task.vocab_size
            history.setdefault(key, []).append(value)
            assert lab[2 * j] == lab[2 * j + 1] == -100
        assert sorted(history) == list(range(1, K + 1))
        assert min(len(v) for v in history.values()) >= task.n_back
        assert seq[2 * P] == 0 and lab[2 * P] == -100
        for t in range(2 * P + 1, len(seq)):
            assert lab[t] == history[seq[t]][-task.n_back]


@pytest.mark.parametrize("n_back", [1, 2, 4])
def test_labels_are_the_nth_most_recent_value(n_back):
    task = MQRAR(n_back=n_back, seq_len=256, num_keys=16, num_queries=31, num_values=32)
    x, y = task.sample(200, make_generator(n_back))
    check_shapes(task, x, y, 200)
    check_mqrar(x, y, task)


def test_defaults():
    task = MQRAR()
    assert (task.seq_len, task.num_keys) == (768, 32)
    x, y = task.test_sets()["N2"]
    check_mqrar(x[:20], y[:20], task)


def test_nth_differs_from_most_recent():
    # The task must not collapse to plain recall: the N = 2 answer usually differs from the N = 1 answer.
    one, two = MQRAR(n_back=1), MQRAR(n_back=2)
    y1 = one.sample(16, make_generator(0))[1]
    y2 = two.sample(16, make_generator(0))[1]
    scored = y1 != -100
    assert (y1[scored] != y2[scored]).float().mean() > 0.9


def test_reproducible_and_metric():
    check_reproducible(lambda seed: MQRAR(seed=seed, seq_len=128, num_keys=8, num_queries=15, test_size=8))
    task = MQRAR(seq_len=128, num_keys=8, num_queries=15)
    x, y = task.sample(4, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y)["accuracy"] == 1.0
    logits[0, -1] = 0.0
    logits[0, -1, 0] = 1.0
    assert task.evaluate(logits, x, y)["accuracy"] == pytest.approx(59 / 60)


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="even"):
        MQRAR(num_queries=32)
    with pytest.raises(ValueError, match="n_back"):
        MQRAR(n_back=20)
