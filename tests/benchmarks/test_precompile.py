"""``benchmarks/precompile.py``: kernels compiled for the GPU machine on a machine without one, into a Triton cache
packed for the device call to carry, keyed by the GPU machine's Triton build."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import triton

from benchmarks import precompile

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_key_is_this_builds_with_the_gpu_machines_library_hash():
    from triton.runtime.cache import triton_key

    local = hashlib.sha256((Path(triton.__file__).parent / "_C" / "libtriton.so").read_bytes()).hexdigest()
    other = "ab" * 32
    key = precompile.gpu_triton_key(other)
    assert local in triton_key() and local not in key and other in key
    assert key.replace(other, local) == triton_key()


def test_an_op_and_a_model_step_compile_for_sm90_without_running_and_pack(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cache, carry = tmp_path / "cache", tmp_path / "tcache"
    script = [sys.executable, str(ROOT / "benchmarks" / "precompile.py"), "--cache", str(cache), "--ops", "path_fox"]
    script += ["--seq-lens", "128", "--head-dims", "64", "--tokens", "128", "--any-triton", "--pack", str(carry)]
    script += ["--train", "path", "--train-seq-lens", "64", "--train-tokens", "64"]  # the layer's direction kernels
    done = subprocess.run(script, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    kernels = {p.name for entry in cache.iterdir() for p in entry.glob("*.cubin")}
    expected = {"path_prepare_kernel", "path_fwd_kernel", "path_local_bwd_kernel", "direction_fwd_kernel"}
    assert {f"{name}.cubin" for name in expected} <= kernels, kernels
    assert all('"arch": 90' in next(entry.glob("path_*.json"), entry).read_text() for entry in cache.iterdir()
               if next(entry.glob("path_*.json"), None))  # fmt: skip
    parts = sorted(carry.glob("precompiled.tar.*"))
    assert (
        parts
        and (carry / "precompiled.key").read_text().strip()
        == hashlib.sha256(precompile.gpu_triton_key(precompile.LIBTRITON_CP312).encode()).hexdigest()
    )
    whole = tmp_path / "whole.tar.xz"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as archive:
        assert {Path(n).name for n in archive.getnames()} >= kernels
    assert "launches of" in done.stdout and "cache entries" in done.stdout


def test_a_path_tune_setting_compiles_its_own_specialisation(tmp_path):
    """``--settings``: the ``--ops`` cells again under a ``path_tune.LOCAL`` setting, here the sweep's loop order
    (``SUPERBLOCKS_OUTER``, a constexpr of the sweep kernel's, at T = 1024: two superblocks), so that the sweep kernel
    is compiled in both specialisations; an unknown label is refused by name, before anything compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cache = tmp_path / "cache"
    script = [sys.executable, str(ROOT / "benchmarks" / "precompile.py"), "--cache", str(cache), "--ops", "path_fox"]
    script += ["--seq-lens", "1024", "--head-dims", "64", "--tokens", "1024", "--any-triton"]
    done = subprocess.run(
        [*script, "--settings", "sweep superblocks outer"], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    sweeps = [entry for entry in cache.iterdir() if (entry / "path_bwd_super_kv_kernel.cubin").exists()]
    assert len(sweeps) == 2 and "setting 'sweep superblocks outer'" in done.stdout
    other = tmp_path / "other"
    script[script.index(str(cache))] = str(other)
    refused = subprocess.run([*script, "--settings", "no such"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode != 0 and "--settings" in refused.stderr and not other.exists()


def test_reproduce_runs_each_model_configuration_once():
    """``--reproduce``: the flip-flop cells (four mixers × three learning rates × two seeds) are four configurations,
    MQRAR's four N of one length share PaTH's, and an LM's evaluations are its lengths 1× to 16× at the batches the
    trainer cuts its test sets into; nothing compiles."""
    flipflop = precompile.reproduce_models("path", "flipflop*")
    assert [m.config.mixer for m in flipflop] == ["path", "rope", "fox", "path_fox"]
    assert all(len(m.cells) == 6 and m.train == (64, 512) and m.evals == ((64, 512),) for m in flipflop)
    (mqrar,) = precompile.reproduce_models("path", "mqrar-path_*")
    assert len(mqrar.cells) == 24 and {name.split("_")[1] for name in mqrar.cells} == {"N1", "N2", "N3", "N4"}
    (lm,) = precompile.reproduce_models("path", "lm_default-path_L*")
    assert lm.train == (64, 512) and lm.evals == ((8, 8192), (16, 4096), (32, 2048), (64, 512), (64, 1024))
    assert precompile.reproduce_models("path", "no such*") == []


def test_cuda_backends_choose_for_cpu_tensors_as_for_cuda():
    import torch

    from attnkit.ops.path import path_backend

    q = torch.zeros(1, 16, 2, 64)
    with precompile.cuda_backends():
        assert path_backend("auto", q, q) == "triton"
    assert path_backend("auto", q, q) == "torch"
