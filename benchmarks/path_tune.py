"""Tuning sweep of the PaTH Triton kernels on a GPU: warps and stages of the forward, chunk size and warps of the
backward kernels, tile, tiles a program, warps and stages of the between-superblock sweep — each held to the default
configuration and timed against SDPA (flash) in one run.

    python benchmarks/path_tune.py [--seq-lens 4096] [--head-dims 64 128] [--out DIR]

bf16 PaTH-FoX inputs as ``benchmarks/ops.py`` makes them, causal, 32768 tokens per batch, H·D = 1024 (SPEC §8).
Prints a table per cell and writes ``path_tune.json``. The chosen configurations live in the launchers
(``path_fwd_fn``'s launch, ``backward_config``, ``backward_super.launch_config``). ``--device cpu`` runs the same
sweep on tiny shapes under ``TRITON_INTERPRET=1`` with wall-clock timing (the tests' smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnkit.cpu_bench import make_inputs  # noqa: E402
from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import path_attention  # noqa: E402
from attnkit.ops.common.triton_utils import block_dim, interpreting  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from attnkit.ops.path import parallel  # noqa: E402
from attnkit.ops.path.triton import backward, backward_super, forward, local, prepare  # noqa: E402
from attnkit.ops.path.triton.forward import path_fwd_fn  # noqa: E402
from benchmarks.ops import bench_ms, describe, environment  # noqa: E402

# (num_warps, num_stages, carry precision) of the prepare and forward kernels; None keeps the default
# (prepare.precisions: three bf16 passes for bfloat16 inputs at K = 64 and 128, 3xTF32 otherwise). "tf32" is one TF32
# pass for the carried query: ~3x fewer tensor-core passes, error read off `err`;
# "bf16x3" three bf16 passes of the hi/lo split (~1e-5 relative, at twice TF32's rate: half 3xTF32's time).
FWD = [(4, 1, None), (8, 1, None), (4, 2, None), (8, 2, None), (2, 1, None), (4, 1, "tf32"), (4, 1, "bf16x3")]
# Rows per block of the prepare kernel's UT solve (prepare.SOLVE_ROWS; the diagonal blocks at once:
# prepare.SOLVE_BATCHED), the forward timed with each; --solve-only adds the row-by-row solve and 16-row blocks one
# after another (SOLVE_BATCHED = False, the default before the fifteenth session).
SOLVE = [16, 32]
# --span-only: the superblocks' span in positions (prepare.SUPERBLOCK; 512 the default): shorter spans move work from
# the chunk-by-chunk kernels inside a superblock to the sweep between superblocks. The last, prepare.NO_SUPERBLOCKS,
# has none: every chunk pair is carried chunk by chunk in the UT form (two C x K products a chunk, FLA's way), what
# K > 128 always runs; at K = 128 it is the design without dense K x K transitions to weigh against them.
SPAN = [256, 512, 1024, prepare.NO_SUPERBLOCKS]
# (chunk, num_warps, key_tile) of the backward kernels; key_tile: the key side carries its key chunk
# (path_bwd_kv_tile_kernel: 49 KB of shared memory at K = 128 against 205 KB for the K x K product) rather than the
# product; None keeps carries_key_tile's rule.
BWD = [(64, 4, None), (64, 8, None), (32, 4, None), (32, 8, None), (16, 4, None), (64, 4, True), (32, 8, True)]
# (tile, tiles_per_program, num_warps, num_stages) of the between-superblock sweep (backward_super.launch_config);
# None keeps the default's, so the first row is the default itself (backward_super.program_groups picks the programs
# a key superblock). tiles_per_program 1 or 2: more programs, each with its own rows of E and Π (more scratch, so more
# waves at 32k). At K = 128 the default is 64-row tiles on eight warps and one stage (144 KB of shared memory, 1.4 KB
# of spills a thread; 41.1 ms at T = 4k on the H200, eleventh session); the last row is the one it replaced, the
# chunk's 32-row tiles on three stages (96 KB, 2.4–2.6 KB of spills; 47.0 ms). At K = 64 the last row is the default.
SUPER = [
    (None, None, None, None), (None, 1, None, None), (None, 2, None, None), (None, None, None, 1),
    (None, None, None, 2), (None, None, 8, None), (None, 1, 8, 2), (32, None, None, None), (32, None, 8, 3),
]  # fmt: skip
# --carry-only: the forward, then forward+backward, with every carry in 3xTF32, in one TF32 pass and in three bf16
# passes (prepare.CARRY_16BIT, the default for bfloat16 at K = 64 and 128), with beta drawn from (1.5, 2) as issue 3's
# accuracy bar asks.
CARRY = ["tf32x3", "tf32", "bf16x3"]


def chunks_of_64_at_k128(key_dim: int, default=backward.backward_config) -> tuple[int, int]:
    """``backward.backward_config`` with 64-position chunks on eight warps at a padded K of 128 (its own rule
    elsewhere). With 32-position chunks there every chunk kernel of the backward compiles to ``mma.sync`` instead of
    Hopper's ``wgmma`` (``benchmarks/kernel_resources.py``); with 64 all of them take ``wgmma``. With the local
    adjoint's gradient products in bf16, the inner kernels' products on 16-bit operands and their carries in three bf16
    passes (not one TF32 pass) every one fits shared memory for the float32 ``w`` the layers pass: the query kernel
    128 KB, the key kernel (since removed) 144 KB, the local adjoint 200 KB (with the carries in TF32: 256 and
    176 KB; sm_90a, Triton 3.6, twelfth session)."""
    return (64, 8) if block_dim(key_dim) == 128 and not interpreting() else default(key_dim)


# --local-only: (label, {(module, attribute): value}) — the defaults (prepare.measured_16bit: for bf16 at K = 64 and 128
# the chunk-local adjoint's gradient products in bf16, the backward's carries inside superblocks in one TF32 pass and
# the inner kernels' products on 16-bit operands, the forward's and the superblock-local terms' carries inside
# superblocks on 16-bit operands, the backward's working copies K̃, x, k̂ in float16; and everywhere the local adjoint's
# L⁻ᵀ dM by two products in bf16x3, the superblock terms' adjoint first and in place, its scratch at 64 MiB), then each
# of them undone (local.LOCAL_GRADS_16BIT, prepare.INNER_CARRY_16BIT, backward.INNER_LOW_GRAD, the back substitution for
# local.LOCAL_SOLVE), the inner query kernel checkpointing its carried queries instead of recomputing them
# (backward.INNER_RECOMPUTE off; with INNER_EVERY = 1 every one kept), its carries on float32 operands
# (backward.INNER_CARRY_LOW off), the forward's carries inside superblocks in their precision (forward.INNER_CARRY_LOW
# off), the working copies in float32 (prepare.BUFFERS_16BIT off), the superblock terms' scratch at 256 MiB
# (local.SCRATCH_BYTES), and both, the superblock terms' adjoint after the kernels between chunks
# (local.SUPER_TERMS_IN_PLACE off), the superblock-local terms' carries in their precision (local.TERMS_CARRY_LOW off),
# the three memory settings undone at once (the nineteenth session's default; each of these five was timed against it in
# the twentieth, path_local_session20_h200_d{64,128}.json), the two products in one TF32 pass, the sweep's products a
# (key tile, superblock) pair in one TF32 pass or in one pass on 16-bit operands (backward_super.PAIR_16BIT), the
# backward's 16-bit settings off at K = 128 (prepare.MEASURED_DIMS; LOCAL_DIMS=128 ... pathlocal), the superblock
# terms' dA summed as a K × K matrix a chunk (local.SUPER_DA_PROJECT off; it differs at K = 128 only), and at K = 128
# the backward's chunks of 64 positions with the local adjoint's products in bf16 (chunks_of_64_at_k128), and for
# float32 inputs (--dtype float32; the rows above are bf16 settings) every product exact, FMA-unrolled "ieee", or the
# products in one TF32 pass (prepare.FLOAT32_PRECISIONS; 3xTF32 the default); each timed forward+backward on bf16
# (--dtype) q, k, v with float32 w, beta and g (as the layers pass them) and held to the PyTorch backend in float32 on
# path_accuracy's inputs (beta in (1.5, 2), unit float32 w, B = 1, H = 2) at the same T, with the peak memory of one
# step on a GPU. --local-pick narrows the rows to labels holding a string.
LOCAL = [
    ("default", {}), ("inner products in float32", {(backward, "INNER_LOW_GRAD"): False}),
    ("inner carry as the others", {(prepare, "INNER_CARRY_16BIT"): None}),
    ("inner checkpoints every chunk", {(backward, "INNER_RECOMPUTE"): False, (backward, "INNER_EVERY"): 1}),
    ("prepare again in the backward", {(parallel, "KEEP_PREPARED"): False}),
    ("inner kernels on 2 stages", {(backward, "INNER_STAGES"): 2}),
    ("inner kernels on 3 stages", {(backward, "INNER_STAGES"): 3}),
    ("inner checkpoints, not recomputed", {(backward, "INNER_RECOMPUTE"): False}),
    ("inner recompute, float32 carries", {(backward, "INNER_CARRY_LOW"): False}),
    ("forward inner carries in their precision", {(forward, "INNER_CARRY_LOW"): False}),
    ("working buffers in float32", {(prepare, "BUFFERS_16BIT"): False}),
    ("superblock terms' scratch 256 MiB", {(local, "SCRATCH_BYTES"): 1 << 28}),
    ("float32 buffers, scratch 256 MiB", {(prepare, "BUFFERS_16BIT"): False, (local, "SCRATCH_BYTES"): 1 << 28}),
    ("superblock terms after, not in place", {(local, "SUPER_TERMS_IN_PLACE"): False}),
    ("superblock terms' carries in their precision", {(local, "TERMS_CARRY_LOW"): False}),
    ("memory: all three off", {
        (prepare, "BUFFERS_16BIT"): False, (local, "SCRATCH_BYTES"): 1 << 28, (local, "SUPER_TERMS_IN_PLACE"): False,
    }),
    ("local grads tf32", {(local, "LOCAL_GRADS_16BIT"): None}),
    ("local solve by substitution", {(local, "LOCAL_SOLVE"): None}),
    ("local solve by products tf32", {(local, "LOCAL_SOLVE"): "tf32"}),
    ("sweep pairs tf32", {(backward_super, "PAIR_16BIT"): "tf32"}),
    ("sweep pairs 16-bit", {(backward_super, "PAIR_16BIT"): "16bit"}),
    ("sweep superblocks outer", {(backward_super, "SWEEP_ORDER"): "superblocks"}),
    ("sweep superblocks outer, 128 MiB", {
        (backward_super, "SWEEP_ORDER"): "superblocks", (backward_super, "SCRATCH_BYTES"): 1 << 27,
    }),
    ("16-bit settings off at K = 128", {(prepare, "MEASURED_DIMS"): (64,)}),
    ("superblock terms' dA as K × K", {(local, "SUPER_DA_PROJECT"): False}),
    ("chunks of 64 at K = 128", {
        (backward, "backward_config"): chunks_of_64_at_k128, (prepare, "INNER_CARRY_16BIT"): None,
    }),
    ("float32 inputs exact", {(prepare, "FLOAT32_PRECISIONS"): ("ieee", "ieee")}),
    ("float32 inputs, products tf32", {(prepare, "FLOAT32_PRECISIONS"): ("tf32", "tf32x3")}),
]  # fmt: skip


@contextlib.contextmanager
def patched(settings: dict):
    """The module attributes of a ``LOCAL`` setting, put back on exit."""
    saved = {(module, name): getattr(module, name) for module, name in settings}
    try:
        for (module, name), value in settings.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def bench(fn, device: torch.device) -> float:
    return bench_ms(fn, [], device, warmup=25, rep=100)


def peak_mib(fn, device: torch.device) -> float | None:
    """The peak memory of one call of ``fn`` above what was allocated before it (MiB), as ``benchmarks/ops.py``
    measures forward+backward; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def attempt(fn):
    """``(result, None)`` or ``(None, one line)``: a configuration that does not compile or launch is recorded."""
    try:
        return fn(), None
    except Exception as error:  # noqa: BLE001 - any failure is a result of the sweep
        return None, describe(error)


GRADS = ("o", "dq", "dk", "dv", "dw", "dbeta", "dg")  # what grads_of returns


def grads_of(x: dict[str, torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o = path_attention(**leaves, backend="triton")
    o.backward(do)
    return [o] + [leaves[n].grad for n in ("q", "k", "v", "w", "beta", "g")]


def time_grads(label: str, x: dict[str, torch.Tensor], do: torch.Tensor, default: list, device: torch.device) -> dict:
    """Forward+backward with the configuration in force: ``error`` (a failure, or None), then each output's and
    gradient's error from ``default`` (``errs``, ``err`` the largest) and the time (``ms``); printed as it lands."""
    out, error = attempt(lambda: grads_of(x, do))
    row = dict(error=error)
    if out is not None:
        errs = [rel_rms(a, b) for a, b in zip(out, default)]
        row.update(err=max(errs), errs=dict(zip(GRADS, errs)), ms=bench(lambda: grads_of(x, do), device))
    print(f"  fwd+bwd {label}: {row.get('ms', float('nan')):.3f} ms {error or ''}")
    return row


def time_cell(
    D: int,
    T: int,
    device: torch.device,
    fwd: list,
    bwd: list,
    carries: list | None = None,
    sup: list = (),
    knobs: list = (),
    knob_grads: bool = False,
) -> dict:
    """One (D, T) cell: the forward ``fwd`` configurations, then forward+backward with the backward's ``bwd``
    configurations and the between-superblock kernels' ``sup``, or (``carries`` given) with each carry precision of
    16-bit inputs instead; ``knobs``: ``(name, value)`` settings of ``prepare`` (``SOLVE_ROWS``, the UT solve's block
    size; ``SUPERBLOCK``, the superblocks' span), the forward timed with each (and forward+backward when
    ``knob_grads``), each row keyed by the lower-cased name."""
    H = max(1, 1024 // D) if device.type == "cuda" else 2
    B = max(1, 32768 // T) if device.type == "cuda" else 1
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = {n: t.to(device=device, dtype=dtype) for n, t in make_inputs("path_fox", B, T, H, D).items()}
    if carries is not None:  # beta in (1.5, 2): the carries' hardest range
        x["beta"] = 1.5 + x["beta"] / 4
    do = torch.randn(B, T, H, D, device=device, dtype=dtype)
    cell = dict(D=D, T=T, B=B, H=H, fwd=[], bwd=[], super=[])
    if device.type == "cuda":
        qt, kt, vt = (x[n].transpose(1, 2).detach().requires_grad_() for n in ("q", "k", "v"))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa = functools.partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True)
            cell["sdpa_fwd"] = bench(sdpa, device)
            cell["sdpa_fwdbwd"] = bench(lambda: sdpa().backward(do.transpose(1, 2)), device)
    args = [x[n] for n in ("q", "k", "v", "w", "beta", "g")] + [D**-0.5, None]
    reference, _ = path_fwd_fn(*args)
    if carries is not None:  # the PyTorch backend on the same rounded inputs, computed in float32
        exact = path_attention(**{n: t.float() for n, t in x.items()}, backend="torch")
    for warps, stages, carry in fwd:
        config = dict(num_warps=warps, num_stages=stages) | ({} if carry is None else dict(carry_precision=carry))
        fn = functools.partial(path_fwd_fn, *args, config=config)
        out, error = attempt(fn)
        row = dict(num_warps=warps, num_stages=stages, carry_precision=carry or "default", error=error)
        if out is not None:
            row.update(err=rel_rms(out[0], reference), ms=bench(fn, device))
            if carries is not None:
                row["err_torch"] = rel_rms(out[0], exact)
        cell["fwd"].append(row)
        print(f"  fwd D={D} T={T} {config}: {row.get('ms', float('nan')):.3f} ms {error or ''}")
    for name, value in knobs if fwd else []:
        with patched({(prepare, name): value}):
            fn = functools.partial(path_fwd_fn, *args)
            out, error = attempt(fn)
            row = {name.lower(): value, "error": error}
            if out is not None:
                row.update(err=rel_rms(out[0], reference), ms=bench(fn, device))
        cell["fwd"].append(row)
        print(f"  fwd D={D} T={T} {name.lower()}={value}: {row.get('ms', float('nan')):.3f} ms {error or ''}")
    default = grads_of(x, do)
    for name, value in knobs if knob_grads else []:  # forward+backward (its UT solve takes it too)
        with patched({(prepare, name): value}):
            row = time_grads(f"D={D} T={T} {name.lower()}={value}", x, do, default, device)
        cell["bwd"].append({name.lower(): value, **row})
    for carry in carries or []:
        saved, prepare.CARRY_16BIT = prepare.CARRY_16BIT, carry or prepare.CARRY_16BIT
        try:
            row = time_grads(f"D={D} T={T} carry={carry or 'default'}", x, do, default, device)
        finally:
            prepare.CARRY_16BIT = saved
        cell["bwd"].append(dict(carry_precision=carry or "default", **row))
    config, rule = backward.backward_config, backward.carries_key_tile
    for chunk, warps, key_tile in bwd:
        backward.backward_config = lambda key_dim, c=chunk, w=warps: (c, w)
        if key_tile is not None:
            backward.carries_key_tile = lambda key_dim, t=key_tile: t
        setting = dict(chunk=chunk, num_warps=warps, key_tile=rule(D) if key_tile is None else key_tile)
        try:
            row = time_grads(f"D={D} T={T} " + " ".join(f"{k}={v}" for k, v in setting.items()), x, do, default, device)
        finally:
            backward.backward_config, backward.carries_key_tile = config, rule
        cell["bwd"].append(setting | row)
    launch = backward_super.launch_config
    for tile, per_program, warps, stages in sup:
        chosen = launch(D, backward.backward_config(D)[0])
        given = dict(tile=tile, tiles_per_program=per_program, num_warps=warps, num_stages=stages)
        setting = chosen | {k: v for k, v in given.items() if v is not None}
        backward_super.launch_config = lambda key_dim, chunk, *_, c=setting: c
        try:
            row = time_grads(f"D={D} T={T} super " + " ".join(f"{k}={v}" for k, v in setting.items()), x, do, default,
                             device)  # fmt: skip
        finally:
            backward_super.launch_config = launch
        cell["super"].append(setting | row)
    return cell


def local_cell(
    D: int,
    T: int,
    device: torch.device,
    jobs: int = 1,
    only: list[int] | None = None,
    pick: list[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """``--local-only``: each ``LOCAL`` setting's forward+backward time (bf16, 32768 tokens) and its output's and
    gradients' error from the PyTorch backend (``errs``, path_accuracy's inputs in bf16, ``err`` the largest); on the
    CPU float32 through the interpreter, where every setting is exact. Each setting compiles the backward's kernels
    afresh, for minutes on the H200's host: with ``jobs`` > 1 the settings' first runs go to that many processes at
    once (:func:`local_errors`), whose kernels Triton's disk cache hands to this process, which then checks and times
    them one after another. ``only``: the settings' indices (the child processes' ``--local-settings``, which compile
    but neither check nor time); ``pick``: the settings' indices this process times (``--local-pick``);
    ``dtype``: of ``q, k, v`` on a GPU (``--dtype``)."""
    H = max(1, 1024 // D) if device.type == "cuda" else 2
    B = max(1, 32768 // T) if device.type == "cuda" else 1
    dtype = dtype if device.type == "cuda" else torch.float32  # the interpreter's bf16 dot is wrong
    picked = only if only is not None else pick if pick is not None else list(range(len(LOCAL)))
    errors = local_errors(D, T, device, picked, jobs, dtype, check=only is None)
    x = {
        n: t.to(device=device, dtype=dtype if n in ("q", "k", "v") else torch.float32)
        for n, t in make_inputs("path_fox", B, T, H, D).items()
    }
    do = torch.randn(B, T, H, D, device=device, dtype=dtype)
    cell = dict(D=D, T=T, B=B, H=H, dtype=str(dtype).removeprefix("torch."), local=[])
    for i in picked:
        label, settings = LOCAL[i]
        row = dict(setting=label, **errors[i])
        with patched(settings):
            if row["error"] is None:
                # The timing's inputs compile on their own: a setting can run out of resources there and not in the
                # check (at D = 128 the twelfth session's first call timed bf16 w, which took the query kernel 16 KB
                # over). The failure is the row's, not the process's: a child keeps its other settings' rows (that
                # call's child lost two).
                if only is not None:  # a child process: compile the timing's shapes, leave the timing to the parent
                    row["error"] = attempt(lambda: grads_of(x, do))[1]
                else:
                    ms, row["error"] = attempt(lambda: bench(lambda: grads_of(x, do), device))
                    row.update({} if ms is None else dict(ms=ms, peak_mib=peak_mib(lambda: grads_of(x, do), device)))
        cell["local"].append(row)
        shown = " ".join(f"{n} {e:.1e}" for n, e in row.get("errs", {}).items())
        peak = f"peak {row['peak_mib']:.0f} MiB " if row.get("peak_mib") is not None else ""
        print(f"  fwd+bwd D={D} T={T} {label}: {row.get('ms', float('nan')):.3f} ms {peak}{shown} {row['error'] or ''}")
    return cell


def local_errors(
    D: int, T: int, device: torch.device, picked: list[int], jobs: int, dtype: torch.dtype, check: bool = True
) -> dict[int, dict]:
    """``{setting: {error, errs, err}}`` of ``LOCAL``'s settings against the PyTorch backend (one reference for all),
    in this process. With ``jobs`` > 1 their kernels compile first in that many child processes at once, each running
    ``--local-settings`` for its share without a reference (at T = 32k four children's references took the H100's
    80 GB, twenty-fourth session): a setting that failed there keeps the child's error. ``check`` False: the run's
    failure alone, no reference."""
    if jobs > 1 and len(picked) > 1:
        rows, shares = {}, [picked[j::jobs] for j in range(min(jobs, len(picked)))]
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for j, share in enumerate(shares):
                argv = [sys.executable, __file__, "--local-only", "--seq-lens", str(T), "--head-dims", str(D)]
                argv += ["--device", str(device), "--out", f"{tmp}/{j}", "--local-settings", *map(str, share)]
                argv += ["--dtype", str(dtype).removeprefix("torch.")]
                procs.append(subprocess.Popen(argv))
            for j, (proc, share) in enumerate(zip(procs, shares)):
                proc.wait()
                path = Path(tmp) / str(j) / "path_tune.json"
                got = json.loads(path.read_text())["cells"][0]["local"] if path.exists() else []
                for i, row in zip(share, got):
                    rows[i] = {k: row[k] for k in ("error", "errs", "err") if k in row}
                for i in share[len(got) :]:
                    rows[i] = dict(error=f"child process exited with {proc.returncode}")
        compiled = [i for i in picked if rows[i]["error"] is None]
        return rows | local_errors(D, T, device, compiled, 1, dtype, check) if compiled else rows
    from benchmarks.path_accuracy import NAMES, inputs, run

    *xs, do = inputs(T, D, 2, device)
    xs[:3] = [t.to(dtype) for t in xs[:3]]
    ref = run([t.float() for t in xs], do, "torch") if check else None
    rows = {}
    for i in picked:
        with patched(LOCAL[i][1]):
            got, error = attempt(lambda: run(xs, do.to(dtype), "triton"))
        rows[i] = dict(error=error)
        if got is not None and ref is not None:
            errs = {n: rel_rms(a.float(), e) for n, a, e in zip(NAMES, got, ref)}
            rows[i].update(errs=errs, err=max(errs.values()))
    return rows


SETTINGS = (
    ("fwd", ("num_warps", "num_stages", "carry_precision", "solve_rows", "solve_batched", "superblock")),
    ("bwd", ("chunk", "num_warps", "key_tile")),
    ("super", ("tile", "tiles_per_program", "num_warps", "num_stages")),
    ("local", ("setting",)),
)


def table(cells: list[dict]) -> str:
    lines = []
    for cell in cells:
        dtype = f", {cell['dtype']}" if "dtype" in cell else ""
        head = f"D={cell['D']} T={cell['T']} (B={cell['B']}, H={cell['H']}{dtype})"
        if "sdpa_fwd" in cell:
            head += f": SDPA fwd {cell['sdpa_fwd']:.3f} ms, fwd+bwd {cell['sdpa_fwdbwd']:.3f} ms"
        lines.append(head)
        for kind, keys in SETTINGS:
            for row in sorted(cell.get(kind, []), key=lambda r: r.get("ms", float("inf"))):
                setting = " ".join(f"{k}={row[k]}" for k in keys if k in row)
                if kind == "bwd" and "carry_precision" in row:
                    setting = f"carry_precision={row['carry_precision']}"
                for knob in ("solve_rows", "solve_batched", "superblock"):
                    if kind == "bwd" and knob in row:
                        setting = f"{knob}={row[knob]}"
                result = f"{row['ms']:.3f} ms, err {row['err']:.1e}" if "ms" in row else row["error"]
                if kind == "local" and "errs" in row:  # a --jobs child's rows have errors but no time
                    result = (
                        (f"{row['ms']:.3f} ms, " if "ms" in row else "")
                        + (f"peak {row['peak_mib']:.0f} MiB, " if row.get("peak_mib") is not None else "")
                        + "from the PyTorch backend "
                        + " ".join(f"{n} {e:.1e}" for n, e in row["errs"].items())
                        + (f"; {row['error']}" if row.get("error") else "")
                    )
                if "err_torch" in row:
                    result += f" ({row['err_torch']:.1e} from the PyTorch backend)"
                label = {"fwd": "fwd", "bwd": "fwd+bwd", "super": "fwd+bwd super", "local": "fwd+bwd local"}[kind]
                lines.append(f"  {label} {setting}: {result}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 32768])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="two configurations of each kind (smoke runs)")
    parser.add_argument(
        "--carry-only", action="store_true", help="only the carries' precision, forward and forward+backward (CARRY)"
    )
    parser.add_argument("--super-only", action="store_true", help="only the between-superblock kernels (SUPER)")
    parser.add_argument("--bwd-only", action="store_true", help="only the backward kernels' chunk and warps (BWD)")
    parser.add_argument(
        "--solve-only", action="store_true", help="only the UT solve's block sizes (SOLVE), fwd and fwd+bwd"
    )
    parser.add_argument(
        "--span-only", action="store_true", help="only the superblocks' span in positions (SPAN), fwd and fwd+bwd"
    )
    parser.add_argument(
        "--local-only", action="store_true", help="only the local adjoint's and inner carries' precisions (LOCAL)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="--local-only: processes compiling the settings at once")
    parser.add_argument("--local-settings", type=int, nargs="+", help=argparse.SUPPRESS)  # a --jobs child's share
    parser.add_argument("--local-pick", nargs="+", help="--local-only: the settings whose labels hold one of these")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="--local-only: q, k, v's dtype on a GPU"
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    fwd, bwd, sup = ([FWD[0], FWD[-2]], [BWD[2], BWD[-1]], [SUPER[0], SUPER[1]]) if args.quick else (FWD, BWD, SUPER)
    if args.carry_only:
        fwd, bwd, sup = [(4, 1, "tf32x3"), FWD[-2], FWD[-1]], [], []
    if args.super_only:
        fwd, bwd = [], []
    if args.bwd_only:
        fwd, sup = [], []
    if args.solve_only or args.span_only:
        fwd, bwd, sup = [FWD[0]], [], []
    cells = []
    for T in args.seq_lens:  # every D at the shortest T first: a time limit cuts the long cells
        for D in args.head_dims:
            narrowed = args.carry_only or args.super_only or args.bwd_only or args.span_only
            solve = [] if narrowed else SOLVE[:1] if args.quick else SOLVE
            solve = [None, *solve] if args.solve_only else solve
            knobs = [("SOLVE_ROWS", rows) for rows in solve] + [("SUPERBLOCK", p) for p in SPAN if args.span_only]
            knobs += [("SOLVE_BATCHED", False)] if args.solve_only else []  # 16-row blocks, one after another
            grads = args.solve_only or args.span_only
            if args.local_only:
                pick = (
                    None
                    if args.local_pick is None
                    else [i for i, (label, _) in enumerate(LOCAL) if any(s in label for s in args.local_pick)]
                )
                if pick == []:
                    parser.error(f"--local-pick: no setting's label holds any of {args.local_pick}")
                dtype = getattr(torch, args.dtype)
                cells.append(local_cell(D, T, device, args.jobs, args.local_settings, pick, dtype))
                write_json(Path(args.out) / "path_tune.json", dict(environment=environment(device), cells=cells))
                continue
            cells.append(time_cell(D, T, device, fwd, bwd, CARRY if args.carry_only else None, sup, knobs, grads))
            write_json(Path(args.out) / "path_tune.json", dict(environment=environment(device), cells=cells))
    print(table(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
