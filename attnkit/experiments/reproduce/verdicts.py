"""Claims, their published numbers and the criterion that decides each, fixed in code before anything runs.

A claim's ``decide(results)`` reads the summarised experiments (``{experiment name: SweepResult | ProbeResult}``)
and returns ``(verdict, reason, ours)``: the verdict by the criterion written in ``criterion``, why, and our
numbers as the report shows them. Each criterion starts with a budget check: when the budget trained no model
well enough to tell the mechanisms apart, the verdict is INCONCLUSIVE, never a verdict on the mechanism.

``judge`` adds the rules every claim shares: a claim without ``decide`` is NOT RUN with its reason; one whose
numbers are not there (cells not run yet, or not at this scale) is NOT RUN saying which; one whose models all
diverged is INCONCLUSIVE; and a trained comparison with fewer than ``MIN_SEEDS`` seeds cannot be decided
(INCONCLUSIVE, with what the criterion alone would say), because its spread is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .sweep import Diverged, Missing, Stat

VERDICTS = ("CONFIRMED", "PARTIAL", "REFUTED", "INCONCLUSIVE", "NOT RUN")
DECIDED = ("CONFIRMED", "PARTIAL", "REFUTED")
MIN_SEEDS = 2

Decision = tuple[str, str, str]  # verdict, reason, ours


@dataclass(frozen=True, eq=False)
class Claim:
    """One published claim. ``experiments``: the experiments ``decide`` reads (their budgets are shown beside our
    numbers); ``decide=None`` with ``not_run`` (the reason) for a claim we cannot run; ``trained``: the numbers
    come from trained models (so the seed rule applies); ``cause``: the likely cause when ours differ; ``differs``,
    where the published numbers are a table ours can be held to: ``differs(results)`` is ``""`` where ours agree
    with it, else a sentence naming where they differ and the likely cause (the report then shows it in place of
    ``cause``); ``observe``, for a claim with no published numbers: ``observe(results)`` is a sentence on what ours
    show beyond the verdict (the report shows it in place of ``cause``)."""

    id: str
    claim: str
    published: str
    criterion: str
    experiments: tuple[str, ...] = ()
    decide: Callable[[dict[str, Any]], Decision] | None = None
    not_run: str = ""
    trained: bool = True
    cause: str = ""
    differs: Callable[[dict[str, Any]], str] | None = None
    observe: Callable[[dict[str, Any]], str] | None = None

    def __post_init__(self) -> None:
        if self.decide is None and not self.not_run:
            raise ValueError(f"claim {self.id}: a claim without decide needs its not_run reason")


def at_paper_scale(analog: Claim, setting: str, reason: str) -> Claim:
    """The NOT RUN row of a claim in the paper's own ``setting`` (its models, data and scale), kept beside
    ``analog``, the scaled-down analog that runs here; ``reason``: why the original cannot run."""
    return Claim(
        id=f"{analog.id}-paper",
        claim=f"{analog.claim}: in the paper's setting ({setting})",
        published=analog.published,
        criterion=f"Not run: {reason}. {analog.id} runs the scaled-down analog of the same protocol, with its own "
        "criterion.",
        not_run=f"{reason}; the scaled-down analog is {analog.id}",
        trained=analog.trained,
    )


def with_paper_scale(analogs: list[Claim], originals: dict[str, tuple[str, str]]) -> list[Claim]:
    """``analogs`` with, after each one that ``originals`` names (claim id -> (the paper's setting, why it cannot
    run)), the NOT RUN row of the claim in the paper's own setting."""
    unknown = set(originals) - {c.id for c in analogs}
    if unknown:
        raise ValueError(f"originals: {sorted(unknown)} are not claims here")
    return [
        row
        for claim in analogs
        for row in (claim, *([at_paper_scale(claim, *originals[claim.id])] if claim.id in originals else []))
    ]


@dataclass(frozen=True)
class Outcome:
    verdict: str
    reason: str
    ours: str


def judge(claim: Claim, results: dict[str, Any]) -> Outcome:
    """The verdict on ``claim`` from the summarised ``results`` (see the module docstring for the shared rules)."""
    if claim.decide is None:
        return Outcome("NOT RUN", claim.not_run, "—")
    absent = [name for name in claim.experiments if name not in results]
    if absent:
        return Outcome("NOT RUN", f"experiment {', '.join(absent)} is not run at this scale", "—")
    try:
        verdict, reason, ours = claim.decide(results)
    except Diverged as err:
        return Outcome("INCONCLUSIVE", str(err), "—")
    except Missing as err:
        return Outcome("NOT RUN", str(err), "—")
    if verdict not in VERDICTS:
        raise ValueError(f"claim {claim.id}: decide returned {verdict!r}, not one of {VERDICTS}")
    seeds = min(
        (len(results[name].sweep.seeds) for name in claim.experiments if hasattr(results[name], "sweep")), default=0
    )
    if claim.trained and verdict in DECIDED and seeds < MIN_SEEDS:
        return Outcome(
            "INCONCLUSIVE",
            f"{seeds} seed, so no spread: the criterion alone would say {verdict} ({reason})",
            ours,
        )
    return Outcome(verdict, reason, ours)


def clearly_above(a: Stat, b: Stat, margin: float) -> bool:
    """``a`` exceeds ``b`` by more than ``margin`` and by more than their spreads together."""
    return a.mean - b.mean > max(margin, a.spread + b.spread)


def fmt(stats: dict[str, Stat]) -> str:
    """``name value ± spread`` for each entry, joined by semicolons."""
    return "; ".join(f"{name} {stat}" for name, stat in stats.items())
