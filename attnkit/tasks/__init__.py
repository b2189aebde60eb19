"""Synthetic and language-modelling tasks: seeded generators, fixed test sets and the papers' metrics.

Every task follows ``attnkit.tasks.base.Task``: ``sample(batch_size, generator) -> (input_ids, labels)``
(``[B, T]`` int64, labels already shifted, -100 where nothing is scored), ``test_sets()`` and
``evaluate(outputs, input_ids, labels)``. ``get_task(name, **options)`` builds one by its registry name.
"""

from __future__ import annotations

from .base import IGNORE_INDEX, Batch, Task, make_generator
from .collator import TaskCollator, TaskStream, step_generator
from .copying import Copying
from .flipflop import FlipFlop
from .group_words import GROUP_NAMES, GroupWords, get_group
from .language import LanguageModeling, per_position_loss
from .mqar import MQAR, MQARVLA
from .mqrar import MQRAR
from .passkey import Passkey
from .variable_tracking import VariableTracking

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (FlipFlop, GroupWords, MQAR, MQARVLA, MQRAR, Copying, Passkey, VariableTracking, LanguageModeling)
}


def get_task(name: str, **options) -> Task:
    """The task registered as ``name`` (a key of ``TASKS``), built with ``options`` (its constructor's keywords,
    ``seed`` included)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](**options)


__all__ = [
    "GROUP_NAMES",
    "IGNORE_INDEX",
    "MQAR",
    "MQARVLA",
    "MQRAR",
    "TASKS",
    "Batch",
    "Copying",
    "FlipFlop",
    "GroupWords",
    "LanguageModeling",
    "Passkey",
    "Task",
    "TaskCollator",
    "TaskStream",
    "VariableTracking",
    "get_group",
    "get_task",
    "make_generator",
    "per_position_loss",
    "step_generator",
]
