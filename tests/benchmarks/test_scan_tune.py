"""``benchmarks/scan_tune.py`` on tiny shapes under the interpreter: every setting's sums match float64, dense and
packed, "default" is the module's tiling even after another setting, the JSON is written and the module's tiling is
put back."""

from __future__ import annotations

import json

from attnkit.ops.common.triton import scan
from benchmarks import scan_tune


def test_scan_tune_smoke(tmp_path):
    saved = (scan.MAX_HEADS, scan.TILE_ELEMENTS, scan.NUM_WARPS)
    scan_tune.main(
        ["--shapes", "2:70:5", "--packed", "--device", "cpu", "--settings", "1,32,4", "default"]
        + ["--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "scan_tune.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # dense and packed, prefix and suffix, two settings
    assert {(r["BH"], r["BT"]) for r in rows if r["setting"] == "1,32,4"} == {(1, 32)}
    default = scan.launch_config(70, 5), scan.launch_config(140, 5)  # after another setting: still the module's own
    assert {(r["BH"], r["BT"]) for r in rows if r["setting"] == "default"} == {(c["BH"], c["BT"]) for c in default}
    assert max(r["error"] for r in rows) < 1e-6
    assert (scan.MAX_HEADS, scan.TILE_ELEMENTS, scan.NUM_WARPS) == saved
