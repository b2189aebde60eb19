"""Compile, on a machine without a GPU, the Triton kernels a GPU call will launch, into a Triton cache that the call
carries (``.tcache/precompiled.tar.NN``, unpacked by ``run_gpu.sh``): the GPU machine then loads them instead of
compiling, its first call after a kernel changed included.

    env -u TRITON_INTERPRET PYTHONPATH=<Triton 3.6>:. python benchmarks/precompile.py --cache DIR
        [--ops path path_fox ...] [--seq-lens 1024 ... 32768] [--head-dims 64 128] [--settings LABEL ...]
        [--train path ...] [--probes] [--reproduce PAPER [--reproduce-cells PATTERN]]
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
``benchmarks/path_probe.py``'s list (``run_gpu.sh pathsmall``); ``--reproduce``, the training cells of ``attnkit
reproduce PAPER --scale full`` that are declared before any has finished (no chained cell; a ladder's first rung) and
match ``--reproduce-cells``, once for each model configuration (mixer, shape, the training batch's ``[B, T]`` and the
evaluation batches'; learning rates, seeds and task options that change none of these share one) as the trainer runs a
cell on CUDA: a training step and one no-grad forward of each distinct ``[b, T]`` of the validation and test sets (the
test lengths beyond training included), under bf16 autocast, with ``backend="auto"`` choosing as for CUDA tensors
(``--cuda-graph`` replays the same kernels; the variants' float32 evaluations are not run); ``--pytest``, a pytest run
whose kernels compile instead of running (its tests fail their checks, which is expected; tests that need CUDA skip).
``--pack`` writes the cache as xz-compressed 15 MiB parts.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import importlib
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attnkit.train import TrainConfig

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


@contextlib.contextmanager
def cuda_backends():
    """``backend="auto"`` chooses for CPU tensors what it chooses for CUDA tensors (the ops' Triton kernels, SDPA for
    softmax attention without a gate, PyTorch where an op has no kernels), as a GPU run of the default backend does."""
    import torch

    import attnkit.models  # noqa: F401  (every op that resolves a backend, imported)
    from attnkit.ops.common import validation

    resolve = validation.resolve_backend

    def as_cuda(backend, op, device, **kwargs):
        return resolve(backend, op, torch.device("cuda") if device.type == "cpu" else device, **kwargs)

    holders = [
        m for name, m in sys.modules.items() if name.startswith("attnkit") and vars(m).get("resolve_backend") is resolve
    ]
    for module in holders:
        module.resolve_backend = as_cuda
    try:
        yield
    finally:
        for module in holders:
            module.resolve_backend = resolve


@dataclass
class CellModel:
    """A model configuration of reproduction cells: ``config`` (the first cell's), its task's ``vocab_size``, a
    training step's ``[B, T]``, the evaluations' distinct ``[b, T]`` and the ``cells`` that run it."""

    config: TrainConfig
    vocab_size: int
    train: tuple[int, int]
    evals: tuple[tuple[int, int], ...]
    cells: list[str]


def cell_model(config: TrainConfig) -> CellModel:
    """``config``'s model configuration, with the shapes of the batches its task gives (and no cells yet)."""
    from attnkit.tasks import get_task
    from attnkit.train.trainer import batch_generator

    task = get_task(config.task, seed=config.seed, **config.task_options)
    ids, _ = task.sample(config.batch_size // config.grad_accum, batch_generator(config.seed, 0))
    evals = set()
    for split in ("validation", "test"):
        for sequences, _ in task.split_sets(split).values():
            n, b = sequences.shape[0], config.eval_batch_size
            evals |= {(min(b, n - start), sequences.shape[1]) for start in range(0, n, b)}
    return CellModel(config, task.vocab_size, tuple(ids.shape), tuple(sorted(evals)), [])


def reproduce_models(paper: str, pattern: str) -> list[CellModel]:
    """The model configurations of ``attnkit reproduce PAPER --scale full``'s training cells whose names match
    ``pattern`` (fnmatch), of those declared before any cell has finished."""
    from attnkit.experiments.reproduce.command import declared, declared_cells
    from attnkit.train import TrainConfig

    with tempfile.TemporaryDirectory() as empty:
        cells, _ = declared_cells(declared(paper, "full"), empty)
    drawn: dict[str, CellModel] = {}  # by the config less the learning rate and seed, which change no shape
    models: dict[str, CellModel] = {}
    for cell in cells:
        if cell.kind != "train" or not fnmatch.fnmatch(cell.name, pattern):
            continue
        fields = cell.params["config"]
        same = json.dumps({k: v for k, v in fields.items() if k not in ("lr", "seed")}, sort_keys=True)
        if same not in drawn:
            drawn[same] = cell_model(TrainConfig(**fields))
        model = drawn[same]
        c = model.config
        shape = [c.mixer, c.model_options, c.hidden_size, c.num_layers, c.num_heads, c.bf16, model.train, model.evals]
        models.setdefault(json.dumps(shape, sort_keys=True), model).cells.append(cell.name)
    return list(models.values())


def reproduce_steps(models: list[CellModel]) -> None:
    """Each model's training step and evaluation forwards as the trainer runs a cell on CUDA (bf16 autocast where
    the cell asks for it, the default backend), on random tokens."""
    import torch

    from attnkit.train.graphed import token_loss_sum
    from attnkit.train.trainer import build_model

    with cuda_backends():
        for m in models:
            c = m.config
            model = build_model(c, m.vocab_size, m.train[1])
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16)
            ids = torch.randint(0, m.vocab_size, m.train)
            with autocast:
                loss = token_loss_sum(model, ids, ids)
            loss.backward()
            model.eval()
            with torch.no_grad(), autocast:
                for shape in m.evals:
                    model(input_ids=torch.randint(0, m.vocab_size, shape), use_cache=False)
            evals = ", ".join(str(list(shape)) for shape in m.evals)
            cells = f"{m.cells[0]} and {len(m.cells) - 1} more"
            print(f"  reproduce {c.mixer} train {list(m.train)}, eval {evals}: {cells}", flush=True)


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
    parser.add_argument("--reproduce", metavar="PAPER", help="attnkit reproduce PAPER --scale full's training cells")
    parser.add_argument("--reproduce-cells", default="*", metavar="PATTERN", help="only cells matching (fnmatch)")
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
    models = []
    if args.reproduce:
        from attnkit.experiments.reproduce.command import PAPERS

        if args.reproduce not in PAPERS:
            parser.error(f"--reproduce: expected one of {list(PAPERS)}, got {args.reproduce!r}")
        models = reproduce_models(args.reproduce, args.reproduce_cells)
        if not models:
            parser.error(f"--reproduce-cells: no training cell of {args.reproduce} matches {args.reproduce_cells!r}")
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
        reproduce_steps(models)
        if args.pytest is not None:
            import pytest

            pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", *args.pytest])
    entries = len(list(Path(args.cache).iterdir())) if Path(args.cache).exists() else 0
    print(f"{len(names)} launches of {len(set(names))} kernels, {entries} cache entries, {time.time() - start:.0f} s")
    print("  " + ", ".join(f"{name} {names.count(name)}" for name in sorted(set(names))))
    if args.pack:
        parts = pack(Path(args.cache), args.pack)
        key = hashlib.sha256(gpu_triton_key(args.libtriton_sha256).encode()).hexdigest()
        (args.pack / "precompiled.key").write_text(key + "\n")
        print(f"packed: {', '.join(f'{p.name} ({p.stat().st_size >> 20} MiB)' for p in parts)}; key {key[:16]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
