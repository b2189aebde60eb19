"""The trainer scores the validation split during training and both splits at the end, and logs which is which."""

from __future__ import annotations

import json

import torch

from attnkit.tasks import get_task
from attnkit.train import train

from .test_trainer import tiny


def test_validation_during_training_and_both_splits_at_the_end(tmp_path):
    options = {"seq_len": 16, "test_sizes": {"in_distribution": 8, "sparse": 8, "dense": 8}, "validation_size": 6}
    config = tiny(tmp_path, "run", task_options=options, eval_every=2)
    result = train(config)
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    evals = [
        (e["step"], e["split"], sorted(k for k in e if k not in ("event", "step", "split")))
        for e in events
        if e["event"] == "eval"
    ]
    assert evals == [
        (2, "validation", ["validation"]),
        (4, "validation", ["validation"]),
        (6, "validation", ["validation"]),
        (6, "test", ["dense", "in_distribution", "sparse"]),
    ]
    assert set(result.metrics) == {"in_distribution", "sparse", "dense"}
    assert set(result.validation_metrics) == {"validation"}
    final = json.load(open(tmp_path / "run" / "final.json"))
    assert final["metrics"] == result.metrics and final["validation_metrics"] == result.validation_metrics

    # the logged validation metric is the model's on the task's validation set, not on a test set
    task = get_task("flipflop", seed=config.seed, **options)
    with torch.no_grad():
        model = result.model.eval()
        again = task.evaluate_model(lambda x: model(input_ids=x, use_cache=False).logits, split="validation")
    assert again == result.validation_metrics
