"""The accuracy scripts of issues 3, 4, 5 and 17 on tiny shapes, the kernels under the interpreter (float32: bf16
``tl.dot`` is wrong there): every cell within its bar, and the JSON written."""

from __future__ import annotations

import json

from attnkit.ops.common.triton import delta_bwd
from benchmarks import delta_accuracy, path_accuracy, tapa_accuracy, vla_accuracy


def test_tapa_accuracy_smoke(tmp_path):
    argv = ["--device", "cpu", "--seq-lens", "40", "--head-dims", "16", "--dtypes", "float32", "--out", str(tmp_path)]
    assert tapa_accuracy.main(argv) == 0
    rows = json.loads((tmp_path / "tapa_accuracy_h200.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["errors"]["dk"] < 1e-4


def test_vla_accuracy_smoke(tmp_path):
    argv = ["--device", "cpu", "--seq-lens", "40", "--lam0s", "0.1", "1", "--heads", "1", "--head-dim", "16"]
    assert vla_accuracy.main([*argv, "--dtypes", "float32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "vla_accuracy_h200.json").read_text())["rows"]
    assert [r["lam0"] for r in rows] == [0.1, 1.0] and all(r["ok"] and r["errors"]["du"] < 1e-4 for r in rows)


def test_path_accuracy_smoke(tmp_path):
    argv = ["--device", "cpu", "--seq-lens", "70", "--head-dims", "16", "--dtypes", "float32", "--out", str(tmp_path)]
    assert path_accuracy.main(argv) == 0
    rows = json.loads((tmp_path / "path_accuracy_h200.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["ok"] and rows[0]["errors"]["dbeta"] < 1e-4
    assert rows[0]["o_vs_float64"]["triton"] < 1e-5 and rows[0]["o_vs_float64"]["torch"] < 1e-5


def test_path_accuracy_without_gates(tmp_path):
    """``--gates fox none``: a PaTH-FoX and a PaTH row per cell, the PaTH row without a gate gradient."""
    argv = ["--device", "cpu", "--seq-lens", "40", "--head-dims", "16", "--dtypes", "float32", "--gates", "fox", "none"]
    assert path_accuracy.main([*argv, "--float64-max-t", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "path_accuracy_h200.json").read_text())["rows"]
    assert [r["gates"] for r in rows] == [True, False] and all(r["ok"] for r in rows)
    assert "dg" in rows[0]["errors"] and "dg" not in rows[1]["errors"] and rows[1]["errors"]["dk"] < 1e-4


def test_delta_accuracy_smoke(tmp_path):
    """Every cell under each setting, float32 inputs within float32's bars of the float64 rule, and each setting's
    attribute back to its default after the run."""
    setting = "attnkit.ops.common.triton.delta_bwd.WY_WARPS=4"
    argv = ["--device", "cpu", "--dtype", "float32", "--seq-lens", "40", "--head-dims", "16", "--out", str(tmp_path)]
    assert delta_accuracy.main([*argv, "--settings", "", setting]) == 0
    rows = json.loads((tmp_path / "delta_accuracy.json").read_text())["rows"]
    assert [(r["setting"], r["beta"]) for r in rows] == [
        ("default", [0.0, 1.0]), (setting, [0.0, 1.0]), ("default", [1.5, 2.0]), (setting, [1.5, 2.0])
    ]  # fmt: skip
    assert all(r["ok"] and max(r["errors"].values()) < 1e-4 for r in rows)
    assert delta_bwd.WY_WARPS is None
