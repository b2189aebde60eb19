"""Training, validation and test splits: each from its own stream, fixed by the seed, and not overlapping."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks import TASKS, LanguageModeling, get_task
from attnkit.train.trainer import batch_generator

from .test_language import corpus_dir  # noqa: F401  (the module's fixture)
from .test_registry import SMALL

STEPS_CHECKED = 10**7  # training streams of the first ten million steps
COPY_UNIQUE_LEN = 8  # 26**8 strings: below this length copy strings may repeat across splits by chance


def split_seeds(task) -> dict[str, int]:
    seeds = {f"validation/{name}": task.validation_generator(name).initial_seed() for name in task.validation_sets()}
    seeds.update({f"test/{name}": task.test_generator(name).initial_seed() for name in task.test_sets()})
    return seeds


@pytest.mark.parametrize("name", sorted(SMALL))
@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_split_streams_are_distinct_from_each_other_and_from_training(name, seed):
    task = get_task(name, seed=seed, **SMALL[name])
    seeds = split_seeds(task)
    assert len(set(seeds.values())) == len(seeds), seeds
    # the trainer's step streams are consecutive seeds from batch_generator(seed, 0)
    first = batch_generator(seed, 0).initial_seed()
    assert batch_generator(seed, 977).initial_seed() == first + 977
    clashes = {k: s - first for k, s in seeds.items() if 0 <= s - first < STEPS_CHECKED}
    assert not clashes, f"these splits reuse the training stream of a step: {clashes}"


def rows(x: torch.Tensor) -> set[bytes]:
    """The rows of ``x`` without trailing zeros (copying pads with 0), so sets of other lengths compare too."""
    out = set()
    for row in x:
        nonzero = row.nonzero()
        out.add(row[: int(nonzero[-1]) + 1 if nonzero.numel() else 0].numpy().tobytes())
    return out


@pytest.mark.parametrize("name", sorted(SMALL))
def test_validation_split_is_fixed_follows_training_and_shares_no_example(name):
    options = {**SMALL[name], "validation_size": 24}
    if name == "copying":
        options.update(max_len=12, test_lengths=(8, 12, 24))
    task = get_task(name, seed=3, **options)
    val = task.validation_sets()
    assert list(val) == ["validation"] and task.validation_sets() is val
    vx, vy = val["validation"]
    assert vx.shape == vy.shape == (24, task.seq_len) and vx.dtype == vy.dtype == torch.int64
    assert (vy != -100).any()
    again = get_task(name, seed=3, **options).validation_sets()["validation"]
    other = get_task(name, seed=4, **options).validation_sets()["validation"]
    assert torch.equal(vx, again[0]) and torch.equal(vy, again[1]) and not torch.equal(vx, other[0])
    assert task.split_sets("test") is task.test_sets() and task.split_sets("validation") is val

    train = torch.cat([task.sample(16, batch_generator(3, step))[0] for step in range(8)])
    test = [x for x, _ in task.test_sets().values()]
    if name == "copying":  # only strings long enough not to repeat by chance are compared
        keep = lambda x: x[(x == 2).nonzero()[:, 1] > COPY_UNIQUE_LEN]  # noqa: E731  (SEP after >= 8 letters)
        train, vx, test = keep(train), keep(vx), [keep(x) for x in test]
        assert vx.shape[0] > 0
    val_rows, train_rows = rows(vx), rows(train)
    test_rows = set().union(*(rows(x) for x in test))
    assert len(val_rows) == vx.shape[0]
    assert not val_rows & train_rows and not val_rows & test_rows and not train_rows & test_rows


def test_every_task_takes_a_validation_size():
    for name, cls in TASKS.items():
        with pytest.raises(ValueError, match="validation_size"):
            cls(validation_size=0, **SMALL.get(name, {"corpus": "stdlib", "max_documents": 2}))


def test_evaluate_model_scores_the_split_asked_for():
    task = get_task("mqar_vla", seed=0, num_kv_pairs=4, test_size=8, validation_size=12)
    seen = []

    def logits_fn(ids):
        seen.append(ids.shape[0])
        return torch.zeros(*ids.shape, task.vocab_size)

    assert list(task.evaluate_model(logits_fn, split="validation")) == ["validation"]
    assert seen == [12]
    assert list(task.evaluate_model(logits_fn)) == ["n4"] and seen == [12, 8]
    with pytest.raises(ValueError, match="split"):
        task.evaluate_model(logits_fn, split="train")


def test_lm_validation_windows_lie_after_the_test_span(corpus_dir):  # noqa: F811
    task = LanguageModeling(
        corpus=str(corpus_dir), seq_len=32, eval_multipliers=(1, 2), eval_tokens=256, validation_size=5
    )
    vx, vy = task.validation_sets()["validation"]
    assert vx.shape == (5, 32)
    span = task.test_sets()["len32"][0].numel()
    assert span == 256
    held_out = task.val_stream
    # consecutive windows starting after the last token any test set scores (held-out token `span`)
    expected = held_out[span + 1 : span + 1 + 5 * 32 + 1]
    assert torch.equal(vx.reshape(-1), expected[:-1]) and torch.equal(vy.reshape(-1), expected[1:])
    tiny = LanguageModeling(corpus=str(corpus_dir), seq_len=32, eval_multipliers=(1,), eval_tokens=10**9)
    with pytest.warns(UserWarning, match="validation"):
        assert tiny.validation_sets() == {}
