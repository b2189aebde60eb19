"""Start-up time of the command line: wall time of ``python -m attnkit ARGS`` against an earlier commit.

    python benchmarks/cli_startup.py --before b70fb0a --out benchmarks/results/cli_startup.md

Each command runs ``--repeats`` times from this checkout and from ``--before`` (``git archive`` of that commit's
``attnkit/`` into a temporary folder, put first on ``PYTHONPATH``), interleaved so that the load of the machine
weighs on both alike; the table gives the medians. The header records the machine, the versions and the commits.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (["--help"], ["train", "--help"], ["demo", "--help"])
IMPORT = ["-c", "import attnkit"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def wall_time(args: list[str], tree: Path) -> float:
    """Seconds of one ``python ARGS`` with ``tree`` first on the path, run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, check=False)
    return time.perf_counter() - t0


def measure(before: Path, repeats: int) -> list[dict]:
    rows = []
    for args in [["-m", "attnkit", *c] for c in COMMANDS] + [IMPORT]:
        times: dict[str, list[float]] = {"before": [], "after": []}
        wall_time(args, ROOT)  # warm the file cache for both
        wall_time(args, before)
        for _ in range(repeats):
            times["before"].append(wall_time(args, before))
            times["after"].append(wall_time(args, ROOT))
        rows.append({"command": "python " + " ".join(args), **{k: statistics.median(v) for k, v in times.items()}})
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(rows: list[dict], before: str, repeats: int, load: tuple[float, float]) -> str:
    dirty = _git("status", "--porcelain", "--untracked-files=no", "attnkit")
    after = _git("rev-parse", "--short", "HEAD") + (" with uncommitted changes to attnkit/" if dirty else "")
    lines = [
        "# Command-line start-up",
        "",
        f"`python benchmarks/cli_startup.py --before {before}`: wall seconds, median of {repeats} interleaved runs.",
        "",
        f"- machine: {cpu_name()}, {os.cpu_count()} cores; load average {load[0]:.1f} before, {load[1]:.1f} after",
        f"- Python {platform.python_version()}, torch {version('torch')}, transformers {version('transformers')}, "
        f"triton {version('triton')}",
        f"- before: `{before}`; after: `{after}`",
        "",
        "| command | before s | after s | after / before |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| `{r['command']}` | {r['before']:.2f} | {r['after']:.2f} | {r['after'] / r['before']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=5, help="runs per command and tree (the median is reported)")
    parser.add_argument("--out", default=None, help="write the Markdown report here (default: print it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.before, "attnkit"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        load0 = os.getloadavg()[0]
        rows = measure(Path(tmp), args.repeats)
        text = report(rows, args.before, args.repeats, (load0, os.getloadavg()[0]))
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
