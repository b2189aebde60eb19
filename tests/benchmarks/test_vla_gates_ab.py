"""``benchmarks/vla_gates_ab.py`` on tiny shapes under the interpreter: the tree's gate stage against a copy of its
own ``gates.py`` agrees to float32 rounding, the column-block backward with it, and the JSON is written."""

from __future__ import annotations

import json
import shutil

import attnkit.ops.vla.triton.gates as gates
from benchmarks import vla_gates_ab


def test_vla_gates_ab_smoke(tmp_path):
    before = tmp_path / "gates_before.py"
    shutil.copy(gates.__file__, before)
    argv = ["--before", str(before), "--device", "cpu", "--shapes", "48:70:2", "--out", str(tmp_path)]
    assert vla_gates_ab.main(argv) == 0
    (row,) = json.loads((tmp_path / "vla_gates_ab.json").read_text())["rows"]
    assert (row["K"], row["T"], row["B"]) == (48, 70, 2)
    for name in ("now", "one program", "columns 32", "columns 64"):
        assert set(row[name]["rel_diff"]) == set(vla_gates_ab.NAMES)
        assert max(row[name]["rel_diff"].values()) < 1e-5, name
    assert gates.BWD_COLUMNS == 64  # put back
