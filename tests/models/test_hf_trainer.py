"""Aligned targets: ``forward(shift_labels=...)``, the task collator and transformers' Trainer (issue 19)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from attnkit.models import MIXERS
from attnkit.tasks import TaskCollator, TaskStream, get_task
from attnkit.train import train
from attnkit.train.trainer import build_model
from tests.models.test_models import tiny_model
from tests.train.test_trainer import tiny

VOCAB = 61


@pytest.mark.parametrize("mixer", MIXERS)
def test_shift_labels_equal_labels_on_next_tokens(mixer):
    """``labels`` are shifted inside, ``shift_labels`` are not: next-token targets give one loss and gradient."""
    model = tiny_model(mixer).train()
    ids = torch.randint(1, VOCAB, (3, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    aligned = F.pad(labels[:, 1:], (0, 1), value=-100)
    results = []
    for targets in (dict(labels=labels), dict(shift_labels=aligned), dict(labels=ids, shift_labels=aligned)):
        model.zero_grad(set_to_none=True)
        loss = model(ids, use_cache=False, **targets).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    expected = F.cross_entropy(model(ids, use_cache=False).logits.flatten(0, 1), aligned.flatten())
    for loss, grads in results:
        torch.testing.assert_close(loss, expected)
        for g, g_ref in zip(grads, results[0][1]):
            torch.testing.assert_close(g, g_ref)


def test_shift_labels_score_each_position_against_its_own_target():
    """Targets that are not the next token (a task's): position t is scored against shift_labels[:, t]."""
    model = tiny_model("vla")
    ids = torch.randint(1, VOCAB, (2, 6))
    targets = torch.randint(0, VOCAB, (2, 6))
    targets[1, 2] = -100
    out = model(ids, shift_labels=targets, use_cache=False)
    expected = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    summed = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    items = model(ids, shift_labels=targets, use_cache=False, num_items_in_batch=torch.tensor(20)).loss
    torch.testing.assert_close(items, summed / 20)


def test_collator_stacks_and_pads():
    collate = TaskCollator(pad_token_id=3)
    batch = collate(
        [
            {"input_ids": torch.tensor([5, 6, 7]), "shift_labels": torch.tensor([-100, 1, 2])},
            (torch.tensor([8]), torch.tensor([4])),
        ]
    )
    assert batch.keys() == {"input_ids", "shift_labels"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    assert batch["shift_labels"].tolist() == [[-100, 1, 2], [4, -100, -100]]
    assert batch["input_ids"].dtype == batch["shift_labels"].dtype == torch.int64


@pytest.mark.parametrize(
    "examples,match",
    [
        ([], "^examples: expected at least one"),
        ([{"input_ids": torch.ones(3, dtype=torch.long)}], "^examples: example 0 lacks"),
        ([(torch.ones(3, dtype=torch.long), torch.ones(2, dtype=torch.long))], "^examples: example 0 has"),
        ([(torch.ones(3), torch.ones(3))], "^examples: example 0 holds floating"),
        ([7], "^examples: example 0 is neither"),
    ],
    ids=["empty", "missing", "lengths", "float", "scalar"],
)
def test_collator_rejects_bad_examples(examples, match):
    with pytest.raises(ValueError, match=match):
        TaskCollator()(examples)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(batch_size=0), "^batch_size"), (dict(steps=-1), "^steps"), (dict(task="mqar"), "^task")],
    ids=["batch", "steps", "task"],
)
def test_stream_rejects_bad_arguments(kwargs, match):
    settings = dict(task=get_task("group_words", k=4), batch_size=2)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TaskStream(**settings)


def test_stream_yields_the_task_batches_in_order():
    task = get_task("mqar_vla")
    rows = list(TaskStream(task, batch_size=3, seed=5, steps=2))
    assert len(rows) == 6
    for step in range(2):
        ids, labels = task.sample(3, torch.Generator().manual_seed(5 * 1_000_003 + step))
        for b in range(3):
            assert torch.equal(rows[3 * step + b]["input_ids"], ids[b])
            assert torch.equal(rows[3 * step + b]["shift_labels"], labels[b])


class RecordingTrainer(Trainer):
    """Records the loss the Trainer trains on, next to attnkit's trainer loss on the same batch and weights."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[float, float, float]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            with torch.no_grad():
                logits = model(input_ids=inputs["input_ids"], use_cache=False).logits.float()
                targets = inputs["shift_labels"]
                # attnkit.train's loss: summed cross-entropy over the scored targets over their number
                total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
                ours = (total / max(int((targets != -100).sum()), 1)).item()
                shifted_twice = model(input_ids=inputs["input_ids"], labels=targets, use_cache=False).loss.item()
            self.seen.append((loss.item(), ours, shifted_twice))
        return loss


def test_hf_trainer_trains_on_a_task(tmp_path):
    """Two steps of transformers' Trainer on group words (targets: running products, not next tokens): the loss it
    trains on is attnkit's trainer loss on the same batch (float32 rounding: relative 1e-6), and not the loss of
    the targets shifted once more; its first loss is the first loss of attnkit's own run on the same seed."""
    config = tiny(
        tmp_path, "attnkit", task="group_words", task_options={"k": 8, "test_size": 8}, steps=1, warmup_steps=0, seed=3
    )
    attnkit_first_loss = train(config).loss

    task = get_task(config.task, seed=config.seed, **config.task_options)
    model = build_model(config, task.vocab_size, task.seq_len)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=2,
        per_device_train_batch_size=config.batch_size,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        label_names=["shift_labels"],
        disable_tqdm=True,
    )
    stream = TaskStream(task, batch_size=config.batch_size, seed=config.seed)
    test_ids, test_labels = task.test_sets()["test"]
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=stream,
        eval_dataset=list(zip(test_ids, test_labels)),
        data_collator=TaskCollator(),
    )
    trainer.train()
    assert trainer.state.global_step == 2 and len(trainer.seen) == 2
    for seen, ours, shifted_twice in trainer.seen:
        assert seen == pytest.approx(ours, rel=1e-6)
        assert abs(seen - shifted_twice) > 1e-3
    assert trainer.seen[0][0] == pytest.approx(attnkit_first_loss, rel=1e-6)
    assert trainer.seen[1][0] != trainer.seen[0][0]

    eval_loss = trainer.evaluate()["eval_loss"]
    with torch.no_grad():
        logits = model(input_ids=test_ids, use_cache=False).logits
    expected = F.cross_entropy(logits.flatten(0, 1), test_labels.flatten(), ignore_index=-100).item()
    assert eval_loss == pytest.approx(expected, rel=1e-5)
