"""The README's Python blocks run as written, in order, in one namespace (a reader pastes them one after the other
into one session), from a scratch working directory; and it links each paper's reproduction report."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(python_blocks(README.read_text())) >= 2, "the README shows the ops and the models in Python"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(python_blocks(README.read_text())):
        try:
            exec(compile(block, f"README.md python block {i}", "exec"), namespace)
        except Exception as e:  # the block's number and source, for the reader who must fix it
            raise AssertionError(f"README python block {i} failed: {e!r}\n{block}") from e


def test_readme_links_every_papers_reproduction_report():
    from attnkit.experiments.reproduce.command import PAPERS

    text = README.read_text()
    for paper in PAPERS:
        assert f"](reports/{paper}/report.md)" in text, f"the README links reports/{paper}/report.md"
