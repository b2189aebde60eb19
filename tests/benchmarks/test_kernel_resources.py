"""The kernel-resources report's launch recording: PaTH's forward+backward launchers run on CPU tensors without
the interpreter, every launch recorded instead of run (no host sync can read an output), with the GPU's choices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = [
    "path_prepare_kernel", "path_carry_kernel", "path_fwd_kernel",
    "path_bwd_super_kv_kernel", "path_bwd_super_row_kernel", "path_bwd_super_sig_kernel", "path_bwd_q_kernel",
    "path_super_terms_bwd_kernel", "path_local_bwd_kernel", "segment_cumsum_kernel",
]  # fmt: skip


def run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    script = [sys.executable, str(ROOT / "benchmarks" / "kernel_resources.py"), *args]
    return subprocess.run(script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_launches_of_a_path_fox_step_with_the_gpu_choices():
    done = run("--list", "--gate", "--head-dims", "64", "128")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for D in (64, 128):
        names = {line.split()[1] for line in lines if line.startswith(f"D={D} ")}
        assert names >= set(KERNELS), sorted(set(KERNELS) - names)
        assert "path_bwd_kv_tile_kernel" not in names  # up to K = 128 the query kernel adds the key side
        # At K = 64 the backward takes the forward's prepared tensors, carried keys and carried queries (the same
        # chunks): no prepare, carry or query terms kernel of its own; at K = 128 it chunks by 32 and makes its own.
        kinds = [line.split()[1] for line in lines if line.startswith(f"D={D} ")]
        own = 0 if D == 64 else 1
        assert (kinds.count("path_query_terms_kernel"), kinds.count("path_carry_kernel")) == (own, 1 + own), kinds
        assert kinds.count("path_prepare_kernel") == 1 + own, kinds
    # The GPU's launches, not the interpreter's: 64-position chunks at K = 64, and at K = 128 the sweep's 64-row tiles
    # on eight warps and one stage over 32-position chunks.
    sweep = [line for line in lines if line.startswith("D=128 path_bwd_super_kv_kernel")]
    assert len(sweep) == 1 and "(warps 8, stages 1)" in sweep[0] and "'BT': 64" in sweep[0]
    local = [line for line in lines if line.startswith("D=128 path_local_bwd_kernel")]
    assert len(local) == 1 and "'BT': 32" in local[0]
    assert any(line.startswith("D=64 path_local_bwd_kernel") and "'BT': 64" in line for line in lines)


def test_refuses_the_interpreter():
    done = run("--list", interpret=True)
    assert done.returncode != 0 and "TRITON_INTERPRET" in done.stderr


def test_a_path_tune_setting_changes_the_launches():
    """--setting: the launches a path_tune.LOCAL setting makes (64-position chunks in the backward at K = 128), the
    module attributes put back for the next head dim; an unknown label is refused by name."""
    done = run("--list", "--gate", "--head-dims", "128", "--setting", "chunks of 64 at K = 128")
    assert done.returncode == 0, done.stderr
    local = [line for line in done.stdout.splitlines() if line.startswith("D=128 path_local_bwd_kernel")]
    assert len(local) == 1 and "'BT': 64" in local[0]
    done = run("--list", "--setting", "no such setting")
    assert done.returncode != 0 and "--setting" in done.stderr


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   FMUL R2, R2, 0.5 ;                     /* 0x3f00000002027820 */
        /*0020*/              @!P0 FMUL.FTZ R3, R3, R3 ;                 /* 0x0000000303038220 */
        /*0030*/                   SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;      /* 0x0c201f0003047f89 */
        /*0040*/               @P1 BRA 0x10 ;                             /* 0xfffffffc00001947 */
        /*0050*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0060*/                   BRA 0x60 ;                             /* 0xfffffffc00007947 */
"""


def test_loops_are_read_off_the_sass_by_opcode():
    """A loop runs from a backward branch's target to the branch (a branch to itself is no loop), and its
    instructions count by opcode with the predicate and modifiers dropped."""
    from benchmarks.sass_report import loop_bodies, opcode_counts

    bodies = loop_bodies(SASS)
    assert [len(body) for body in bodies] == [4] and bodies[0][1] == "@!P0 FMUL.FTZ R3, R3, R3"
    assert opcode_counts(bodies[0]) == {"FMUL": 2, "SHFL": 1, "BRA": 1}
    assert list(opcode_counts(bodies[0])) == ["FMUL", "SHFL", "BRA"]  # most frequent first
