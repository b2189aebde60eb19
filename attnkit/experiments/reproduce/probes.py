"""Cells that measure without training: each probe takes JSON keyword arguments and returns a JSON dict."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cells import Cell
from .sweep import Missing, Stat


def state_norm(mixers: list[str], lengths: list[int], hidden_size: int, num_heads: int, seed: int) -> dict:
    """``‖S_T‖_F`` of untrained layers on random inputs (``attnkit.experiments.probe_state``):
    ``{"norms": {mixer: {T: norm}}}``."""
    from ..probe_state import probe_state  # the layers are imported only when a probe runs

    rows = probe_state(mixers, lengths, hidden_size, num_heads, seed)
    norms: dict[str, dict[str, float]] = {}
    for row in rows:
        norms.setdefault(row["mixer"], {})[str(row["T"])] = row["state_norm"]
    return {"norms": norms}


def proposition2(batch: int, seq_len: int, num_heads: int, head_dim: int, lam0: float, seed: int, tol: float) -> dict:
    """Spectral norm and radius of VLA's transition ``I − α̂ k̂ᵀ`` on random inputs
    (``attnkit.experiments.vla_proposition.check_proposition2``): ``{"seed": seed, "random": stats}``."""
    from ..vla_proposition import check_proposition2

    stats = check_proposition2(
        batch=batch, seq_len=seq_len, num_heads=num_heads, head_dim=head_dim, lam0=lam0, seed=seed, tol=tol
    )
    return {"seed": seed, "random": stats["random"]}


def trained_proposition2(model: Any, task: Any, batch: int, tol: float) -> dict:
    """``transition_stats`` of ``I − α̂ k̂ᵀ`` in every VLA layer of a trained ``model``, on the first ``batch``
    sequences of ``task``'s first test set (``attnkit.experiments.vla_proposition.model_gates``)."""
    from ..vla_proposition import model_gates, transition_stats

    input_ids = next(iter(task.test_sets().values()))[0][:batch]
    model = model.to("cpu").eval()
    return transition_stats(*model_gates(model, input_ids), tol=tol)


PROBES: dict[str, Callable[..., dict]] = {"state_norm": state_norm, "proposition2": proposition2}
# probes of a trained model, asked for by a sweep's model entry (``"probes"``) and run by its train cell:
# ``fn(model, task, **kwargs)``
TRAINED_PROBES: dict[str, Callable[..., dict]] = {"proposition2": trained_proposition2}


@dataclass(frozen=True, eq=False)
class Probe:
    """A measurement without training, repeated over ``seeds``: ``kind`` names a function of ``PROBES`` called
    with ``params`` and ``seed``."""

    name: str
    title: str
    kind: str
    params: dict[str, Any]
    seeds: tuple[int, ...]
    note: str = ""

    def cells(self, records: dict[str, dict] | None = None) -> list[Cell]:
        """Every seed's cell (a probe has no parent, so ``records`` changes nothing)."""
        return [Cell(self.name, f"s{seed}", self.kind, {**self.params, "seed": seed}) for seed in self.seeds]


@dataclass
class ProbeResult:
    probe: Probe
    results: list[dict]  # one per finished seed
    finished: int
    total: int
    wall_s: float

    def complete(self) -> list[dict]:
        """Every seed's result; ``Missing`` while some seed has not run."""
        if self.finished < self.total:
            raise Missing(f"{self.probe.name}: {self.total - self.finished} of {self.total} seeds not run")
        return self.results

    def norm(self, mixer: str, T: int) -> Stat:
        """``‖S_T‖_F`` of ``mixer`` at ``T`` over the seeds (state-norm probes)."""
        self.complete()
        values = [r["norms"][mixer][str(T)] for r in self.results if str(T) in r["norms"].get(mixer, {})]
        if len(values) < len(self.results):
            raise Missing(f"{self.probe.name}: {mixer} is not probed at T={T} at this scale")
        return Stat.of(values)


def summarise_probe(probe: Probe, records: dict[str, dict]) -> ProbeResult:
    done = [records[c.name] for c in probe.cells() if c.name in records]
    return ProbeResult(probe, [r["result"] for r in done], len(done), len(probe.seeds), sum(r["wall_s"] for r in done))
