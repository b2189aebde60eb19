"""The interface every task implements, and the metric helpers the tasks share.

Splits (every task): training batches are drawn fresh from the generator the trainer passes to ``sample``;
the ``validation`` split (``validation_sets``: for choosing learning rates and other settings) and the ``test``
split (``test_sets``: for the numbers reported) are fixed, and each is drawn from its own named stream derived
from the task's seed (``validation_generator``, ``test_generator``), distinct from each other and from the
trainer's per-step streams. The validation split follows the training distribution at the training length;
the test sets are the task's source paper's. Distinct streams do not always mean distinct examples: where the
space of examples is small (copying strings of a few letters) the same example can occur in two splits.

Label convention (every task): ``labels[b, t]`` is the target of the model's output at position ``t``; it is
already shifted, so the loss is ``cross_entropy(logits[b, t], labels[b, t])`` over ``labels != -100``. Do not
pass these labels to a Hugging Face ``forward(labels=...)``, which would shift them a second time.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import torch

IGNORE_INDEX = -100
SPLITS = ("validation", "test")

Batch = tuple[torch.Tensor, torch.Tensor]


def make_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (the same stream in every process and on every machine)."""
    return torch.Generator().manual_seed(int(seed))


def derived_seed(seed: int, name: str) -> int:
    """A seed for the stream called ``name`` of a task seeded with ``seed``; stable across processes.

    ``hash(str)`` is salted per process, so the name goes through CRC32 instead.
    """
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def as_predictions(outputs: torch.Tensor) -> torch.Tensor:
    """``outputs``: logits ``[B, T, V]`` (floating) or predicted ids ``[B, T]`` (integer) -> ids ``[B, T]`` int64."""
    if outputs.is_floating_point():
        if outputs.dim() != 3:
            raise ValueError(f"outputs: logits must be [B, T, V], got shape {tuple(outputs.shape)}")
        return outputs.argmax(-1)
    if outputs.dim() != 2:
        raise ValueError(f"outputs: predictions must be [B, T], got shape {tuple(outputs.shape)}")
    return outputs.long()


def uniform_choice(batch: int, n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct integers from ``[0, n)`` per row, in random order: ``[batch, k]`` int64.

    Random float64 keys make ties (and so an order that depends on the sort algorithm) practically impossible.
    """
    if k > n:
        raise ValueError(f"cannot draw {k} distinct values from {n}")
    keys = torch.rand(batch, n, generator=generator, dtype=torch.float64)
    return keys.topk(k, dim=-1).indices


class Task(ABC):
    """A sequence task: fresh training batches, fixed test sets and the metric of its source paper.

    Subclasses set ``name`` (the registry name), ``vocab_size`` and ``seq_len`` (the training length), and
    implement ``sample``, ``_build_test_sets``, ``statistics`` and ``finalize``. The validation split defaults to
    ``validation_size`` fresh ``sample`` sequences from the validation stream (``_build_validation_sets``).

    Metrics are split into additive ``statistics`` (sums and counts, so chunks and data-parallel ranks can be
    summed or all-reduced) and ``finalize`` (the ratios reported); ``evaluate`` does both on one batch.
    """

    name: str = ""
    vocab_size: int
    seq_len: int

    def __init__(self, seed: int = 0, validation_size: int = 256) -> None:
        if isinstance(validation_size, bool) or not isinstance(validation_size, int) or validation_size < 1:
            raise ValueError(f"validation_size: expected a positive integer, got {validation_size!r}")
        self.seed = int(seed)
        self.validation_size = validation_size
        self._sets: dict[str, dict[str, Batch]] = {}

    @abstractmethod
    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        """Fresh training data: ``input_ids [B, T]`` int64 and ``labels [B, T]`` int64 (-100: not scored)."""

    @abstractmethod
    def _build_test_sets(self) -> dict[str, Batch]:
        """The test sets, built from generators derived from ``self.seed`` only."""

    def _build_validation_sets(self) -> dict[str, Batch]:
        """The validation split: ``validation_size`` training-distribution sequences from the validation stream."""
        return {"validation": self.sample(self.validation_size, self.validation_generator("validation"))}

    def split_sets(self, split: str) -> dict[str, Batch]:
        """The fixed sets of ``split`` ("validation" or "test"): ``{name: (input_ids [N, T], labels [N, T])}``, the
        same tensors every call and process. Built once and cached; callers must not modify them in place."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        if split not in self._sets:
            self._sets[split] = self._build_validation_sets() if split == "validation" else self._build_test_sets()
        return self._sets[split]

    def test_sets(self) -> dict[str, Batch]:
        """The test split: the sets the task's source paper reports (see ``split_sets``)."""
        return self.split_sets("test")

    def validation_sets(self) -> dict[str, Batch]:
        """The validation split, for choosing settings such as the learning rate (see ``split_sets``)."""
        return self.split_sets("validation")

    def test_generator(self, set_name: str) -> torch.Generator:
        """The generator a test set called ``set_name`` is drawn from (independent of training generators)."""
        return make_generator(derived_seed(self.seed, f"{self.name}/test/{set_name}"))

    def validation_generator(self, set_name: str) -> torch.Generator:
        """The generator a validation set called ``set_name`` is drawn from (independent of training and test)."""
        return make_generator(derived_seed(self.seed, f"{self.name}/validation/{set_name}"))

    @abstractmethod
    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Additive sums and counts of the metric on one batch.

        ``outputs``: logits ``[B, T, V]`` (floating) or predicted ids ``[B, T]`` (integer; tasks whose metric needs
        logits, such as perplexity, reject them). ``input_ids``, ``labels``: ``[B, T]`` int64.
        """

    @abstractmethod
    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        """The reported metrics from summed ``statistics``."""

    def evaluate(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """The task's metric on one batch (see ``statistics`` for the shapes)."""
        return self.finalize(self.statistics(outputs, input_ids, labels))

    @torch.no_grad()
    def evaluate_model(
        self,
        logits_fn: Callable[[torch.Tensor], torch.Tensor],
        batch_size: int = 64,
        sets: Iterable[str] | None = None,
        split: str = "test",
    ) -> dict[str, dict[str, float]]:
        """Run ``logits_fn(input_ids [b, T]) -> logits [b, T, V]`` over the sets of ``split`` ("test" or
        "validation"; ``sets`` picks some by name) in chunks of ``batch_size``.

        Returns ``{set name: metrics}``. The inputs stay on the CPU; ``logits_fn`` moves them to its device.
        """
        results = {}
        for set_name, (input_ids, labels) in self.split_sets(split).items():
            if sets is not None and set_name not in sets:
                continue
            total: dict[str, float] = {}
            for start in range(0, input_ids.shape[0], batch_size):
                x, y = input_ids[start : start + batch_size], labels[start : start + batch_size]
                out = logits_fn(x).detach().float().cpu()
                for key, value in self.statistics(out, x, y).items():
                    total[key] = total.get(key, 0.0) + value
            results[set_name] = self.finalize(total)
        return results


def check_batch(outputs: torch.Tensor, labels: torch.Tensor) -> None:
    if outputs.shape[:2] != labels.shape:
        raise ValueError(f"outputs {tuple(outputs.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")


def accuracy_statistics(outputs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Token and whole-sequence accuracy over the positions where ``labels != -100``.

    A sequence counts as right when every scored position in it is right.
    """
    check_batch(outputs, labels)
    pred = as_predictions(outputs)
    scored = labels != IGNORE_INDEX
    wrong = (pred != labels) & scored
    return {
        "correct": float((~wrong & scored).sum()),
        "scored": float(scored.sum()),
        "sequences_correct": float((~wrong.any(-1)).sum()),
        "sequences": float(labels.shape[0]),
    }


def accuracy_metrics(stats: dict[str, float]) -> dict[str, float]:
    """``accuracy`` (per scored token) and ``sequence_accuracy`` from summed ``accuracy_statistics``."""
    return {
        "accuracy": stats["correct"] / max(stats["scored"], 1.0),
        "sequence_accuracy": stats["sequences_correct"] / max(stats["sequences"], 1.0),
    }


class AccuracyTask(Task):
    """A task scored by accuracy over its labelled positions (MQAR, group words, copying)."""

    def statistics(self, outputs: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return accuracy_statistics(outputs, labels)

    def finalize(self, stats: dict[str, float]) -> dict[str, float]:
        return accuracy_metrics(stats)
