"""``benchmarks/scan_tune.py`` on tiny shapes under the interpreter: every setting's sums match float64, dense and
packed, the JSON is written and the module's tiling is put back."""

from __future__ import annotations

import json

from attnkit.ops.common.triton import scan
from benchmarks import scan_tune


def test_scan_tune_smoke(tmp_path):
    saved = (scan.MAX_HEADS, scan.TILE_ELEMENTS, scan.NUM_WARPS)
    scan_tune.main(
        ["--shapes", "2:70:5", "--packed", "--device", "cpu", "--settings", "default", "2,64,4"]
        + ["--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "scan_tune.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # dense and packed, prefix and suffix, two settings
    assert {(r["BH"], r["BT"]) for r in rows if r["setting"] == "2,64,4"} == {(2, 32)}
    assert max(r["error"] for r in rows) < 1e-6
    assert (scan.MAX_HEADS, scan.TILE_ELEMENTS, scan.NUM_WARPS) == saved
