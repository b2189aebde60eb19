"""The GPU benchmark's harness (``benchmarks/ops.py``) on CPU: FLOP counts, arguments, tables and a smoke run."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from attnkit.ops import path_attention
from benchmarks import ops


def test_causal_flops():
    # 2·B·H·T²·D forward: QKᵀ and PV at 2·T²·D each, half of them under the mask.
    assert ops.causal_attention_flops(2, 1024, 16, 64) == 2 * 2 * 16 * 1024**2 * 64
    assert ops.FLOP_FACTOR == {"fwd": 1.0, "fwdbwd": 3.5}


def test_bench_budget_gives_long_steps_their_repetitions():
    """do_bench repeats ``int(rep / estimate)`` times: a 200 ms step under the default 100 ms got one sample; the
    budget gives every step at least MIN_REPS and leaves short steps the asked-for times."""
    warmup, rep = ops.bench_budget(25, 100, 200.0)
    assert int(rep / 200.0) >= ops.MIN_REPS and int(warmup / 200.0) >= 2
    assert ops.bench_budget(25, 100, 0.5) == (25, 100)


def test_parse_args_defaults_and_quick():
    args = ops.parse_args([])
    assert args.seq_lens == list(ops.SEQ_LENS) and args.head_dims == [64, 128]
    assert args.modes == ["fwd", "fwdbwd"] and args.impls is None
    assert args.ops == ["tapa", "vla", "path", "path_fox", "fox", "linear", "deltanet"]
    assert (args.warmup, args.rep, args.name) == (25, 100, "ops")
    quick = ops.parse_args(["--quick", "--rep", "7", "--impls", "sdpa", "tapa_flex"])
    assert quick.seq_lens == list(ops.QUICK_SEQ_LENS) and (quick.warmup, quick.rep) == (10, 7)
    assert quick.impls == ["sdpa", "tapa_flex"]


@pytest.mark.parametrize("argv", [["--seq-lens", "3000"], ["--head-dims", "96"], ["--impls", "nope"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ops.parse_args(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def _row(impl, T, mode, ms, peak=None, errors=None, error=None, timing="do_bench", check_error=None):
    return {
        "op": "tapa", "impl": impl, "T": T, "D": 64, "B": 32768 // T, "H": 16, "mode": mode, "ms": ms,
        "tflops": None if ms is None else 1.0, "ratio_to_sdpa": None, "peak_mem_bytes": peak,
        "mem_ratio_to_sdpa": None, "timing": None if ms is None else timing, "error": error, "errors": errors,
        "check_error": check_error, "check_s": None,
    }  # fmt: skip


def test_ratios_and_tables():
    good = {"o": 2e-3, "dq": 4e-3, "dk": 3e-3, "dv": 1e-3}
    bad = {"o": 2e-2}
    no_backward = "NotImplementedError: no backward"
    rows = [
        _row("sdpa", 1024, "fwd", 2.0),
        _row("tapa_triton", 1024, "fwd", 2.5, errors=good),
        _row("tapa_flex", 1024, "fwd", 4.0, errors=bad),
        _row("sdpa", 1024, "fwdbwd", 4.0, peak=2**20),
        _row("tapa_triton", 1024, "fwdbwd", 5.0, peak=3 * 2**20, errors=good),
        _row("tapa_flex", 1024, "fwdbwd", 4000.0, errors=bad, timing="one call"),
        _row("sdpa", 2048, "fwd", 3.0),
        _row("tapa_triton", 2048, "fwd", 3.3, errors={"o": 1e-3}, check_error=no_backward),
        _row("sdpa", 2048, "fwdbwd", 8.0, peak=2**21),
        _row(
            "tapa_triton", 2048, "fwdbwd", None, error="OutOfMemoryError: CUDA out of memory", check_error=no_backward
        ),
        _row("tapa_flex", 2048, "fwdbwd", None, error="skipped: one call took 4000 ms at T=1024"),
    ]
    ops.add_ratios(rows)
    assert [r["ratio_to_sdpa"] for r in rows[:3]] == [1.0, 1.25, 2.0]
    assert rows[4]["mem_ratio_to_sdpa"] == 3.0 and rows[5]["mem_ratio_to_sdpa"] is None
    table = ops.format_tables(rows)
    assert "2.0e-03 4.0e-03 ok" in table and "2.0e-02 FAIL" in table and "1.0e-03 error" in table
    assert "1.25x" in table and "1000.00x*" in table and "3.00x" in table and "skipped" in table
    assert table.endswith(
        "tapa/tapa_triton check failed at T=2048 D=64: NotImplementedError: no backward\n"
        "tapa/tapa_triton fwdbwd failed at T=2048 D=64: OutOfMemoryError: CUDA out of memory"
    )
    assert len(table) < 3000


def test_crossover_lengths():
    """The linear ops' tables end with the length from which each implementation stays faster than SDPA."""
    rows = []
    timings = [(1024, 1.0, 4.0, 0.5), (2048, 2.0, 4.0, 2.5), (4096, 4.0, 3.9, 1.0), (8192, 8.0, 4.1, 2.0)]
    for T, sdpa, vla, fla in timings:
        rows += [_row("sdpa", T, "fwdbwd", sdpa), _row("vla_triton", T, "fwdbwd", vla), _row("fla", T, "fwdbwd", fla)]
    for r in rows:
        r["op"] = "vla"
    ops.add_ratios(rows)
    lines = ops.crossovers(rows)
    assert lines == [
        "vla/fla D=64 fwdbwd: faster than SDPA from T=4096",
        "vla/vla_triton D=64 fwdbwd: faster than SDPA from T=4096",
    ]
    assert ops.crossovers([r for r in rows if r["T"] < 4096])[1] == (
        "vla/vla_triton D=64 fwdbwd: slower than SDPA up to T=2048 (2.00x there)"
    )
    assert ops.format_tables(rows).endswith(lines[-1])


def test_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    """The whole harness on tiny shapes: an implementation that raises is recorded, the others checked and timed.

    The PyTorch backend stands in for a kernel (FlexAttention's eager form takes seconds here; test_flex_tapa.py
    holds it to the reference).
    """

    def broken(x):
        raise RuntimeError("boom")

    monkeypatch.setitem(ops.REGISTRY["tapa"].impls, "torch", ops.Impl(ops._tapa_reference))
    monkeypatch.setitem(ops.REGISTRY["tapa"].impls, "broken", ops.Impl(broken))
    argv = ["--device", "cpu", "--tokens", "64", "--seq-lens", "16", "32", "--head-dims", "64", "--max-ms", "1e4"]
    argv += ["--impls", "sdpa", "torch", "broken", "--out", str(tmp_path), "--name", "smoke"]
    assert ops.main(argv) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(
        "tapa/broken check failed at T=16 D=64: RuntimeError: boom\n"
        "tapa/broken fwd failed at T=16 D=64: RuntimeError: boom\n"
        "tapa/broken fwdbwd failed at T=16 D=64: RuntimeError: boom"
    )
    payload = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert {"device", "torch", "triton", "python", "commit", "dirty", "date"} <= set(payload["environment"])
    rows = {(r["impl"], r["T"], r["mode"]): r for r in payload["rows"]}
    impls = ("sdpa", "torch", "broken")
    assert set(rows) == {(i, T, m) for i in impls for T in (16, 32) for m in ("fwd", "fwdbwd")}
    sdpa = rows[("sdpa", 32, "fwd")]
    assert sdpa["ratio_to_sdpa"] == 1.0 and (sdpa["B"], sdpa["H"]) == (2, 16) and sdpa["timing"] == "do_bench"
    torch_row = rows[("torch", 32, "fwdbwd")]
    assert torch_row["error"] is None and torch_row["ms"] > 0 and torch_row["ratio_to_sdpa"] > 0
    assert set(torch_row["errors"]) == {"o", "dq", "dk", "dv"} and max(torch_row["errors"].values()) < 1e-2
    assert rows[("broken", 16, "fwdbwd")]["error"] == "RuntimeError: boom"
    assert rows[("broken", 16, "fwd")]["check_error"] == "RuntimeError: boom"
    # what failed is not run again at a longer T
    assert rows[("broken", 32, "fwd")]["error"] == "skipped: failed at T=16"
    assert rows[("broken", 32, "fwd")]["check_error"] is None

    # --replot: the same tables and a new plot from the JSON alone, nothing measured again
    tables = out[out.index("tapa D=64") : out.index("tapa/broken check failed")]
    (tmp_path / "smoke.png").unlink()
    assert ops.main(["--replot", str(tmp_path / "smoke.json")]) == 0
    assert tables.strip() in capsys.readouterr().out
    assert (tmp_path / "smoke.png").stat().st_size > 0


def test_smoke_run_path_on_cpu(tmp_path, monkeypatch):
    """PaTH and PaTH-FoX through the harness: the PyTorch backend stands in for the kernels (Triton and FLA run on
    the GPU only) and is held to the reference with every input's gradient, ``g`` included."""
    for name in ("path", "path_fox"):
        monkeypatch.setitem(ops.REGISTRY[name].impls, "torch", ops.Impl(ops._path("torch")))
    argv = ["--device", "cpu", "--ops", "path", "path_fox", "--tokens", "32", "--seq-lens", "16", "--head-dims", "64"]
    argv += ["--impls", "sdpa", "torch", "--max-ms", "1e4", "--out", str(tmp_path), "--name", "smoke_path"]
    assert ops.main(argv) == 0
    rows = {(r["op"], r["impl"], r["mode"]): r for r in json.loads((tmp_path / "smoke_path.json").read_text())["rows"]}
    assert set(rows) == {(o, i, m) for o in ("path", "path_fox") for i in ("sdpa", "torch") for m in ("fwd", "fwdbwd")}
    assert all(r["error"] is None and r["ms"] > 0 and r["ratio_to_sdpa"] > 0 for r in rows.values())
    inputs = {"o", "dq", "dk", "dv", "dw", "dbeta"}
    for op_name, names in (("path", inputs), ("path_fox", inputs | {"dg"})):
        errors = rows[(op_name, "torch", "fwdbwd")]["errors"]
        assert set(errors) == names and max(errors.values()) < 1e-2, (op_name, errors)


@pytest.mark.parametrize("name, impl", [("linear", "linear_triton"), ("deltanet", "deltanet_triton")])
def test_linear_ops_kernels_match_their_reference(name, impl):
    """Linear attention's and DeltaNet's kernel entries compute their op's reference (float32 here: the harness's
    bf16 runs need a GPU, the interpreter's bf16 products being wrong)."""
    op = ops.REGISTRY[name]
    x = op.make_inputs(2, 20, 2, 16)
    torch.testing.assert_close(op.impls[impl].fn(x), op.reference(x), atol=1e-4, rtol=1e-4)


def test_fla_path_gate_convention(monkeypatch):
    """FLA's ``parallel_path_attn`` scales ``G_i − G_j`` with the dot product, so the harness passes ``g / scale``.

    A stand-in with FLA's signature, float32 asserts and gate convention (ours with the gate times ``scale``)
    takes the place of the package, which only the GPU machine has.
    """

    def parallel_path_attn(q, k, v, w, beta, g=None, scale=None, cu_seqlens=None, use_cache=False):
        assert w.dtype == beta.dtype == torch.float32 and (g is None or g.dtype == torch.float32)
        gate = None if g is None else g * scale
        return path_attention(q, k, v, w, beta, gate, scale=scale, backend="torch"), None

    module = types.ModuleType("fla.ops.path_attn.parallel")
    module.parallel_path_attn = parallel_path_attn
    monkeypatch.setitem(sys.modules, "fla.ops.path_attn.parallel", module)
    for name in ("path", "path_fox"):
        x = {n: t.to(torch.bfloat16) for n, t in ops.REGISTRY[name].make_inputs(1, 24, 2, 16).items()}
        expected = ops.REGISTRY[name].reference(x)
        torch.testing.assert_close(ops._fla_parallel_path_attn(x), expected)


def test_slow_implementation_is_timed_once_then_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(ops.REGISTRY["tapa"].impls, "torch", ops.Impl(ops._tapa_reference))
    argv = ["--device", "cpu", "--tokens", "32", "--seq-lens", "16", "32", "--head-dims", "64", "--modes", "fwd"]
    argv += ["--impls", "torch", "--max-ms", "0", "--out", str(tmp_path), "--name", "slow"]
    assert ops.main(argv) == 0
    rows = json.loads((tmp_path / "slow.json").read_text())["rows"]
    assert [r["timing"] for r in rows] == ["one call", None]
    assert rows[1]["error"].startswith("skipped: one call took")
    assert "skipped" in capsys.readouterr().out
