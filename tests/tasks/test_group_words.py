"""Group word problems: group axioms and orders, an independent prefix-product checker, metrics."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit.tasks import GROUP_NAMES, GroupWords, get_group, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits


@pytest.mark.parametrize("name,order,abelian", [("A5", 60, False), ("S5", 120, False), ("Z60", 60, True),
                                                ("A4xZ5", 60, False)])  # fmt: skip
def test_group_axioms(name, order, abelian):
    group = get_group(name)
    table = group.table.tolist()
    n = group.order
    assert n == order == len(set(group.elements))
    # Token 0 is the identity; every row and column is a permutation (Latin square, hence inverses exist).
    for a in range(n):
        assert table[0][a] == a and table[a][0] == a
        assert sorted(table[a]) == list(range(n))
        assert sorted(table[b][a] for b in range(n)) == list(range(n))
    for a, b, c in itertools.product(range(0, n, 7), range(n), range(0, n, 5)):
        assert table[table[a][b]][c] == table[a][table[b][c]]
    commutes = all(table[a][b] == table[b][a] for a in range(n) for b in range(n))
    assert commutes == abelian


def test_groups_are_the_named_ones():
    # A5 and S5 are the even / all permutations of 5 points with composition (a·b)[i] = a[b[i]].
    a5, s5 = get_group("A5"), get_group("S5")
    assert set(a5.elements) < set(s5.elements)
    a, b = s5.elements[7], s5.elements[33]
    ab = tuple(a[b[i]] for i in range(5))
    assert s5.elements[int(s5.table[7, 33])] == ab
    # A5 is perfect (its commutators generate it: no abelian quotient), A4xZ5 is not.
    for name, perfect in [("A5", True), ("A4xZ5", False)]:
        t = get_group(name).table.tolist()
        n = len(t)
        inv = [next(b for b in range(n) if t[a][b] == 0) for a in range(n)]
        subgroup = {t[t[a][b]][t[inv[a]][inv[b]]] for a in range(n) for b in range(n)}
        while True:
            grown = subgroup | {t[x][y] for x in subgroup for y in subgroup}
            if grown == subgroup:
                break
            subgroup = grown
        assert (len(subgroup) == n) == perfect
    z = get_group("Z60")
    assert z.elements[int(z.table[59, 2])] == 1


def prefix_products(words, elements, name):
    out = []
    for word in words:
        acc, row = None, []
        for tok in word:
            g = elements[tok]
            if acc is None:
                acc = g
            elif name == "Z60":
                acc = (acc + g) % 60
            elif name == "A4xZ5":
                acc = (tuple(acc[0][i] for i in g[0]), (acc[1] + g[1]) % 5)
            else:
                acc = tuple(acc[i] for i in g)
            row.append(elements.index(acc))
        out.append(row)
    return out


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_labels_are_running_products(name):
    task = GroupWords(group=name, k=12)
    x, y = task.sample(200, make_generator(5))
    check_shapes(task, x, y, 200)
    assert y.tolist() == prefix_products(x.tolist(), list(task.group.elements), name)
    tx, ty = task.test_sets()["test"]
    assert ty[:50].tolist() == prefix_products(tx[:50].tolist(), list(task.group.elements), name)


def test_reproducible():
    check_reproducible(lambda seed: GroupWords(seed=seed, k=8, test_size=32))


def test_metrics():
    task = GroupWords(group="S5", k=10)
    x, y = task.sample(20, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y) == {"accuracy": 1.0, "sequence_accuracy": 1.0}
    preds = y.clone()
    preds[3, 9] = (preds[3, 9] + 1) % task.vocab_size
    preds[4, 0] = (preds[4, 0] + 1) % task.vocab_size
    preds[4, 1] = (preds[4, 1] + 1) % task.vocab_size
    metrics = task.evaluate(preds, x, y)
    assert metrics["sequence_accuracy"] == pytest.approx(18 / 20)
    assert metrics["accuracy"] == pytest.approx(197 / 200)
    with pytest.raises(ValueError, match="unknown group"):
        GroupWords(group="A6")
    assert torch.equal(task.sample(3, make_generator(9))[0], task.sample(3, make_generator(9))[0])
