"""The names attnkit registers, as plain data, for code that must not import the modules defining them.

The command line builds its ``--task`` and ``--mixer`` choices from here, so ``attnkit --help`` imports neither
torch nor the tasks nor the models. ``tests/cli/test_registry.py`` holds every tuple to its source:
``TASK_NAMES`` to ``attnkit.tasks.TASKS``, ``MIXER_NAMES`` to ``attnkit.models.MIXERS`` and the metric names to
what the tasks' ``finalize`` returns.
"""

from __future__ import annotations

TASK_NAMES = ("copying", "flipflop", "group_words", "lm", "mqar", "mqar_vla", "mqrar", "passkey", "variable_tracking")
MIXER_NAMES = ("path", "path_fox", "tapa", "vla", "rope", "nope", "fox", "linear", "deltanet", "stickbreaking")

# The metric that matters in a task's evaluation: the first of these that the task reports (flip-flop's read
# error, passkey's exact match, language modelling's perplexity, the recall tasks' accuracy).
HEADLINE_METRICS = ("read_error", "exact_match", "perplexity", "accuracy")
# Metrics that are fractions in [0, 1], shown as percents; the others (loss, perplexity) are shown as numbers.
FRACTION_METRICS = ("read_error", "sequence_error", "exact_match", "digit_accuracy", "accuracy", "sequence_accuracy")
NUMBER_METRICS = ("loss", "perplexity")
