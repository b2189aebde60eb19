"""Variable tracking: a reference solver that recomputes every answer from the text, lengths, splits, the metric."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks import VariableTracking, get_task, make_generator

from .helpers import check_reproducible, check_shapes, one_hot_logits

VAR, EQ, QRY, ANS, DIGIT0, VAR0 = 1, 2, 3, 4, 5, 15
NOISE = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def solve(seq: list[int], task: VariableTracking) -> tuple[list[list[int]], list[int]]:
    """Read the statements of ``seq`` and answer its queries: ``(answer tokens per query, positions scored)``.

    Values flow along the assignments as a reader of the text would follow them; every query's answer is
    recomputed from that, not from the generator's bookkeeping."""
    filler_base = VAR0 + task.num_vars
    per_query = 3 + task.answer_len if task.query == "value" else 7 + task.answer_len
    context = len(seq) - task.num_queries * per_query
    holds, assigned, filler, t = {}, [], [], 0
    while t < context:
        if seq[t] == VAR:
            name, rhs = seq[t + 1], seq[t + 3]
            assert seq[t + 2] == EQ and VAR0 <= name < filler_base and name not in holds
            if DIGIT0 <= rhs < DIGIT0 + 10:  # VAR X = d1 … d5
                holds[name] = tuple(seq[t + 3 : t + 8])
                assert all(DIGIT0 <= d < DIGIT0 + 10 for d in holds[name])
                t += 8
            else:  # VAR Y = X: X must already hold a value
                assert rhs in holds, "a copy of a variable not yet assigned"
                holds[name] = holds[rhs]
                t += 4
            assigned.append(name)
        else:
            assert seq[t] >= filler_base
            filler.append(seq[t] - filler_base)
            t += 1
    assert bytes(filler) in NOISE * (len(filler) // len(NOISE) + 2)
    values = set(holds.values())
    assert len(values) == task.num_chains and len(holds) == task.num_chains * (task.num_hops + 1)
    assert all(sum(v == value for v in holds.values()) == task.num_hops + 1 for value in values)
    answers, scored, asked = [], [], []
    for t in range(context, len(seq), per_query):
        assert seq[t] == QRY
        if task.query == "variables":  # QRY d1…d5 ANS X0 … Xh: every variable holding the value, in order
            value = tuple(seq[t + 1 : t + 6])
            assert seq[t + 6] == ANS and value in values
            answer = [name for name in assigned if holds[name] == value]
            scored += range(t + 6, t + 6 + len(answer))
            assert seq[t + 7 : t + 7 + len(answer)] == answer
        else:  # QRY Xh ANS d1…d5: the value of the chain's last variable
            name = seq[t + 1]
            value = holds[name]
            assert seq[t + 2] == ANS and name == [n for n in assigned if holds[n] == value][-1]
            answer = list(value)
            scored += range(t + 2, t + 2 + len(answer))
            assert seq[t + 3 : t + 8] == answer
        asked.append(value)
        answers.append(answer)
    assert len(set(asked)) == task.num_queries
    return answers, scored


def check(task: VariableTracking, x: torch.Tensor, y: torch.Tensor) -> None:
    for seq, lab in zip(x.tolist(), y.tolist()):
        answers, scored = solve(seq, task)
        assert [lab[t] for t in scored] == [tok for answer in answers for tok in answer]
        assert all(lab[t] == -100 for t in set(range(len(seq))) - set(scored))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"seq_len": 128, "num_chains": 3, "num_hops": 2, "num_queries": 2},
        {"seq_len": 96, "num_chains": 2, "num_hops": 3, "query": "value"},
        {"seq_len": 100, "num_chains": 4, "num_hops": 1, "num_queries": 4, "num_vars": 8},
    ],
    ids=["ruler-default", "3chains-2queries", "value-form", "tight"],
)
def test_examples_are_well_formed_and_the_solver_recovers_every_label(options):
    task = VariableTracking(**options)
    x, y = task.sample(100, make_generator(7))
    check_shapes(task, x, y, 100)
    check(task, x, y)


def test_chains_are_interleaved_and_spread_over_the_haystack():
    task = VariableTracking(seq_len=256, num_chains=2, num_hops=3)
    x, _ = task.sample(300, make_generator(0))
    context = 256 - 2 * 7 - 4  # the query closes the sequence
    where = (x == VAR).nonzero()[:, 1].float() / context
    # the statements sit at uniform positions: half of them in each half, some near either end
    assert abs((where < 0.5).float().mean() - 0.5) < 0.03 and where.min() < 0.01 and where.max() > 0.9
    # the root of the queried chain is not always the first statement: the chains interleave
    roots = [(row[(row == VAR).nonzero()[:, 0] + 3] < VAR0).nonzero()[:, 0].tolist() for row in x]
    assert {tuple(r) for r in roots} >= {(0, 1), (0, 2), (0, 3), (0, 4)}


def test_test_sets_are_multiples_of_the_training_length_and_answerable():
    task = VariableTracking(seq_len=64, num_chains=2, num_hops=2, test_size=6)
    assert task.test_lengths == (64, 128, 256, 512, 1024)
    sets = task.test_sets()
    assert list(sets) == [f"L{64 * m}" for m in (1, 2, 4, 8, 16)]
    for name, (x, y) in sets.items():
        assert x.shape == y.shape == (6, int(name[1:]))
        check(task, x, y)
    other = VariableTracking(seq_len=80, test_lengths=(80, 320), test_size=3).test_sets()
    assert {k: v[0].shape for k, v in other.items()} == {"L80": (3, 80), "L320": (3, 320)}


def test_splits_are_seeded_and_disjoint():
    check_reproducible(lambda seed: VariableTracking(seed=seed, seq_len=64, test_lengths=(64, 128), test_size=4))
    task = get_task("variable_tracking", seed=5, seq_len=64, test_lengths=(64,), test_size=64, validation_size=64)
    val = {tuple(r) for r in task.validation_sets()["validation"][0].tolist()}
    test = {tuple(r) for r in task.test_sets()["L64"][0].tolist()}
    train = {tuple(r) for r in task.sample(256, make_generator(0))[0].tolist()}
    assert len(val) == len(test) == 64 and not val & test and not val & train and not test & train


def test_exact_match_and_token_accuracy():
    task = VariableTracking(seq_len=96, num_chains=3, num_hops=2, num_queries=3)
    x, y = task.sample(4, make_generator(0))
    logits = one_hot_logits(y, task.vocab_size)
    assert task.evaluate(logits, x, y) == {"exact_match": 1.0, "accuracy": 1.0}
    b, t = (y != -100).nonzero()[4].tolist()  # one token of the second query of the first sequence
    logits[b, t] = -logits[b, t]
    assert task.evaluate(logits, x, y) == {"exact_match": pytest.approx(11 / 12), "accuracy": pytest.approx(35 / 36)}


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="num_queries"):
        VariableTracking(num_chains=1, num_queries=2)
    with pytest.raises(ValueError, match="query"):
        VariableTracking(query="names")
    with pytest.raises(ValueError, match="num_vars"):
        VariableTracking(num_chains=4, num_hops=4, num_vars=19)
    with pytest.raises(ValueError, match="no filler"):
        VariableTracking(seq_len=32, num_hops=4)
    with pytest.raises(ValueError, match="num_hops"):
        VariableTracking(num_hops=0)
    with pytest.raises(ValueError, match="test_lengths"):
        VariableTracking(seq_len=64, test_lengths=(64, 20))
