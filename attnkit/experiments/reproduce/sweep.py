"""A comparison with its learning-rate sweep: every model, in every setting, trained with the same budget at each
learning rate of the grid (and each seed); the best learning rate is chosen on the validation split, and the
test metrics reported are that learning rate's, as the mean and spread over seeds.

Fairness is structural: the budget (steps, batch, warm-up, evaluation schedule) belongs to the ``Sweep``, not to a
model, so every model of a comparison sees the same number of sequences of the same length. A model's entry may
choose only its mixer, its model options and evaluation-time variants.

A chained sweep (``parent``) is a second stage: each of its models continues a model of the parent sweep (its
``"from"``), the one trained at the learning rate the parent chose on its validation split, seed by seed (seed
``s`` continues seed ``s``); the stage then sweeps its own learning rates, chosen on validation again. A model
whose mixer differs from its parent's starts from the parent converted to that mixer (``cells.convert_model``).
Its cells exist only once the parent's choice is made (``cells(records)``), and each names its parent cell, so a
changed parent (or a changed choice) makes new cells.

A laddered sweep (``stop_at``) asks for the fewest layers that reach a score: the models of one mixer (and model
options) are the rungs of a ladder, shallowest first, and a rung's cells exist only once every shallower rung has
chosen its learning rate without reaching ``stop_at`` on the test metric. A rung above one that reached it is *not
needed*: it never runs, and the claim reads the shallower rung. Its cells too appear as the earlier ones finish.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .cells import Cell

# what a model's entry may set: what it is (mixer, options, depth), never how long or how fast it trains
MODEL_KEYS = frozenset({"mixer", "model_options", "variants", "arch", "from", "probes"})
SHAPE_KEYS = ("hidden_size", "num_layers", "num_heads")


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
        if not all(math.isfinite(v) for v in values):  # a diverged run or an overflowed probe: no spread
            return cls(statistics.fmean(values), math.nan, len(values))
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
    ``arch``, e.g. the number of layers; ``from``: in a chained sweep, the parent's model it continues; ``probes``:
    name -> keyword arguments of the ``probes.TRAINED_PROBES`` measured on the trained model, kept per seed).
    ``settings``: label -> the task
    options that vary (``task_options`` are shared). ``metric``: the task metric used both to choose the
    learning rate (on the validation split) and to report (on the test sets). ``x`` / ``x_label``: where each
    setting sits on the plot of the metric against the setting; ``test_x_label``: the test sets' names carry a
    number (a length) to plot the metric against. ``keep``: the models whose trained weights are kept, for a
    chained sweep to continue; ``parent``: the sweep this one continues (see the module docstring), with one
    setting and the same seeds.
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
    keep: tuple[str, ...] = ()
    parent: Sweep | None = None
    stop_at: float | None = None

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
        if not set(self.keep) <= set(self.models):
            raise ValueError(f"{self.name}: keep: {sorted(set(self.keep) - set(self.models))} are not models here")
        if self.stop_at is not None:
            if self.parent is not None:
                raise ValueError(f"{self.name}: stop_at: a chained sweep cannot be laddered")
            for label in self.models:
                below = self.rungs_below(label)
                if below and self.shape(below[-1])[1] >= self.shape(label)[1]:
                    raise ValueError(
                        f"{self.name}: stop_at: the rungs of a ladder are declared shallowest first, got "
                        f"{below[-1]!r} ({self.shape(below[-1])[1]} layers) before {label!r} ({self.shape(label)[1]})"
                    )
        if self.parent is None:
            if any("from" in model for model in self.models.values()):
                raise ValueError(f"{self.name}: a model continues another ('from') only in a sweep with a parent")
            return
        parent = self.parent
        if len(parent.settings) != 1 or parent.seeds != self.seeds:
            raise ValueError(
                f"{self.name}: parent: a chained sweep continues a sweep of one setting with the same seeds, got "
                f"{parent.name} with settings {list(parent.settings)} and seeds {parent.seeds} (here {self.seeds})"
            )
        for label, model in self.models.items():
            source = model.get("from")
            if source not in parent.keep:
                raise ValueError(
                    f"{self.name}: models[{label!r}]: from: expected a model whose weights {parent.name} keeps "
                    f"({sorted(parent.keep)}), got {source!r}"
                )
            if self.shape(label) != parent.shape(source):
                raise ValueError(
                    f"{self.name}: models[{label!r}]: shape {self.shape(label)} differs from its parent "
                    f"{parent.name}/{source} {parent.shape(source)}"
                )

    def rungs_below(self, model: str) -> list[str]:
        """In a laddered sweep, the models declared before ``model`` with its mixer and model options."""
        spec = self.models[model]
        same = [m for m, other in self.models.items() if (other["mixer"], other.get("model_options")) == (
            spec["mixer"], spec.get("model_options"))]  # fmt: skip
        return same[: same.index(model)]

    def shape(self, model: str) -> tuple:
        """The model's ``(hidden_size, num_layers, num_heads)`` where the sweep sets them (None where not)."""
        arch = {**self.arch, **self.models[model].get("arch", {})}
        return tuple(arch.get(key) for key in SHAPE_KEYS)

    def parent_lr(self, model: str, parent: SweepResult) -> float:
        """The learning rate at which the parent trained the model ``model`` continues; ``Missing`` (or
        ``Diverged``) while the parent has not chosen it."""
        return parent.choice(self.models[model]["from"], next(iter(parent.sweep.settings))).lr

    def cell(self, model: str, setting: str, lr: float, seed: int, parent: SweepResult | None = None) -> Cell:
        """The cell of ``model`` at ``setting``, ``lr`` and ``seed``; in a chained sweep ``parent`` is the parent
        sweep's summary, which must have chosen the learning rate of the model this one continues."""
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
        if "probes" in spec:
            params["probes"] = spec["probes"]
        parent_cell = None
        if self.parent is not None:
            if parent is None:
                raise ValueError(f"{self.name}: parent: a chained sweep's cells need the parent's summary")
            source = spec["from"]
            parent_setting = next(iter(self.parent.settings))
            parent_cell = self.parent.cell(source, parent_setting, self.parent_lr(model, parent), seed)
            if spec["mixer"] != self.parent.models[source]["mixer"]:
                params["convert"] = {"mixer": spec["mixer"]}
        label = f"{model} {setting} lr={lr:g} s{seed}"
        return Cell(self.name, label, "train", params, parent_cell, keep=model in self.keep)

    def cells(self, records: dict[str, dict] | None = None) -> list[Cell]:
        """The cells of the sweep that can be declared with the finished ``records`` (``{cell name: record}``):
        all of them, except in a chained sweep those whose parent has not chosen its learning rate yet, and in a
        laddered one the rungs that wait for a shallower one or are not needed."""
        parent = summarise(self.parent, records or {}) if self.parent is not None else None
        own = summarise(self, records or {}) if self.stop_at is not None else None
        out = []
        for setting in self.settings:
            for model in self.models:
                if own is not None:
                    rung = own.choices[(model, setting)]
                    if rung.waiting or rung.not_needed:
                        continue  # a rung above one still running, or above one that reached stop_at
                try:
                    out += [self.cell(model, setting, lr, seed, parent) for lr in self.lrs for seed in self.seeds]
                except Missing:
                    continue
        return out

    def budget_text(self, seq_len: int | None = None) -> str:
        b = self.budget
        length = f" × T={seq_len}" if seq_len else ""
        after = f" after {self.parent.name}" if self.parent is not None else ""
        return (
            f"{b.steps} steps × {b.batch_size} seqs{length}{after}, lr ∈ "
            f"{{{', '.join(f'{lr:g}' for lr in self.lrs)}}}, "
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
    parent_lr: float | None = None  # chained sweeps: the learning rate of the parent this model continues
    probes: dict[str, list[dict]] = field(default_factory=dict)  # trained-model probes: name -> per seed
    waiting: str = ""  # chained sweeps: why the parent has not chosen it yet; laddered: the rung it waits for
    parent_diverged: bool = False  # ... because every learning rate of the parent diverged
    not_needed: str = ""  # laddered sweeps: the shallower rung that reached stop_at

    def edge(self, higher_is_better: bool) -> str:
        """``"lowest"`` or ``"highest"`` where the chosen learning rate is the sweep's smallest or largest and
        validation scored it strictly better than the next one inward (a diverged one scores worst): the model's best
        learning rate may lie outside the sweep. ``""`` otherwise, a tie with the next one included (a plateau says
        nothing of what lies beyond it)."""
        lrs = sorted(self.scores)
        if self.lr is None or len(lrs) < 2 or self.lr not in (lrs[0], lrs[-1]):
            return ""
        inner = self.scores[lrs[1] if self.lr == lrs[0] else lrs[-2]]
        chosen = self.scores[self.lr]
        if inner is None or chosen is None or not (chosen > inner if higher_is_better else chosen < inner):
            return ""
        return "lowest" if self.lr == lrs[0] else "highest"


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
        if choice.not_needed:
            raise Missing(choice.not_needed)
        if choice.waiting:
            raise (Diverged if choice.parent_diverged else Missing)(choice.waiting)
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

    def length_stat(self, model: str, setting: str, length: int, metric: str | None = None) -> Stat:
        """The chosen learning rate's test ``metric`` at ``length``: on the set ``L{length}``, or the mean over the
        sets ``L{length}_*`` (a passkey grid over depths), with the mean of their spreads."""
        sets = self.choice(model, setting).test
        metric = metric or self.sweep.metric
        found = [m[metric] for name, m in sets.items() if name == f"L{length}" or name.startswith(f"L{length}_")]
        if not found:
            raise Missing(f"{self.sweep.name}: no {metric} at length {length}")
        mean, spread = (sum(getattr(s, k) for s in found) / len(found) for k in ("mean", "spread"))
        return Stat(mean, spread, found[0].n)

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
    rate with a diverged seed scores worst. Nothing is chosen while any cell of the model and setting is missing
    (in a chained sweep: while the parent has not chosen the learning rate of the model it continues).
    """
    choices = {}
    finished = wall = 0
    sign = 1.0 if sweep.higher_is_better else -1.0
    parent = summarise(sweep.parent, records) if sweep.parent is not None else None
    for setting in sweep.settings:
        for model in sweep.models:
            if sweep.stop_at is not None and (gate := _ladder_gate(sweep, model, setting, choices)):
                choice = Choice(model, setting, dict.fromkeys(sweep.lrs))
                setattr(choice, gate[0], gate[1])
                choices[(model, setting)] = choice
                continue
            parent_lr = None
            if parent is not None:
                try:
                    parent_lr = sweep.parent_lr(model, parent)
                except Missing as err:
                    choice = Choice(model, setting, dict.fromkeys(sweep.lrs), parent_diverged=isinstance(err, Diverged))
                    choice.waiting = f"{sweep.name}: {model} waits for its parent: {err}"
                    choices[(model, setting)] = choice
                    continue
            scores: dict[float, float | None] = {}
            ranks: dict[float, tuple[float, float]] = {}
            by_lr: dict[float, list[dict]] = {}
            diverged = []
            for lr in sweep.lrs:
                recs = [records.get(sweep.cell(model, setting, lr, seed, parent).name) for seed in sweep.seeds]
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
            choice = Choice(model, setting, scores, diverged=diverged, parent_lr=parent_lr)
            if all(v is not None for v in scores.values()) and by_lr:
                lr = max(by_lr, key=lambda k: ranks[k])
                chosen = [r["result"] for r in by_lr[lr]]
                choice.lr = lr
                choice.test = _stats([r["test"] for r in chosen])
                names = chosen[0].get("variants", {})
                choice.variants = {v: _stats([r["variants"][v] for r in chosen]) for v in names}
                choice.curves = [_curve(r, sweep.metric) for r in by_lr[lr]]
                choice.probes = {p: [r["probes"][p] for r in chosen] for p in chosen[0].get("probes", {})}
                choice.seq_len = chosen[0].get("seq_len")
            choices[(model, setting)] = choice
    needed = sum(not choice.not_needed for choice in choices.values())
    total = needed * len(sweep.lrs) * len(sweep.seeds)
    return SweepResult(sweep, choices, finished, total, wall)


def _ladder_gate(sweep: Sweep, model: str, setting: str, choices: dict) -> tuple[str, str] | None:
    """Why a rung of a laddered sweep does not run (yet), from the rung just below it, whose choice already holds
    the rungs under it: ``("not_needed", why)`` above a rung that is not needed or whose chosen learning rate
    reached ``stop_at`` on the test metric, ``("waiting", why)`` above one still to choose; None on the lowest rung
    and above one that chose and fell short (or diverged at every learning rate)."""
    below = sweep.rungs_below(model)[-1:]
    if not below:
        return None
    rung, choice = below[0], choices[(below[0], setting)]
    if choice.not_needed:
        return "not_needed", choice.not_needed
    if choice.waiting:
        return "waiting", choice.waiting
    if choice.lr is None:
        if all(v is not None for v in choice.scores.values()):
            return None  # every learning rate diverged: it reached nothing
        return "waiting", f"{sweep.name}: {model} at {setting} waits for {rung}"
    try:
        score = _pick(choice.test, None, sweep.metric, sweep.name).mean
    except Missing:
        return None
    sign = 1.0 if sweep.higher_is_better else -1.0
    if sign * score > sign * sweep.stop_at:
        beyond = ">" if sweep.higher_is_better else "<"
        return "not_needed", f"not needed: {rung} reached {sweep.metric} {score:.3g} ({beyond} {sweep.stop_at:g})"
    return None
