"""Compile, on a machine without a GPU, the Triton kernels a GPU call will launch, into a Triton cache that the call
carries (``.tcache/precompiled.tar.NN``, unpacked by ``run_gpu.sh``): the GPU machine then loads them instead of
compiling, its first call after a kernel changed included.

    env -u TRITON_INTERPRET PYTHONPATH=<Triton 3.6>:. python benchmarks/precompile.py --cache DIR
        [--ops path path_fox ...] [--seq-lens 1024 ... 32768] [--head-dims 64 128] [--settings LABEL ...]
        [--train path ...] [--probes]
        [--pytest PYTEST ARGS ...] [--pack .tcache]

How. The launchers run on CPU tensors without the interpreter, so they pick the GPU's chunks, warps, precisions and
buffers (as ``benchmarks/path_memory.py`` runs them). Triton's driver is replaced by one that names the H100's and the
H200's target (``cuda``, sm_90, warps of 32) and 132 multiprocessors, and every launch compiles without running
(``JITFunction.run`` with ``warmup``); a launch's outputs stay unwritten, so what they feed is garbage, which no
launcher reads on the host. Triton keys its cache by its build (``triton_key()``: its sources and ``libtriton.so``),
the kernel's source, specialisation (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16, constexprs)
and options, and ptxas's version: the entries are the GPU machine's where its Triton is the same release from the same
wheel. The wheels differ only in ``libtriton.so`` between Python versions, so the key is this build's with that
library's hash replaced by the GPU machine's (``--libtriton-sha256``: by default the cp312 wheel of Triton 3.6.0, the
GPU machine's Python 3.12). In the twenty-first session every entry made here for the step of
``tests/models/test_autocast.py``'s PaTH model under bf16 autocast (``direction_fwd``, ``path_prepare`` twice,
``path_fwd``, ``path_query_terms``, ``rowdot``, ``path_local_bwd``, ``direction_bwd``) had the very key of the entry
the GPU machine had compiled for it, and nothing else was made.

Workloads: ``--ops``, ``benchmarks/ops.py``'s attnkit kernels (``*_triton``) forward and backward at its cells (bf16,
``32768 // T`` sequences, ``H·D = 1024``), and again under each of ``--settings`` (``path_tune.py``'s LOCAL labels, as
``run_gpu.sh pathlocal``'s ``LOCAL_PICK`` times them); ``--train``, ``benchmarks/train_throughput.py``'s step of these
mixers (under the CPU's bf16 autocast, whose casts at the kernels' inputs are CUDA's); ``--probes``,
``benchmarks/path_probe.py``'s list (``run_gpu.sh pathsmall``); ``--pytest``, a pytest run whose kernels compile
instead of running (its tests fail their checks, which is expected; tests that need CUDA skip). ``--pack`` writes the
cache as xz-compressed 15 MiB parts.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# sha256 of triton/_C/libtriton.so in triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl (PyPI)
LIBTRITON_CP312 = "28daaa70a904e4f8add754e518533e8a69b94ab8b16431ce77d45f1f25282b87"
SMS = 132  # the H100's (SXM) and the H200's multiprocessors
PART_BYTES = 15 << 20  # a file the device tool brings back or carries is at most 16 MiB


def gpu_triton_key(libtriton_sha256: str) -> str:
    """This Triton's ``triton_key()`` with its ``libtriton.so`` hash replaced by ``libtriton_sha256``."""
    import triton
    from triton.runtime.cache import triton_key

    local = hashlib.sha256((Path(triton.__file__).parent / "_C" / "libtriton.so").read_bytes()).hexdigest()
    key = triton_key()
    if key.count(local) != 1:
        raise RuntimeError(f"this Triton's key does not hold its libtriton.so hash once ({triton.__version__})")
    return key.replace(local, libtriton_sha256)


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks the driver, for device 0 of the GPU machine."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def compile_only(key: str):
    """Every launch compiles for the GPU machine (``key``: its ``triton_key()``) into ``TRITON_CACHE_DIR`` and runs
    nothing; the launchers see CUDA's 132 multiprocessors and take CPU tensors. Yields the launches' kernel names."""
    import triton.runtime.cache as cache
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from attnkit.ops.common import triton_utils, validation
    from attnkit.ops.common.triton import decode_merge, delta_fwd

    names: list[str] = []
    run, triton_key = JITFunction.run, cache.triton_key
    patched = [(validation, "kernel_device", lambda device: True)]
    patched += [(m, "multiprocessors", lambda device: SMS) for m in (triton_utils, delta_fwd, decode_merge)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patched]

    def compile_launch(self, *args, grid, warmup, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    active = driver._active  # None until a driver is asked for (on a machine without one, asking fails)
    driver.set_active(CompileOnlyDriver())
    cache.triton_key = lambda: key
    JITFunction.run = compile_launch
    for module, name, value in patched:
        setattr(module, name, value)
    try:
        yield names
    finally:
        JITFunction.run, cache.triton_key = run, triton_key
        for module, name, value in saved:
            setattr(module, name, value)
        driver._active = active


def ops_cells(ops: list[str], seq_lens: list[int], head_dims: list[int], tokens: int) -> None:
    """``benchmarks/ops.py``'s cells of ``ops``: each attnkit kernel (``*_triton``) forward alone (its ``fwd`` mode),
    then forward and backward."""
    import torch

    from benchmarks.ops import REGISTRY, WIDTH, _layout, _leaves

    for name in ops:
        op = REGISTRY[name]
        for D in head_dims:
            for T in seq_lens:
                H, B = WIDTH // D, max(1, tokens // T)
                x = {k: t.to(torch.bfloat16) for k, t in op.make_inputs(B, T, H, D).items()}
                for impl_name, impl in op.impls.items():
                    if impl_name.endswith("_triton"):
                        impl.fn(_leaves(x, impl, False))  # the forward alone keeps nothing for a backward
                        out = impl.fn(_leaves(x, impl, True))
                        out.backward(_layout(torch.randn_like(x["v"]), impl))
                print(f"  {name} D={D} T={T}", flush=True)


def train_steps(mixers: list[str], seq_lens: list[int], tokens: int = 16384) -> None:
    """``benchmarks/train_throughput.py``'s model-level step of each attnkit mixer (hidden 1024, 16 heads, bf16
    autocast, ``tokens // T`` sequences) with the kernels' backend: one layer and a small vocabulary, which no kernel
    sees."""
    import torch

    from attnkit.models import AttnKitConfig, AttnKitForCausalLM

    for mixer in mixers:
        config = AttnKitConfig(vocab_size=256, hidden_size=1024, num_hidden_layers=1, num_heads=16, mixer=mixer)
        config.backend, config.use_cache = "triton", False
        model = AttnKitForCausalLM(config)
        for T in seq_lens:
            ids = torch.randint(0, 256, (max(1, tokens // T), T))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(ids, labels=ids, use_cache=False).loss
            loss.backward()
            print(f"  train {mixer} T={T}", flush=True)


def probes() -> None:
    """``benchmarks/path_probe.py``'s probes (``run_gpu.sh pathsmall``), each with the settings it changes restored."""
    from benchmarks import path_probe

    for probe in path_probe.PROBES:
        args = shlex.split(probe)
        targets = (
            [text.partition("=")[0].rpartition(".") for text in args[args.index("--set") + 1 :]]
            if "--set" in args
            else []
        )
        saved = [(importlib.import_module(module), attr) for module, _, attr in targets]
        saved = [(module, attr, getattr(module, attr)) for module, attr in saved]
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                path_probe.main(args)
        finally:
            for module, attr, value in saved:
                setattr(module, attr, value)
        print(f"  probe {probe or '(default)'}", flush=True)


def pack(cache: Path, out: Path) -> list[Path]:
    """``cache`` as xz-compressed tar parts ``out/precompiled.tar.NN`` (earlier parts replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("precompiled.tar.*"):
        old.unlink()
    data = subprocess.run(["tar", "cJf", "-", "-C", str(cache), "."], check=True, capture_output=True).stdout
    parts = []
    for i in range(0, len(data), PART_BYTES):
        parts.append(out / f"precompiled.tar.{i // PART_BYTES:02d}")
        parts[-1].write_bytes(data[i : i + PART_BYTES])
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="the Triton cache folder to fill (TRITON_CACHE_DIR)")
    parser.add_argument("--ops", nargs="*", default=[], help="benchmarks/ops.py's ops, e.g. path path_fox")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument(
        "--settings", nargs="*", default=[], help="path_tune.py's LOCAL labels: the --ops cells again under each"
    )
    parser.add_argument("--probes", action="store_true", help="benchmarks/path_probe.py's probes")
    parser.add_argument("--train", nargs="*", default=[], help="train_throughput.py's step of these mixers")
    parser.add_argument("--train-seq-lens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--train-tokens", type=int, default=16384, help="tokens a step (B·T)")
    parser.add_argument("--pytest", nargs=argparse.REMAINDER, default=None, help="pytest's arguments (last)")
    parser.add_argument("--pack", type=Path, help="write the cache as DIR/precompiled.tar.NN")
    parser.add_argument("--libtriton-sha256", default=LIBTRITON_CP312, help="the GPU machine's libtriton.so hash")
    parser.add_argument("--any-triton", action="store_true", help="compile with a Triton other than 3.6.0 (a test)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1: the launchers would pick the interpreter's configurations; unset it")
    os.environ["TRITON_INTERPRET"] = "0"  # tests/conftest.py sets 1 on a CPU machine unless it is set
    os.environ["TRITON_CACHE_DIR"] = str(Path(args.cache).resolve())
    from benchmarks import path_tune

    local = dict(path_tune.LOCAL)
    unknown = [label for label in args.settings if label not in local]
    if unknown:
        parser.error(f"--settings: {unknown} not among path_tune.py's LOCAL labels {list(local)}")
    import triton

    if triton.__version__ != "3.6.0" and not args.any_triton:
        parser.error(f"Triton {triton.__version__}: the GPU machine has 3.6.0 (put its CPU wheel on PYTHONPATH)")
    start = time.time()
    with compile_only(gpu_triton_key(args.libtriton_sha256)) as names:
        ops_cells(args.ops, args.seq_lens, args.head_dims, args.tokens)
        for label in args.settings:  # the module attributes put back after each
            with path_tune.patched(local[label]):
                print(f"  setting {label!r}:", flush=True)
                ops_cells(args.ops, args.seq_lens, args.head_dims, args.tokens)
        if args.probes:
            probes()
        train_steps(args.train, args.train_seq_lens, args.train_tokens)
        if args.pytest is not None:
            import pytest

            pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", *args.pytest])
    entries = len(list(Path(args.cache).iterdir())) if Path(args.cache).exists() else 0
    print(f"{len(names)} launches of {len(set(names))} kernels, {entries} cache entries, {time.time() - start:.0f} s")
    if args.pack:
        parts = pack(Path(args.cache), args.pack)
        key = hashlib.sha256(gpu_triton_key(args.libtriton_sha256).encode()).hexdigest()
        (args.pack / "precompiled.key").write_text(key + "\n")
        print(f"packed: {', '.join(f'{p.name} ({p.stat().st_size >> 20} MiB)' for p in parts)}; key {key[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
