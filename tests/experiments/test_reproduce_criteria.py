"""The criteria of claims (TAPA T1, PaTH P1, P2, P7 and P8), on hand-made results: each verdict the criterion names is
reached where it says, and nowhere else."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from attnkit.experiments.reproduce import path, tapa
from attnkit.experiments.reproduce.sweep import Sweep, summarise
from attnkit.tasks import get_task


def record(metric: str, val: float, test: dict[str, float]) -> dict:
    result = {"status": "ok", "final_loss": 1.0, "events": [], "variants": {}}
    result.update(validation={"validation": {metric: val}}, test={name: {metric: v} for name, v in test.items()})
    return {"result": result, "wall_s": 1.0}


def fill(sweep: Sweep, records: dict, test: Callable[[str, str, int], float]) -> None:
    """Records for every declarable cell of ``sweep``: the validation score favours the middle learning rate; the
    test metric of each set is ``test(model, set name, seed)`` (the set's length in its name)."""
    setting = next(iter(sweep.settings))
    task = get_task(sweep.task, **{**sweep.task_options, **sweep.settings[setting]})
    names = list(task.test_sets())
    for cell in sweep.cells(records):
        model, lr, seed = cell.label.split()[0], cell.params["config"]["lr"], cell.params["config"]["seed"]
        val = 0.5 if lr == sweep.lrs[1] else 0.1
        val = val if sweep.higher_is_better else 10 - val
        records[cell.name] = record(sweep.metric, val, {n: test(model, n, seed) for n in names})


def length(set_name: str) -> int:
    return int("".join(ch for ch in set_name.split("_")[0] if ch.isdigit()))


def retrieval_results(scores: dict[str, tuple[float, float]], spread: float = 0.0) -> dict:
    """``scores``: model -> (exact match at L, at 4L) on both tasks (2L takes the mean)."""
    experiments = {e.name: e for e in path.experiments("smoke")}
    results = {}
    for name in ("multi_needle", "variable_tracking"):
        sweep, records = experiments[name], {}
        L = next(iter(sweep.settings.values()))["seq_len"]

        def test(model, set_name, seed, L=L):
            short, far = scores[model]
            value = {L: short, 2 * L: (short + far) / 2, 4 * L: far}[length(set_name)]
            return value + (spread if seed else -spread)

        two_seeds = dataclasses.replace(sweep, seeds=(0, 1))
        fill(two_seeds, records, test)
        results[name] = summarise(two_seeds, records)
    return results


@pytest.mark.parametrize(
    "scores,verdict",
    [
        ({"path_fox": (1.0, 0.8), "path": (1.0, 0.5), "rope": (1.0, 0.1), "fox": (1.0, 0.6)}, "CONFIRMED"),
        ({"path_fox": (1.0, 0.8), "path": (1.0, 0.78), "rope": (1.0, 0.1), "fox": (1.0, 0.6)}, "INCONCLUSIVE"),
        ({"path_fox": (1.0, 0.2), "path": (1.0, 0.5), "rope": (1.0, 0.1), "fox": (1.0, 0.2)}, "REFUTED"),
        ({"path_fox": (0.5, 0.2), "path": (0.6, 0.1), "rope": (0.4, 0.1), "fox": (0.5, 0.1)}, "INCONCLUSIVE"),
    ],
    ids=["leads", "tie", "trails", "untrained"],
)
def test_p7_path_fox_must_lead_clearly_beyond_the_training_length(scores, verdict):
    got, reason, ours = path._retrieval(retrieval_results(scores))
    assert got == verdict, reason
    assert "multi_needle: path_fox 1×" in ours and "variable_tracking:" in ours
    if verdict == "INCONCLUSIVE" and scores["path_fox"][0] < 0.9:
        assert "budget" in reason


def test_p7_spreads_keep_a_lead_from_counting():
    scores = {"path_fox": (1.0, 0.8), "path": (1.0, 0.7), "rope": (1.0, 0.1), "fox": (1.0, 0.6)}
    assert path._retrieval(retrieval_results(scores))[0] == "CONFIRMED"
    assert path._retrieval(retrieval_results(scores, spread=0.05))[0] == "INCONCLUSIVE"


def chain_results(paper, parent_name: str, child_name: str, parent_ppl: float, ppl: Callable[[str, int], float]):
    """Summaries of a parent LM sweep (every model at ``parent_ppl``) and its chained sweep (``ppl(model, length)``:
    each test perplexity)."""
    experiments = {e.name: e for e in paper.experiments("smoke")}
    parent, child = experiments[parent_name], experiments[child_name]
    records = {}
    fill(parent, records, lambda model, name, seed: parent_ppl)
    assert child.cells(records) and not child.cells({})
    fill(child, records, lambda model, name, seed: ppl(model, length(name)))
    results = {parent_name: summarise(parent, records), child_name: summarise(child, records)}
    assert results[child_name].finished == results[child_name].total > 0
    return results


@pytest.mark.parametrize(
    "converted,continued,pretrained,verdict",
    [(4.0, 5.0, 6.0, "CONFIRMED"), (4.98, 5.0, 6.0, "PARTIAL"), (5.2, 5.0, 6.0, "REFUTED"), (4.0, 5.0, 9.0,
     "INCONCLUSIVE")],
)  # fmt: skip
def test_p8_the_converted_model_must_end_clearly_lower(converted, continued, pretrained, verdict):
    values = {"path_converted": converted, "rope_continued": continued}
    results = chain_results(path, "lm_default", "conversion", pretrained, lambda model, L: values[model])
    got, reason, ours = path._conversion(results)
    assert got == verdict, reason
    assert ours.startswith(f"rope pretrained {pretrained:g}")


@pytest.mark.parametrize(
    "growth,verdict",
    [
        ({"tapa": 1.05, "rope": 4, "rope+pi": 3.5, "rope+ntk": 3.2, "rope+yarn": 3.0}, "CONFIRMED"),
        ({"tapa": 1.05, "rope": 4, "rope+pi": 3.5, "rope+ntk": 3.2, "rope+yarn": 1.5}, "PARTIAL"),
        ({"tapa": 2.0, "rope": 4, "rope+pi": 3.5, "rope+ntk": 3.2, "rope+yarn": 1.5}, "REFUTED"),
    ],
)
def test_t1_tapa_must_stay_flat_to_8l_after_continued_pretraining(growth, verdict):
    L4 = 4 * 64

    def ppl(model, L):
        return 5.0 * (growth[model] if L == 2 * L4 else 1.0)

    results = chain_results(tapa, "zero_shot", "continued", 6.0, ppl)
    got, reason, ours = tapa._continued(results)
    assert got == verdict, reason
    assert "tapa 4L 5" in ours and "rope+yarn 8L" in ours
    untrained = chain_results(tapa, "zero_shot", "continued", 6.0, lambda model, L: 9.0)
    assert tapa._continued(untrained)[0] == "INCONCLUSIVE"


def test_phase_ablation_and_no_normalisation_verdicts():
    """T5 (TAPA's quadratic against its linear phase) and V8 (VLA's state without a normalised write) on
    hand-made results."""
    from attnkit.experiments.reproduce import vla
    from attnkit.experiments.reproduce.sweep import Stat

    class Zero:
        sweep = type("S", (), {"settings": {"L64": {"seq_len": 64}}})()

        def __init__(self, ppl):
            self.ppl = ppl

        def stat(self, model, setting, name):
            return Stat(*self.ppl[(model, int(name[3:]) // 64)], 2)

    good = {("rope", 1): (4.0, 0.1), ("rope", 4): (40.0, 1.0)}
    for quad, lin, verdict in [(5.0, 7.0, "CONFIRMED"), (7.0, 5.0, "REFUTED"), (5.0, 5.05, "INCONCLUSIVE")]:
        ppl = {**good, ("tapa", 1): (4.0, 0.1), ("tapa", 4): (quad, 0.1)}
        ppl.update({("tapa_linear", 1): (4.0, 0.1), ("tapa_linear", 4): (lin, 0.1)})
        assert tapa._phase_ablation({"zero_shot": Zero(ppl)})[0] == verdict
    untrained = {**good, ("tapa", 1): (30.0, 0.1), ("tapa", 4): (5.0, 0.1)}
    untrained.update({("tapa_linear", 1): (4.0, 0.1), ("tapa_linear", 4): (7.0, 0.1)})
    assert tapa._phase_ablation({"zero_shot": Zero(untrained)})[0] == "INCONCLUSIVE"

    class Norms:
        def __init__(self, lengths, norms):
            self.probe = type("P", (), {"params": {"lengths": lengths}})()
            self.norms = norms

        def norm(self, mixer, T):
            return Stat(self.norms[mixer][T], 0.0, 2)

    short = vla.NO_NORM_LENGTHS
    bounded = Norms([250, 1000], {"vla": {250: 20.0, 1000: 26.0}})
    growing = Norms([250, 1000], {"vla": {250: 20.0, 1000: 60.0}})
    overflow = Norms(short, {"vla_unnormalized": dict(zip(short, (1e4, 1e9, math.inf, math.nan, math.nan)))})
    flat = Norms(short, {"vla_unnormalized": dict(zip(short, (5.0, 6.0, 8.0, 9.0, 11.0)))})
    assert vla._no_normalisation({"no_normalisation": overflow, "state_norm": bounded})[0] == "CONFIRMED"
    assert vla._no_normalisation({"no_normalisation": overflow, "state_norm": growing})[0] == "PARTIAL"
    assert vla._no_normalisation({"no_normalisation": flat, "state_norm": bounded})[0] == "REFUTED"


FLIPFLOP_PATH = {"in_distribution": 0.0, "sparse": 0.001, "dense": 0.0}


@pytest.mark.parametrize(
    "rope,fox,verdict",
    [
        ((0.07, 0.40), (0.08, 0.36), "CONFIRMED"),
        ((0.07, 0.40), (0.0, 0.02), "PARTIAL"),  # FoX solves it too, though not as well as PaTH: not confirmed
        ((0.07, 0.40), (0.0, 0.0), "REFUTED"),  # FoX matches PaTH: the claim says FoX does not solve it
    ],
    ids=["both-fail", "fox-close", "fox-matches"],
)
def test_p1_rope_and_fox_must_both_fail_flip_flop(rope, fox, verdict):
    sweep, records = next(e for e in path.experiments("smoke") if e.name == "flipflop"), {}
    errors = {"rope": rope, "fox": fox, "path_fox": (0.0, 0.0)}

    def test(model, set_name, seed):
        if model == "path":
            return FLIPFLOP_PATH[set_name]
        return 0.0 if set_name == "dense" else errors[model][set_name == "sparse"]

    fill(sweep, records, test)
    got, reason, ours = path._flipflop({"flipflop": summarise(sweep, records)})
    assert got == verdict, reason
    assert "; fox sparse " in ours


@pytest.mark.parametrize(
    "fewest,verdict",
    [
        ({"path": 1, "rope": 2, "fox": 2}, "CONFIRMED"),
        ({"path": 1, "rope": 2, "fox": 1}, "PARTIAL"),  # FoX needs no more layers than PaTH
        ({"path": 2, "rope": 2, "fox": 1}, "REFUTED"),
        ({"path": None, "rope": None, "fox": None}, "INCONCLUSIVE"),
    ],
    ids=["fewer-than-both", "fox-as-few", "never-fewer", "untrained"],
)
def test_p2_path_must_need_fewer_layers_than_rope_and_fox(fewest, verdict):
    """``fewest``: mixer -> the fewest layers reaching > 90% (None: no depth run does)."""
    sweep, records = next(e for e in path.experiments("smoke") if e.name == "words"), {}
    while cells := [c for c in sweep.cells(records) if c.name not in records]:  # laddered: depth by depth
        for cell in cells:
            mixer, depth = cell.label.split()[0], cell.params["config"]["num_layers"]
            solved = fewest.get(mixer) is not None and depth >= fewest[mixer]
            records[cell.name] = record(sweep.metric, 0.5, {"test": 0.95 if solved else 0.1})
    got, reason, ours = path._words({"words": summarise(sweep, records)})
    assert got == verdict, reason
    assert "fox A5 k8:" in ours
