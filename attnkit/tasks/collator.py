"""A task's examples as Hugging Face batches: ``TaskStream`` (a torch dataset) and ``TaskCollator``.

A task yields ``input_ids [B, T]`` and ``labels [B, T]`` that are already aligned: ``labels[b, t]`` is the target
of position ``t`` (``-100``: not scored), and it is not always the next token (the running product of a group
word, the value at a VLA-MQAR query). ``forward(labels=...)`` would shift them a second time, so the collator
passes them as ``shift_labels``, which :class:`attnkit.models.AttnKitForCausalLM` scores as given::

    from transformers import Trainer, TrainingArguments
    from attnkit.tasks import TaskCollator, TaskStream, get_task

    task = get_task("group_words", k=16)
    args = TrainingArguments(out, max_steps=1000, per_device_train_batch_size=32, label_names=["shift_labels"])
    Trainer(model, args, train_dataset=TaskStream(task, batch_size=32), data_collator=TaskCollator()).train()

The batches mirror attnkit's trainer (``attnkit.train``): the same examples in the same order (see
:class:`TaskStream`), no ``attention_mask`` (the trainer passes none: every task's sequences start at position 0,
and the copying task's right padding is unscored and comes after every scored position, so a causal model's
scored outputs never see it), and the model's loss is the trainer's, the summed cross-entropy over the scored
targets divided by their number. ``label_names=["shift_labels"]`` lets the Trainer compute an evaluation loss
(its default, every forward argument named like a label, asks for ``labels`` too).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch.utils.data import IterableDataset

from .base import IGNORE_INDEX, Task, make_generator


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of training step ``step``'s global batch (``attnkit.train``'s ``batch_generator``)."""
    return make_generator(seed * 1_000_003 + step)


class TaskStream(IterableDataset):
    """The training examples of ``task``, one ``{"input_ids": [T], "shift_labels": [T]}`` dict (int64) at a time.

    Step ``s``'s batch is ``task.sample(batch_size, step_generator(seed, s))``, the batch attnkit's trainer draws at
    step ``s`` with the same seed; its rows are yielded in order, for ``steps`` steps (endless when None). A
    Trainer whose batch per device times the number of processes is ``batch_size`` therefore trains on attnkit's
    batches. Read it in one process (``dataloader_num_workers=0``, the Trainer's default): every worker would yield
    the whole stream.
    """

    def __init__(self, task: Task, batch_size: int, seed: int = 0, steps: int | None = None) -> None:
        super().__init__()
        if not isinstance(task, Task):
            raise ValueError(f"task: expected an attnkit Task, got {type(task).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"steps: expected None or a non-negative integer, got {steps!r}")
        self.task, self.batch_size, self.seed, self.steps = task, batch_size, int(seed), steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for step in itertools.count() if self.steps is None else range(self.steps):
            input_ids, labels = self.task.sample(self.batch_size, step_generator(self.seed, step))
            for row in range(input_ids.shape[0]):
                yield {"input_ids": input_ids[row], "shift_labels": labels[row]}


Example = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]


class TaskCollator:
    """Examples -> ``{"input_ids": [B, T], "shift_labels": [B, T]}``, int64, for ``AttnKitForCausalLM(**batch)``.

    An example is a dict with ``input_ids`` and ``shift_labels`` (as :class:`TaskStream` yields) or an
    ``(input_ids, labels)`` pair of 1-D tensors (a row of a task's ``sample`` or ``test_sets``); the labels are the
    task's aligned targets either way. Examples of different lengths are padded on the right, with
    ``pad_token_id`` and unscored targets, as the copying task pads its own batches; no ``attention_mask`` is needed
    for that (see the module docstring).
    """

    def __init__(self, pad_token_id: int = 0) -> None:
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id: expected a non-negative integer, got {pad_token_id!r}")
        self.pad_token_id = pad_token_id

    def __call__(self, examples: Sequence[Example]) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("examples: expected at least one example")
        rows = [self._pair(i, example) for i, example in enumerate(examples)]
        T = max(ids.shape[0] for ids, _ in rows)

        def stack(column: int, fill: int) -> torch.Tensor:
            return torch.stack(
                [torch.nn.functional.pad(r[column], (0, T - r[column].shape[0]), value=fill) for r in rows]
            )

        return {"input_ids": stack(0, self.pad_token_id), "shift_labels": stack(1, IGNORE_INDEX)}

    @staticmethod
    def _pair(index: int, example: Example) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(example, Mapping):
            if "input_ids" not in example or "shift_labels" not in example:
                raise ValueError(f"examples: example {index} lacks input_ids or shift_labels, has {sorted(example)}")
            ids, targets = example["input_ids"], example["shift_labels"]
        elif isinstance(example, Sequence) and len(example) == 2:
            ids, targets = example
        else:
            raise ValueError(f"examples: example {index} is neither a dict nor an (input_ids, labels) pair")
        ids, targets = torch.as_tensor(ids), torch.as_tensor(targets)
        if ids.dim() != 1 or ids.shape != targets.shape:
            raise ValueError(
                f"examples: example {index} has input_ids {list(ids.shape)} and targets {list(targets.shape)}; "
                "expected two 1-D tensors of one length"
            )
        if ids.is_floating_point() or targets.is_floating_point():
            raise ValueError(f"examples: example {index} holds floating-point ids or targets; expected integers")
        return ids.long(), targets.long()
