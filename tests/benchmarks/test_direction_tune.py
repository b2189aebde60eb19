"""``benchmarks/direction_tune.py`` on a tiny shape under the interpreter: every setting's gradients match the first
setting's, a setting's tiles reach the launch, the JSON is written and the module's tiles are put back."""

from __future__ import annotations

import json

from attnkit.ops.path.triton import direction
from benchmarks import direction_tune


def test_direction_tune_smoke(tmp_path):
    saved = direction.backward_tiles
    direction_tune.main(
        ["--shape", "1:37:2:16", "--device", "cpu", "--settings", "default", "8,1", "--out", str(tmp_path)]
    )
    payload = json.loads((tmp_path / "direction_tune.json").read_text())
    rows = payload["rows"]
    assert [(r["setting"], r["positions"], r["warps"]) for r in rows] == [("default", 16, 1), ("8,1", 8, 1)]
    assert max(r["rel_diff"] for r in rows) < 1e-6 and payload["forward_us"] is None
    assert direction.backward_tiles is saved
