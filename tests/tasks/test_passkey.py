"""Passkey: an independent parser of haystack, needles and queries, the depth grid, exact match."""

from __future__ import annotations

import pytest

from attnkit.tasks import Passkey, make_generator
from attnkit.tasks.passkey import grid

from .helpers import check_reproducible, check_shapes, one_hot_logits

KEY, VAL, QRY, ANS, DIGIT0, KEY0 = 1, 2, 3, 4, 5, 15
NOISE = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def parse(seq, lab, task, source, tiled):
    filler_base = KEY0 + task.num_keys
    context = len(seq) - 8 * task.num_queries
    needles, filler, t = {}, [], 0
    while t < context:
        if seq[t] == KEY:
            key, digits = seq[t + 1], seq[t + 3 : t + 8]
            assert seq[t + 2] == VAL and KEY0 <= key < filler_base and key not in needles
            assert all(DIGIT0 <= d < DIGIT0 + 10 for d in digits)
            needles[key] = (len(filler), digits)
            t += 8
        else:
            assert seq[t] >= filler_base
            filler.append(seq[t] - filler_base)
            t += 1
    assert len(needles) == task.num_needles
    assert all(lab[i] == -100 for i in range(context))
    text = source * (len(filler) // len(source) + 2) if tiled else source
    assert bytes(filler) in text
    asked = []
    for t in range(context, len(seq), 8):
        assert seq[t] == QRY and seq[t + 2] == ANS
        key = seq[t + 1]
        asked.append(key)
        digits = needles[key][1]
        assert seq[t + 3 : t + 8] == digits
        assert lab[t : t + 8] == [-100, -100, *digits, -100]
    assert len(set(asked)) == task.num_queries
    return needles, len(filler)


def test_training_samples_single_needle():
    task = Passkey(seq_len=128)
    x, y = task.sample(200, make_generator(0))
    check_shapes(task, x, y, 200)
    depths = []
    for seq, lab in zip(x.tolist(), y.tolist()):
        needles, F = parse(seq, lab, task, NOISE, tiled=True)
        depths.append(next(iter(needles.values()))[0] / F)
    assert min(depths) < 0.1 and max(depths) > 0.9


def test_distractors_and_several_queries():
    task = Passkey(seq_len=256, num_needles=4, num_queries=2)
    x, y = task.sample(200, make_generator(1))
    check_shapes(task, x, y, 200)
    for seq, lab in zip(x.tolist(), y.tolist()):
        parse(seq, lab, task, NOISE, tiled=True)


def test_depth_grid_and_text_haystack():
    text = "In the beginning was a long enough haystack of plain text, " * 40
    task = Passkey(seq_len=96, haystack="text", text=text, test_lengths=(96, 384), test_size=4)
    sets = task.test_sets()
    assert len(sets) == 2 * 11
    for name, (x, y) in sets.items():
        L, depth = int(name[1:].split("_d")[0]), float(name.split("_d")[1])
        assert x.shape == (4, L)
        for seq, lab in zip(x.tolist(), y.tolist()):
            needles, F = parse(seq, lab, task, text.encode(), tiled=False)
            assert next(iter(needles.values()))[0] == round(depth * F)


def test_default_test_lengths_follow_the_training_length():
    assert Passkey().test_lengths == (512, 1024, 2048, 4096, 8192)
    assert Passkey(seq_len=64).test_lengths == (64, 128, 256, 512, 1024)


def test_reproducible_and_metric():
    check_reproducible(lambda seed: Passkey(seed=seed, seq_len=64, test_lengths=(64, 128), test_size=2))
    task = Passkey(seq_len=64, num_needles=3, num_queries=3, test_lengths=(64,), test_size=4)
    x, y = task.sample(4, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y) == {"exact_match": 1.0, "digit_accuracy": 1.0}
    b, t = (y != -100).nonzero()[7].tolist()
    logits[b, t] = -logits[b, t]
    metrics = task.evaluate(logits, x, y)
    assert metrics["exact_match"] == pytest.approx(11 / 12)
    assert metrics["digit_accuracy"] == pytest.approx(59 / 60)
    results = task.evaluate_model(
        lambda ids: one_hot_logits(task.test_sets()["L64_d0.0"][1][: len(ids)], task.vocab_size)
    )
    table = grid(results)
    assert list(table) == [64] and len(table[64]) == 11 and table[64][0.0] == 1.0


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="num_queries"):
        Passkey(num_needles=1, num_queries=2)
    with pytest.raises(ValueError, match="haystack"):
        Passkey(haystack="silence")
    with pytest.raises(ValueError, match="filler"):
        Passkey(seq_len=16)
