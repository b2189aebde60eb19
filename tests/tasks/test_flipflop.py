"""Flip-flop: an independent checker of the strings and labels, reproducibility, and the read/sequence errors."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks import FlipFlop, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits

W, R, I, ZERO, ONE = 0, 1, 2, 3, 4


def check_flipflop(x: torch.Tensor, y: torch.Tensor, train_on: str) -> None:
    for seq, lab in zip(x.tolist(), y.tolist()):
        instr, bits = seq[0::2], seq[1::2]
        assert instr[0] == W and instr[-1] == R
        assert set(instr) <= {W, R, I} and set(bits) <= {ZERO, ONE}
        memory = None
        for op, bit in zip(instr, bits):
            if op == W:
                memory = bit
            elif op == R:
                assert bit == memory
        for t in range(len(seq)):
            if t == len(seq) - 1 or (train_on == "reads" and seq[t] != R):
                assert lab[t] == -100
            else:
                assert lab[t] == seq[t + 1]


@pytest.mark.parametrize("train_on", ["all", "reads"])
def test_samples_follow_the_rules(train_on):
    task = FlipFlop(seq_len=64, train_on=train_on)
    x, y = task.sample(300, make_generator(3))
    check_shapes(task, x, y, 300)
    check_flipflop(x, y, train_on)


def test_test_sets_follow_the_rules_and_their_p_ignore():
    task = FlipFlop(seq_len=128, test_sizes={"in_distribution": 200, "sparse": 200, "dense": 200})
    for name, p in {"in_distribution": 0.8, "sparse": 0.98, "dense": 0.1}.items():
        x, y = task.test_sets()[name]
        assert x.shape == (200, 128)
        check_flipflop(x, y, "reads")
        middle = x[:, 2:-2:2]
        assert abs((middle == I).float().mean().item() - p) < 0.02, name


def test_default_length_and_reproducibility():
    assert FlipFlop().seq_len == 512
    check_reproducible(lambda seed: FlipFlop(seed=seed, seq_len=32, test_sizes={"sparse": 16}))


def test_metric_perfect_and_flipped():
    task = FlipFlop(seq_len=64)
    x, y = task.sample(16, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y) == {"read_error": 0.0, "sequence_error": 0.0}
    # Only the two bit logits compete: a large logit on an instruction token changes nothing.
    logits[..., W] = 100.0
    assert task.evaluate(logits, x, y)["read_error"] == 0.0
    reads = (x[:, :-1] == R).nonzero().tolist()
    b, t = reads[0]
    logits[b, t, ZERO], logits[b, t, ONE] = logits[b, t, ONE], logits[b, t, ZERO]
    metrics = task.evaluate(logits, x, y)
    assert metrics["read_error"] == pytest.approx(1 / len(reads))
    assert metrics["sequence_error"] == pytest.approx(1 / 16)
    preds = torch.where(y == -100, 0, y)
    assert task.evaluate(preds, x, y)["read_error"] == 0.0


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="seq_len"):
        FlipFlop(seq_len=7)
    with pytest.raises(ValueError, match="train_on"):
        FlipFlop(train_on="writes")
