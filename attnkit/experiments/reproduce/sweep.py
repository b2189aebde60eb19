"""A comparison with its learning-rate sweep: every model, in every setting, trained with the same budget at each
learning rate of the grid (and each seed); the best learning rate is chosen on the validation split, and the
test metrics reported are that learning rate's, as the mean and spread over seeds.

Fairness is structural: the budget (steps, batch, warm-up, evaluation schedule) belongs to the ``Sweep``, not to a
model, so every model of a comparison sees the same number of sequences of the same length. A model's entry may
choose only its mixer, its model options and evaluation-time variants.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .cells import Cell

# what a model's entry may set: what it is (mixer, options, depth), never how long or how fast it trains
MODEL_KEYS = frozenset({"mixer", "model_options", "variants", "arch"})


class Missing(Exception):
    """A number a claim needs is not there (the cells have not run, or this scale does not run them)."""


class Diverged(Missing):
    """Every learning rate of a model diverged: the number exists in no form, and the budget decides nothing."""


@dataclass(frozen=True)
class Stat:
    """Mean and spread (sample standard deviation; 0 for one value) of ``n`` values."""

    mean: float
    spread: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> Stat:
        if not values:
            raise Missing("no values")
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return cls(statistics.fmean(values), spread, len(values))

    def __str__(self) -> str:
        return f"{self.mean:.3g} ± {self.spread:.2g}"


@dataclass(frozen=True)
class Budget:
    """What every model of a comparison gets: ``steps`` optimizer steps of ``batch_size`` sequences, warm-up over
    ``warmup`` of the steps, and ``evals`` evaluations of the validation split during training (the curves)."""

    steps: int
    batch_size: int
    warmup: float = 0.1
    evals: int = 4

    def train_fields(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "batch_size": self.batch_size,
            "warmup_steps": max(1, round(self.warmup * self.steps)),
            "eval_every": max(1, self.steps // self.evals),
            "log_every": max(1, self.steps // 20),
        }


@dataclass(frozen=True, eq=False)
class Sweep:
    """Models × settings × learning rates × seeds on one task with one budget.

    ``models``: label -> ``{"mixer", "model_options", "variants", "arch"}`` (``variants``: name -> mixer keyword
    overrides, evaluated on the trained weights, e.g. RoPE with PI scaling; ``arch``: overrides of the sweep's
    ``arch``, e.g. the number of layers). ``settings``: label -> the task
    options that vary (``task_options`` are shared). ``metric``: the task metric used both to choose the
    learning rate (on the validation split) and to report (on the test sets). ``x`` / ``x_label``: where each
    setting sits on the plot of the metric against the setting; ``test_x_label``: the test sets' names carry a
    number (a length) to plot the metric against.
    """

    name: str
    title: str
    task: str
    models: dict[str, dict[str, Any]]
    settings: dict[str, dict[str, Any]]
    budget: Budget
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    metric: str
    higher_is_better: bool = True
    task_options: dict[str, Any] = field(default_factory=dict)
    arch: dict[str, Any] = field(default_factory=dict)
    train_options: dict[str, Any] = field(default_factory=dict)
    x: dict[str, float] = field(default_factory=dict)
    x_label: str = ""
    test_x_label: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if len(self.lrs) < 3:
            raise ValueError(
                f"{self.name}: lrs: every model needs a sweep of at least 3 learning rates, got {self.lrs}"
            )
        if not self.seeds:
            raise ValueError(f"{self.name}: seeds: expected at least one seed")
        for label, model in self.models.items():
            extra = set(model) - MODEL_KEYS
            if extra or "mixer" not in model:
                raise ValueError(
                    f"{self.name}: models[{label!r}]: a model sets its mixer and may set only {sorted(MODEL_KEYS)}"
                    f" (the budget is the sweep's), got {sorted(model)}"
                )

    def cell(self, model: str, setting: str, lr: float, seed: int) -> Cell:
        spec = self.models[model]
        config = {
            "task": self.task,
            "task_options": {**self.task_options, **self.settings[setting]},
            "mixer": spec["mixer"],
            "model_options": spec.get("model_options", {}),
            **self.arch,
            **spec.get("arch", {}),
            **self.train_options,
            **self.budget.train_fields(),
            "lr": lr,
            "seed": seed,
        }
        params = {"config": config, "variants": spec.get("variants", {})}
        return Cell(self.name, f"{model} {setting} lr={lr:g} s{seed}", "train", params)

    def cells(self) -> list[Cell]:
        return [
            self.cell(model, setting, lr, seed)
            for setting in self.settings
            for model in self.models
            for lr in self.lrs
            for seed in self.seeds
        ]

    def budget_text(self, seq_len: int | None = None) -> str:
        b = self.budget
        length = f" × T={seq_len}" if seq_len else ""
        return (
            f"{b.steps} steps × {b.batch_size} seqs{length}, lr ∈ {{{', '.join(f'{lr:g}' for lr in self.lrs)}}}, "
            + (f"{len(self.seeds)} seed{'s' if len(self.seeds) > 1 else ''}")
        )


@dataclass
class Choice:
    """One model in one setting: the validation score of each learning rate and the chosen one's test metrics."""

    model: str
    setting: str
    scores: dict[float, float | None]  # lr -> mean validation score over seeds (None: not finished)
    lr: float | None = None  # the chosen learning rate (None until every cell has finished)
    test: dict[str, dict[str, Stat]] = field(default_factory=dict)  # set -> metric -> Stat over seeds
    variants: dict[str, dict[str, dict[str, Stat]]] = field(default_factory=dict)
    curves: list[list[tuple[int, float]]] = field(default_factory=list)  # per seed: (step, validation metric)
    seq_len: int | None = None
    diverged: list[float] = field(default_factory=list)  # learning rates with a non-finite loss


def _score(record: dict, metric: str) -> float | None:
    result = record["result"]
    if result["status"] != "ok":
        return None
    values = [m[metric] for m in result["validation"].values() if metric in m]
    return statistics.fmean(values) if values else None


def _curve(record: dict, metric: str) -> list[tuple[int, float]]:
    points = []
    for event in record["result"].get("events", []):
        if event.get("event") == "eval" and event.get("split") == "validation":
            values = [m[metric] for k, m in event.items() if isinstance(m, dict) and metric in m]
            if values:
                points.append((event["step"], statistics.fmean(values)))
    return points


def _stats(per_seed: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Stat]]:
    out: dict[str, dict[str, Stat]] = {}
    for set_name in per_seed[0]:
        out[set_name] = {
            metric: Stat.of([seed[set_name][metric] for seed in per_seed]) for metric in per_seed[0][set_name]
        }
    return out


@dataclass
class SweepResult:
    sweep: Sweep
    choices: dict[tuple[str, str], Choice]
    finished: int
    total: int
    wall_s: float  # summed over the finished cells

    def choice(self, model: str, setting: str) -> Choice:
        if model not in self.sweep.models or setting not in self.sweep.settings:
            raise Missing(f"{self.sweep.name}: {model} at {setting} is not run at this scale")
        choice = self.choices[(model, setting)]
        if choice.lr is None and all(v is not None for v in choice.scores.values()):
            raise Diverged(f"{self.sweep.name}: {model} at {setting}: every learning rate diverged")
        if choice.lr is None:
            left = sum(v is None for v in choice.scores.values())
            raise Missing(
                f"{self.sweep.name}: {model} at {setting}: {left} of {len(choice.scores)} learning rates not run"
            )
        return choice

    def stat(self, model: str, setting: str, test_set: str | None = None, metric: str | None = None) -> Stat:
        """The chosen learning rate's test ``metric`` (default: the sweep's) on ``test_set`` (default: the only one)."""
        return _pick(self.choice(model, setting).test, test_set, metric or self.sweep.metric, self.sweep.name)

    def variant_stat(self, model: str, setting: str, variant: str, test_set: str, metric: str | None = None) -> Stat:
        choice = self.choice(model, setting)
        if variant not in choice.variants:
            raise Missing(f"{self.sweep.name}: {model} has no variant {variant!r}")
        return _pick(choice.variants[variant], test_set, metric or self.sweep.metric, self.sweep.name)


def _pick(sets: dict[str, dict[str, Stat]], test_set: str | None, metric: str, where: str) -> Stat:
    if test_set is None:
        if len(sets) != 1:
            raise ValueError(f"{where}: name the test set, one of {sorted(sets)}")
        test_set = next(iter(sets))
    if test_set not in sets or metric not in sets[test_set]:
        raise Missing(f"{where}: no {metric} on test set {test_set!r}")
    return sets[test_set][metric]


def summarise(sweep: Sweep, records: dict[str, dict]) -> SweepResult:
    """Choose each model's learning rate per setting from the finished cells' records (``{cell name: record}``).

    The best mean validation score over seeds wins; ties go to the lower mean final training loss. A learning
    rate with a diverged seed scores worst. Nothing is chosen while any cell of the model and setting is missing.
    """
    choices = {}
    finished = wall = 0
    sign = 1.0 if sweep.higher_is_better else -1.0
    for setting in sweep.settings:
        for model in sweep.models:
            scores: dict[float, float | None] = {}
            ranks: dict[float, tuple[float, float]] = {}
            by_lr: dict[float, list[dict]] = {}
            diverged = []
            for lr in sweep.lrs:
                recs = [records.get(sweep.cell(model, setting, lr, seed).name) for seed in sweep.seeds]
                done = [r for r in recs if r is not None]
                finished += len(done)
                wall += sum(r["wall_s"] for r in done)
                if len(done) < len(recs):
                    scores[lr] = None
                    continue
                values = [_score(r, sweep.metric) for r in done]
                if any(v is None for v in values):
                    diverged.append(lr)
                    scores[lr] = -math.inf * sign
                    ranks[lr] = (-math.inf, -math.inf)
                    continue
                scores[lr] = statistics.fmean(values)
                loss = statistics.fmean(r["result"]["final_loss"] for r in done)
                ranks[lr] = (sign * scores[lr], -loss)
                by_lr[lr] = done
            choice = Choice(model, setting, scores, diverged=diverged)
            if all(v is not None for v in scores.values()) and by_lr:
                lr = max(by_lr, key=lambda k: ranks[k])
                chosen = [r["result"] for r in by_lr[lr]]
                choice.lr = lr
                choice.test = _stats([r["test"] for r in chosen])
                names = chosen[0].get("variants", {})
                choice.variants = {v: _stats([r["variants"][v] for r in chosen]) for v in names}
                choice.curves = [_curve(r, sweep.metric) for r in by_lr[lr]]
                choice.seq_len = chosen[0].get("seq_len")
            choices[(model, setting)] = choice
    total = len(sweep.settings) * len(sweep.models) * len(sweep.lrs) * len(sweep.seeds)
    return SweepResult(sweep, choices, finished, total, wall)
