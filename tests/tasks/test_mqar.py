"""MQAR, Zoology and VLA forms: independent checkers of the layout and labels, reproducibility, accuracy."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks import MQAR, MQARVLA, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits


def check_zoology(x, y, L, n, V, random_non_queries=False):
    for seq, lab in zip(x.tolist(), y.tolist()):
        keys, values = seq[0 : 2 * n : 2], seq[1 : 2 * n : 2]
        assert len(set(keys)) == n and all(1 <= k < V // 2 for k in keys)
        assert len(set(values)) == n and all(V // 2 <= v < V for v in values)
        assert all(lab[t] == -100 for t in range(2 * n))
        memory = dict(zip(keys, values))
        seen = []
        for t in range(2 * n, L):
            if seq[t] in memory and (t - 2 * n) % 2 == 0 and seq[t] not in seen:
                seen.append(seq[t])
                assert lab[t] == memory[seq[t]]
            else:
                assert lab[t] == -100
                if not random_non_queries:
                    assert seq[t] == 0
        assert sorted(seen) == sorted(keys)


@pytest.mark.parametrize("L,n", [(64, 4), (128, 8), (256, 32)])
def test_zoology_layout(L, n):
    task = MQAR(seq_len=L, num_kv_pairs=n, vocab_size=8192)
    x, y = task.sample(200, make_generator(L))
    check_shapes(task, x, y, 200)
    check_zoology(x, y, L, n, 8192)


def test_zoology_random_non_queries_and_small_vocab():
    task = MQAR(seq_len=64, num_kv_pairs=8, vocab_size=128, random_non_queries=True)
    x, y = task.sample(200, make_generator(0))
    check_shapes(task, x, y, 200)
    for seq, lab in zip(x.tolist(), y.tolist()):
        memory = dict(zip(seq[0:16:2], seq[1:16:2]))
        scored = [t for t in range(64) if lab[t] != -100]
        assert len(scored) == 8 and all((t - 16) % 2 == 0 and lab[t] == memory[seq[t]] for t in scored)


def test_zoology_gaps_follow_the_power_law():
    task = MQAR(seq_len=256, num_kv_pairs=4)
    _, y = task.sample(2000, make_generator(1))
    gaps = ((y != -100).nonzero()[:, 1] - 8) // 2
    # p(g) ∝ (g+1)^-0.99 over 124 gaps puts about 1/H(124) ≈ 18% of the first draw on g = 0 and favours small g.
    assert (gaps == 0).float().mean() > 0.08
    assert (gaps < 10).float().mean() > (gaps >= 114).float().mean() * 5


def check_vla(x, y, n, T=None):
    T = 3 * n + 1 if T is None else T
    for seq, lab in zip(x.tolist(), y.tolist()):
        assert len(seq) == T and seq[2 * n] == 127
        keys, values = seq[0 : 2 * n : 2], seq[1 : 2 * n : 2]
        assert len(set(keys)) == n and all(0 <= k < 127 for k in keys + values)
        assert not set(keys) & set(values)
        memory = dict(zip(keys, values))
        assert all(lab[t] == -100 for t in range(2 * n + 1))
        for t in range(2 * n + 1, T):
            assert seq[t] in memory and lab[t] == memory[seq[t]]


@pytest.mark.parametrize("n", [4, 12, 24])
def test_vla_layout(n):
    task = MQARVLA(num_kv_pairs=n)
    x, y = task.sample(200, make_generator(n))
    check_shapes(task, x, y, 200)
    assert task.vocab_size == 128
    check_vla(x, y, n)
    check_vla(*task.test_sets()[f"n{n}"], n)


@pytest.mark.parametrize("T", [49, 128])
def test_vla_retention_variant_fills_the_rest_with_queries(T):
    task = MQARVLA(num_kv_pairs=8, seq_len=T, test_size=32)
    assert task.seq_len == T and task.num_queries == T - 17
    x, y = task.sample(64, make_generator(T))
    check_shapes(task, x, y, 64)
    check_vla(x, y, 8, T)
    assert list(task.test_sets()) == [f"n8_T{T}"]
    check_vla(*task.test_sets()[f"n8_T{T}"], 8, T)
    # queries are drawn uniformly from the stored keys, so each of the 8 is asked about as often
    asked = torch.stack([(x[:, 17:] == x[:, 2 * i : 2 * i + 1]).sum() for i in range(8)]).float()
    assert asked.min() > 0.5 * asked.mean()


def test_vla_default_length_keeps_its_stream():
    a, b = MQARVLA(num_kv_pairs=6), MQARVLA(num_kv_pairs=6, seq_len=19)
    assert list(b.test_sets()) == ["n6"]
    assert torch.equal(a.test_sets()["n6"][0], b.test_sets()["n6"][0])
    with pytest.raises(ValueError, match="seq_len"):
        MQARVLA(num_kv_pairs=8, seq_len=17)
    with pytest.raises(ValueError, match="seq_len"):
        MQARVLA(num_kv_pairs=8, seq_len=64.0)


def test_reproducible():
    check_reproducible(lambda seed: MQAR(seed=seed, seq_len=64, num_kv_pairs=4, test_size=16))
    check_reproducible(lambda seed: MQARVLA(seed=seed, num_kv_pairs=4, test_size=16))


@pytest.mark.parametrize("make", [lambda: MQAR(seq_len=64, num_kv_pairs=4), lambda: MQARVLA(num_kv_pairs=4)])
def test_accuracy_metric(make):
    task = make()
    x, y = task.sample(10, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y)["accuracy"] == 1.0
    b, t = (y != -100).nonzero()[0].tolist()
    logits[b, t] = -logits[b, t]
    metrics = task.evaluate(logits, x, y)
    assert metrics["accuracy"] == pytest.approx(1 - 1 / 40)
    assert metrics["sequence_accuracy"] == pytest.approx(0.9)


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="num_kv_pairs"):
        MQAR(seq_len=64, num_kv_pairs=17)
    with pytest.raises(ValueError, match="num_kv_pairs"):
        MQARVLA(num_kv_pairs=65)
