"""The report of one paper: ``report.md`` (claims table, criteria, per-experiment sweeps, hardware, commit, budgets,
wall times), PNG plots beside it (the metric against steps, against the setting, against length) and
``report.json`` with the same content as data."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import torch

from ..output import write_json
from .cells import cpu_count
from .probes import ProbeResult
from .sweep import Diverged, Missing, Stat, SweepResult
from .verdicts import Claim, Outcome


def environment() -> dict[str, Any]:
    """Commit (with a ``-dirty`` mark), versions and hardware of this run."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "commit": commit,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": cpu_count(),
        "gpus": gpus,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_LENGTH_SET = re.compile(r"(?:L|len)(\d+)(?:_|$)")


def by_length(sets: dict[str, dict[str, Stat]], metric: str) -> list[tuple[int, float]]:
    """``(length, metric)`` for each length the test sets name (``L{n}``, ``len{n}``), sorted by length; the sets of
    one length (a passkey grid's depths, ``L{n}_d{δ}``) give their mean. Other sets are left out."""
    found: dict[int, list[float]] = {}
    for name, metrics in sets.items():
        match = _LENGTH_SET.match(name)
        if match and metric in metrics:
            found.setdefault(int(match.group(1)), []).append(metrics[metric].mean)
    return sorted((n, sum(v) / len(v)) for n, v in found.items())


def plot_sweep(result: SweepResult, folder: str) -> list[str]:
    """The PNGs of one sweep; returns their file names."""
    sweep, plt, files = result.sweep, _pyplot(), []
    chosen = {k: c for k, c in result.choices.items() if c.lr is not None}
    if not chosen:
        return files
    settings = [s for s in sweep.settings if any(k[1] == s for k in chosen)]
    fig, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings), 3.2), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for model in sweep.models:
            choice = chosen.get((model, setting))
            if choice is None or not choice.curves or not choice.curves[0]:
                continue
            steps = [p[0] for p in choice.curves[0]]
            values = [sum(c[i][1] for c in choice.curves) / len(choice.curves) for i in range(len(steps))]
            ax.plot(steps, values, marker="o", label=f"{model} (lr {choice.lr:g})")
        ax.set(title=setting, xlabel="step", ylabel=f"validation {sweep.metric}")
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(sweep.title, 45 * len(settings)), fontsize=9)
    fig.tight_layout()
    files.append(_save(fig, folder, f"{sweep.name}_steps.png", plt))

    if sweep.x and len(settings) > 1:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        for model in sweep.models:
            points = [
                (sweep.x[s], _first(chosen[(model, s)].test, sweep.metric)) for s in settings if (model, s) in chosen
            ]
            points = [(x, st) for x, st in points if st is not None]
            if points:
                ax.errorbar([p[0] for p in points], [p[1].mean for p in points], [p[1].spread for p in points],
                            marker="o", capsize=3, label=model)  # fmt: skip
        ax.set(xlabel=sweep.x_label, ylabel=f"test {sweep.metric}")
        _style(ax, sweep.title)
        fig.tight_layout()
        files.append(_save(fig, folder, f"{sweep.name}_vs_setting.png", plt))

    if sweep.test_x_label:
        fig, ax = plt.subplots(figsize=(6.5, 3.5))
        xs: set[float] = set()
        for (model, _), choice in chosen.items():
            groups = {"": choice.test, **{f"+{v}": sets for v, sets in choice.variants.items()}}
            for suffix, sets in groups.items():
                points = by_length(sets, sweep.metric)
                if points:
                    xs.update(p[0] for p in points)
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=model + suffix)
        ax.set(xlabel=sweep.test_x_label, ylabel=f"test {sweep.metric}", xscale="log")
        _style(ax, sweep.title, sorted(xs))
        fig.tight_layout()
        files.append(_save(fig, folder, f"{sweep.name}_vs_length.png", plt))
    return files


def _style(ax, title: str, xticks: list[float] | None = None) -> None:
    """A wrapped title, plain tick labels at ``xticks`` (on log axes too), and the legend outside the data."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    if xticks:
        ax.set_xticks(xticks, [f"{x:g}" for x in xticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    if ax.get_yscale() == "log":
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _first(sets: dict[str, dict[str, Stat]], metric: str) -> Stat | None:
    for metrics in sets.values():
        if metric in metrics:
            return metrics[metric]
    return None


def _save(fig, folder: str, name: str, plt) -> str:
    os.makedirs(folder, exist_ok=True)
    fig.savefig(os.path.join(folder, name), dpi=110)
    plt.close(fig)
    return name


def plot_probe(result: ProbeResult, folder: str) -> list[str]:
    if not result.results or "norms" not in result.results[0]:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for mixer, by_len in result.results[0]["norms"].items():
        lengths = sorted(int(t) for t in by_len)
        means = [sum(r["norms"][mixer][str(t)] for r in result.results) / len(result.results) for t in lengths]
        ax.plot(lengths, means, marker="o", label=mixer)
    ax.set(
        xscale="log", yscale="log", xlabel="T (tokens)", ylabel="‖S_T‖_F (mean over heads)", title=result.probe.title
    )
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [_save(fig, folder, f"{result.probe.name}.png", plt)]


def _remove_stale_plots(folder: str, results: dict, plots: dict[str, list[str]]) -> None:
    """Delete the PNGs an earlier report wrote for these experiments (``<name>.png``, ``<name>_*.png``) that this
    one did not write again: a sweep whose learning rate is no longer chosen (a rate added, a cell pending) plots
    nothing, and its old plots would show a choice the report no longer makes. They are derived from the cells, which
    stay."""
    fresh = {file for files in plots.values() for file in files}
    if not os.path.isdir(folder):
        return
    for file in os.listdir(folder):
        stem = file.removesuffix(".png")
        if file.endswith(".png") and file not in fresh and any(stem == n or stem.startswith(f"{n}_") for n in results):
            os.remove(os.path.join(folder, file))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _sweep_section(result: SweepResult, plots: list[str]) -> list[str]:
    sweep = result.sweep
    lines = [f"### {sweep.name}: {sweep.title}", ""]
    if sweep.note:
        lines += [sweep.note, ""]
    seq = {c.seq_len for c in result.choices.values() if c.seq_len}
    lines += [
        f"Task `{sweep.task}`, options {sweep.task_options}; model {sweep.arch}. Budget, the same for every model: "
        f"{sweep.budget_text()}" + (f", T = {', '.join(map(str, sorted(seq)))}" if seq else "") + ". "
        f"Learning rate chosen on the validation split by {sweep.metric} "
        f"({'higher' if sweep.higher_is_better else 'lower'} is better). "
        f"Cells: {result.finished} of {result.total} finished, {result.wall_s:.0f} s of cell time.",
        "",
    ]
    if sweep.parent is not None:
        lines += [_chain_text(sweep), ""]
    if sweep.stop_at is not None:
        lines += [
            f"Laddered: each mixer's depths run shallowest first, and a depth runs only where every shallower one "
            f"fell short of {sweep.metric} {sweep.stop_at:g} on the test set (at the learning rate validation chose); "
            f"the depths above the first that reaches it are not needed, and do not run.",
            "",
        ]
    if sweep.keep:
        lines += [f"The trained weights of {', '.join(sweep.keep)} are kept for a chained stage.", ""]
    lrs = " | ".join(f"val @ {lr:g}" for lr in sweep.lrs)
    lines += [f"| model | setting | {lrs} | chosen lr | test {sweep.metric} (mean ± spread) |"]
    lines += ["|---|---|" + "---|" * len(sweep.lrs) + "---|---|"]
    for (model, setting), choice in result.choices.items():
        scores = " | ".join(
            "pending" if v is None else "diverged" if lr in choice.diverged else f"{v:.3g}"
            for lr, v in choice.scores.items()
        )
        if choice.not_needed:  # a laddered sweep's rung above one that reached stop_at
            lines.append(
                f"| {model} | {setting} | {' | '.join('—' for _ in choice.scores)} | — | {choice.not_needed} |"
            )
            continue
        if sweep.parent is not None:
            source = sweep.models[model]["from"]
            model = f"{model} (from {source}" + (f" at lr {choice.parent_lr:g})" if choice.parent_lr else ", waiting)")
        if choice.lr is None:
            lines.append(f"| {model} | {setting} | {scores} | — | — |")
            continue
        tests = "; ".join(
            f"{name} {m[sweep.metric]}"
            for name, m in {**choice.test, **_variant_sets(choice)}.items()
            if sweep.metric in m
        )
        edge = choice.edge(sweep.higher_is_better)
        lines.append(
            f"| {model} | {setting} | {scores} | {choice.lr:g}{f' ({edge})' if edge else ''} | {_cell(tests)} |"
        )
    lines.append("")
    if _edges(result):
        lines += [EDGE_NOTE, ""]
    lines += _grid_lines(result)
    lines += [f"![{name}]({name})" for name in plots]
    return lines + [""]


EDGE_NOTE = (
    "A chosen learning rate marked (lowest) or (highest) is the sweep's smallest or largest, and validation scored it "
    "strictly better than the next one inward: that model's best learning rate may lie outside the sweep, so it may be "
    "under-tuned, and a verdict that rests on it is weaker for it."
)


def _edges(result: SweepResult) -> list[str]:
    """``"<model> <setting> at <lr> (<edge>)"`` for each chosen learning rate at the edge of ``result``'s sweep."""
    higher = result.sweep.higher_is_better
    edges = ((model, setting, c.lr, c.edge(higher)) for (model, setting), c in result.choices.items())
    return [f"{model} {setting} at {lr:g} ({edge})" for model, setting, lr, edge in edges if edge]


_GRID_SET = re.compile(r"L(\d+)_d([0-9.]+)$")


def _grid_lines(result: SweepResult) -> list[str]:
    """A passkey grid's test sets (``L{n}_d{δ}``) as a table of each chosen model's test metric, a row per length
    and a column per needle depth; nothing for other sweeps."""
    metric, rows = result.sweep.metric, {}
    for (model, setting), choice in result.choices.items():
        for name, metrics in choice.test.items():
            match = _GRID_SET.match(name)
            if match and metric in metrics:
                key = (model, setting, int(match.group(1)))
                rows.setdefault(key, {})[float(match.group(2))] = metrics[metric].mean
    if not rows:
        return []
    depths = sorted({d for row in rows.values() for d in row})
    lines = [f"Test {metric} by haystack length (rows) and needle depth (columns), mean over seeds:", ""]
    lines += ["| model | setting | length | " + " | ".join(f"δ={d:g}" for d in depths) + " |"]
    lines += ["|---|---|---|" + "---|" * len(depths)]
    for (model, setting, length), row in rows.items():
        cells = " | ".join(f"{row[d]:.3g}" if d in row else "—" for d in depths)
        lines.append(f"| {model} | {setting} | {length} | {cells} |")
    return lines + [""]


def _chain_text(sweep) -> str:
    """How a chained sweep's two stages were swept."""
    parent = sweep.parent
    converted = [m for m, spec in sweep.models.items() if spec["mixer"] != parent.models[spec["from"]]["mixer"]]
    text = (
        f"Chained: each model continues a model of `{parent.name}` (its parent, named after the model below), the one "
        f"trained at the learning rate `{parent.name}` chose on its own validation split ({parent.budget_text()}), "
        f"seed by seed; this stage then sweeps its own learning rates, chosen on validation again."
    )
    if converted:
        text += (
            f" {', '.join(converted)} start from the parent converted to their mixer as `from_llama` converts a "
            "Llama model: the weights both mixers have are copied, the new mixer's own weights start fresh."
        )
    return text


def _variant_sets(choice) -> dict[str, dict[str, Stat]]:
    return {f"{v}:{name}": m for v, sets in choice.variants.items() for name, m in sets.items()}


def _probe_section(result: ProbeResult, plots: list[str]) -> list[str]:
    probe = result.probe
    lines = [f"### {probe.name}: {probe.title}", ""]
    if probe.note:
        lines += [probe.note, ""]
    lines += [
        f"Probe `{probe.kind}` with {probe.params}, seeds {list(probe.seeds)}: {result.finished} of {result.total} "
        f"finished, {result.wall_s:.0f} s.",
        "",
    ]
    if result.results and "norms" in result.results[0]:
        lengths = probe.params["lengths"]
        lines += ["| mixer | " + " | ".join(f"T={T}" for T in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for mixer in result.results[0]["norms"]:
            cells = []
            for T in lengths:
                try:
                    cells.append(str(result.norm(mixer, T)))
                except Missing:
                    cells.append("pending")
            lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
        lines.append("")
    if result.results and "random" in result.results[0]:
        keys = ("count", "norm_max", "norm_median", "radius_min", "radius_max", "frac_norm_above_1", "cos_min")
        lines += ["| seed | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for r in result.results:
            lines.append(f"| {r['seed']} | " + " | ".join(f"{r['random'][k]:.10g}" for k in keys) + " |")
        lines.append("")
    lines += [f"![{name}]({name})" for name in plots]
    return lines + [""]


def _stat_json(obj: Any) -> Any:
    if isinstance(obj, Stat):
        return {"mean": obj.mean, "spread": obj.spread, "n": obj.n}
    if isinstance(obj, dict):
        return {str(k): _stat_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_stat_json(v) for v in obj]
    return obj


def _read(sentence: Any, results: dict[str, SweepResult | ProbeResult]) -> str | None:
    """``sentence(results)``, or None where a cell it reads has not run, or diverged."""
    try:
        return sentence(results)
    except (Missing, Diverged, KeyError):
        return None


def _difference(claim: Claim, results: dict[str, SweepResult | ProbeResult]) -> str:
    """The sentence after a decided claim's verdict: where ours differ from the published numbers and why
    (``claim.differs``, which holds ours to a published table, else ``claim.cause``), or that they agree; for a
    claim with no published numbers, what ours show (``claim.observe``)."""
    if claim.observe is not None:
        seen = _read(claim.observe, results)
        return f". {seen}" if seen else ""
    if claim.differs is not None:
        where = _read(claim.differs, results)  # None: the general cause
        if where == "":
            return ". Ours agree with the published numbers"
        if where:
            return f". Ours differ from the published numbers: {where}"
    return f". Where ours differ from the published numbers: {claim.cause}" if claim.cause else ""


def write_report(
    folder: str,
    paper: Any,
    scale: str,
    results: dict[str, SweepResult | ProbeResult],
    outcomes: dict[str, Outcome],
    run: dict[str, Any],
) -> str:
    """Write ``report.md``, its plots and ``report.json`` for ``paper`` (a module of this package) into ``folder``;
    returns the path of ``report.md``."""
    env = environment()
    plots = {
        name: plot_sweep(r, folder) if isinstance(r, SweepResult) else plot_probe(r, folder)
        for name, r in results.items()
    }
    _remove_stale_plots(folder, results, plots)
    budgets = {name: r.sweep.budget_text() for name, r in results.items() if isinstance(r, SweepResult)}
    counts = {
        v: sum(o.verdict == v for o in outcomes.values()) for v in dict.fromkeys(o.verdict for o in outcomes.values())
    }
    lines = [
        f"# Reproduction: {paper.TITLE}, {scale} scale",
        "",
        f"{paper.SCALE_NOTES[scale]}",
        "",
        f"Verdicts: {', '.join(f'{n} {v}' for v, n in counts.items())}. Generated by `{run['command']}` at commit "
        f"`{env['commit']}` on {env['date']}.",
        "",
        "## Claims",
        "",
        "| id | claim | published | ours (mean ± spread; budget) | verdict |",
        "|---|---|---|---|---|",
    ]
    for claim in paper.CLAIMS:
        o = outcomes[claim.id]
        budget = "; ".join(budgets[e] for e in claim.experiments if e in budgets)
        ours = o.ours + (f" ({budget})" if budget and o.ours != "—" else "")
        verdict = f"**{o.verdict}**: {o.reason}"
        if o.verdict != "NOT RUN":
            verdict += _difference(claim, results)
        lines.append(
            f"| {claim.id} | {_cell(claim.claim)} | {_cell(claim.published)} | {_cell(ours)} | {_cell(verdict)} |"
        )
    edges = [f"{name}: {', '.join(e)}" for name, r in results.items() if isinstance(r, SweepResult) if (e := _edges(r))]
    if edges:
        lines += [
            "",
            "Learning rates chosen at a sweep's edge, where a model's best may lie outside the sweep (each "
            f"experiment's table marks them): {'; '.join(edges)}.",
        ]
    lines += ["", "## Criteria (fixed in code before any cell ran)", ""]
    lines += [f"- **{c.id}**: {c.criterion}" for c in paper.CLAIMS]
    lines += ["", "## Experiments", ""]
    for name, result in results.items():
        section = _sweep_section if isinstance(result, SweepResult) else _probe_section
        lines += section(result, plots[name])
    lines += [
        "## Run",
        "",
        f"- Commit `{env['commit']}`, Python {env['python']}, torch {env['torch']}, {env['platform']}.",
        f"- Hardware: {env['cpu_cores']} CPU cores ({env['cpu']})"
        + (f", GPUs: {', '.join(env['gpus'])}" if env["gpus"] else ", no GPU")
        + f"; cell devices: {', '.join(run['devices']) or '—'}.",
        f"- This invocation: {run['ran']} cells run, {run['cached']} cached, {run['failed']} failed, "
        f"{run['skipped']} left for later; {run['wall_s']:.0f} s wall time with {run['jobs']} job(s).",
        "- Cell time per experiment: "
        + ", ".join(f"{n} {r.wall_s:.0f} s ({r.finished}/{r.total})" for n, r in results.items())
        + ".",
        "",
    ]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    payload = {
        "paper": paper.TITLE,
        "scale": scale,
        "environment": env,
        "run": run,
        "claims": [
            {
                **{k: getattr(c, k) for k in ("id", "claim", "published", "criterion", "experiments", "cause")},
                **o.__dict__,
            }  # fmt: skip
            for c, o in ((c, outcomes[c.id]) for c in paper.CLAIMS)
        ],
        "experiments": {name: _result_json(r) for name, r in results.items()},
        "plots": plots,
    }
    write_json(os.path.join(folder, "report.json"), payload)
    return path


def _result_json(result: SweepResult | ProbeResult) -> dict:
    if isinstance(result, ProbeResult):
        return {"kind": result.probe.kind, "params": result.probe.params, "results": result.results}
    sweep = result.sweep
    return {
        "task": sweep.task,
        "task_options": sweep.task_options,
        "settings": sweep.settings,
        "arch": sweep.arch,
        "budget": sweep.budget.__dict__,
        "lrs": sweep.lrs,
        "seeds": sweep.seeds,
        "metric": sweep.metric,
        "parent": sweep.parent.name if sweep.parent is not None else None,
        "keep": sweep.keep,
        "stop_at": sweep.stop_at,
        "finished": result.finished,
        "total": result.total,
        "choices": [
            _stat_json(
                {k: v for k, v in c.__dict__.items() if k != "curves"}
                | {"curves": c.curves, "edge": c.edge(sweep.higher_is_better)}
            )
            for c in result.choices.values()
        ],
    }
