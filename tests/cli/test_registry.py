"""attnkit.registry's plain names stay in step with the modules they stand for."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import MIXERS
from attnkit.registry import FRACTION_METRICS, HEADLINE_METRICS, MIXER_NAMES, NUMBER_METRICS, TASK_NAMES
from attnkit.tasks import TASKS, make_generator


def test_names_match_the_registries():
    assert TASK_NAMES == tuple(sorted(TASKS))
    assert MIXER_NAMES == MIXERS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return str(path)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_every_metric_a_task_reports_is_classified_and_one_is_its_headline(name, corpus):
    options = {"corpus": corpus, "seq_len": 32, "eval_multipliers": (1,), "eval_tokens": 256} if name == "lm" else {}
    task = TASKS[name](**options)
    x, y = task.sample(2, make_generator(0))
    metrics = task.evaluate(torch.randn(*x.shape, task.vocab_size), x, y)
    assert set(metrics) <= set(FRACTION_METRICS) | set(NUMBER_METRICS), sorted(metrics)
    assert any(m in metrics for m in HEADLINE_METRICS)
    assert not set(FRACTION_METRICS) & set(NUMBER_METRICS)
