"""Issue 18's first case as a user met it: ``--log-every 0`` on a finished run emptied its metrics.jsonl, then died
with a ZeroDivisionError. Now it is one line, exit 2, and every file of the run is untouched, with or without
--resume."""

from __future__ import annotations

from attnkit.cli import main
from tests.cli.test_cli import TINY


def _files(folder) -> dict[str, bytes]:
    """Every file of a run folder (its snapshot's too, and through the links beside it) by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_log_every_zero_leaves_a_finished_run_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--mixer", "rope", "--out", str(out), *TINY]) == 0
    before = _files(out)
    capsys.readouterr()
    for extra in ([], ["--resume"]):
        assert main(["train", "--mixer", "rope", "--out", str(out), *TINY, "--log-every", "0", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "log_every" in err, err
        assert _files(out) == before
