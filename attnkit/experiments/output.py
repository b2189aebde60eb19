"""Writing an experiment's results: JSON files, and on stdout a table or, with ``--json``, the JSON itself."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_json(path: str, payload: dict) -> None:
    """``payload`` as indented JSON at ``path`` (parent folders created; non-JSON values as strings)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the results' JSON on stdout instead of the table (files as usual)"
    )


def print_results(table: str, json_path: str, written: list[str], as_json: bool) -> None:
    """stdout: ``table`` and the files ``written``; with ``as_json``, only the JSON file's content."""
    if as_json:
        print(Path(json_path).read_text().rstrip("\n"))
        return
    print(table)
    print("wrote " + ", ".join(written))


def metrics_table(metrics: dict[str, dict[str, float]]) -> str:
    """``{test set: {metric: value}}`` as a table, a row per set; fractions as percents."""
    from ..train.progress import format_metric

    names = list(dict.fromkeys(name for values in metrics.values() for name in values))
    width = max([len("test set"), *map(len, metrics)])
    lines = [f"{'test set':<{width}} " + " ".join(f"{n:>{max(len(n), 9)}}" for n in names)]
    for set_name, values in metrics.items():
        cells = [f"{format_metric(n, values[n]) if n in values else '-':>{max(len(n), 9)}}" for n in names]
        lines.append(f"{set_name:<{width}} " + " ".join(cells))
    return "\n".join(lines)
