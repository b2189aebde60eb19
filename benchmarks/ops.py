"""GPU kernel benchmarks (SPEC §8): every op's implementations against SDPA's flash backend, in one run.

    python benchmarks/ops.py [--ops tapa vla path path_fox fox linear deltanet] [--seq-lens 1024 ... 32768]
                             [--head-dims 64 128] [--modes fwd fwdbwd] [--impls sdpa tapa_triton tapa_flex]
                             [--quick] [--out DIR] [--name NAME]
    python -m attnkit bench --gpu -- [the same arguments]

bf16, causal, 32768 tokens per batch (``B = max(1, 32768 // T)``), ``H·D = 1024`` (H=16 at D=64, H=8 at D=128).
Per (op, D, T) cell: first each implementation's output (and, up to ``--grad-check-max-t``, its gradients) is held
to the op's PyTorch backend by relative RMS error; then each one is timed, forward (under ``no_grad``) and
forward+backward, by the median of ``triton.testing.do_bench`` (of at least ``MIN_REPS`` repetitions: its time
budget stretched for steps longer than ``--rep`` would allow), with the peak memory of one call above its
inputs. TFLOP/s count the causal half of ``QKᵀ`` and ``PV``: ``2·B·H·T²·D`` forward, 2.5× that backward, for
every op (SDPA-equivalent: PaTH's carries and the linear ops' states are not counted).
An implementation whose single call takes longer than ``--max-ms`` is recorded from that one call and skipped
at longer ``T`` (FlexAttention's backward accumulates the captured phase channels' gradients with atomics).
A failure (not implemented, out of memory, compile error) is recorded in its row and the run goes on.

Writes ``DIR/NAME.json`` (rows and environment) and ``DIR/NAME.png`` (TFLOP/s against T), then prints the
tables last. ``--device cpu`` runs the same harness on tiny shapes with wall-clock timing (the tests' smoke run).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.metadata
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

ROOT = Path(__file__).resolve().parents[1]
# Run as a script on a machine where attnkit is not installed (the GPU machine's bare copy of the tree).
sys.path.insert(0, str(ROOT))

from attnkit.cpu_bench import make_inputs  # noqa: E402
from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops import (  # noqa: E402
    delta_rule,
    linear_attention,
    path_attention,
    softmax_attention,
    tapa_attention,
    vla_attention,
)
from attnkit.ops.common.utils import rel_rms  # noqa: E402
from attnkit.ops.vla.naive import vla_naive  # noqa: E402
from benchmarks.flex_tapa import causal_block_mask, compiled_flex_attention, tapa_flex  # noqa: E402

TOKENS = 32768
WIDTH = 1024  # H·D, SPEC §8
SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_SEQ_LENS = (2048, 8192, 32768)
HEAD_DIMS = (64, 128)
MODES = ("fwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}  # backward = 2.5 × forward
BASELINE = "sdpa"
BARS = {"o": 5e-3, "grads": 1e-2}  # SPEC §8: relative RMS error of a bf16 kernel against the PyTorch backend
THETA, ALPHA = 0.5, 0.1  # tapa_attention's defaults


@dataclass(frozen=True)
class Impl:
    """One way of computing an op: ``fn`` maps the named inputs to the output.

    ``heads_first``: ``fn`` takes ``[B, H, T, ·]`` tensors (SDPA) instead of the ops' ``[B, T, H, ·]``.
    ``checked``: ``fn`` computes the op itself, in the op's layout, so it is held to the op's reference (SDPA
    is not).
    """

    fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    heads_first: bool = False
    checked: bool = True


@dataclass(frozen=True)
class Op:
    """An op of the benchmark: its inputs, its PyTorch reference and the implementations to time.

    ``make_inputs(B, T, H, D)`` gives float32 CPU tensors in the op's layout; every op's output has the shape
    of ``v``. ``flops(B, T, H, D)`` is the forward's count. ``linear``: the op's cost is linear in ``T``, so the
    tables end with its crossover length with SDPA.
    """

    make_inputs: Callable[[int, int, int, int], dict[str, torch.Tensor]]
    reference: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    impls: dict[str, Impl]
    flops: Callable[[int, int, int, int], float]
    linear: bool = False  # linear in T: the tables end with the length from which each one beats SDPA


def causal_attention_flops(B: int, T: int, H: int, D: int) -> float:
    """Forward FLOPs of causal attention: ``QKᵀ`` and ``PV``, ``2·T²·D`` each per head, halved by the mask."""
    return 4 * B * H * T * T * D / 2


def _sdpa(x: dict[str, torch.Tensor]) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)


def _tapa_triton(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return tapa_attention(x["q"], x["k"], x["v"], theta=THETA, alpha=ALPHA, backend="triton")


def _tapa_flex(x: dict[str, torch.Tensor]) -> torch.Tensor:
    q = x["q"]
    # Inductor's CPU FlexAttention has no backward, so CPU smoke runs use the eager (unfused) form.
    flex = compiled_flex_attention() if q.is_cuda else flex_attention
    mask = causal_block_mask(q.shape[1], q.device)
    return tapa_flex(q, x["k"], x["v"], THETA, ALPHA, block_mask=mask, flex=flex)


def _vla(backend: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return vla_attention(x["q"], x["k"], x["v"], x["u"], backend=backend)[0]

    return fn


def _vla_sequential(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The recurrence token by token, vectorised over batch and heads: the paper's public code's style."""
    return vla_naive(x["q"], x["k"], x["v"], x["u"])[0]


def _fla_chunk_delta_rule(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """FLA's DeltaNet kernel on the same tensors (unit keys, beta from u): the speed yardstick of issue 5."""
    from fla.ops.delta_rule import chunk_delta_rule

    k = F.normalize(x["k"], dim=-1)
    return chunk_delta_rule(x["q"], k, x["v"], torch.sigmoid(x["u"][..., 0]))[0]


def _fla_chunk_linear_attn(x: dict[str, torch.Tensor]) -> torch.Tensor:
    from fla.ops.linear_attn import chunk_linear_attn

    return chunk_linear_attn(x["q"], x["k"], x["v"], normalize=True)[0]


def _linear(backend: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return linear_attention(x["q"], x["k"], x["v"], backend=backend)[0]

    return fn


def _deltanet(backend: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], backend=backend)[0]

    return fn


def _fla_deltanet(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """FLA's DeltaNet kernel on the same function: unit keys, ``beta``, scale ``1 / sqrt(K)`` (both defaults)."""
    from fla.ops.delta_rule import chunk_delta_rule

    return chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"].float())[0]


def _tapa_reference(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return tapa_attention(x["q"], x["k"], x["v"], theta=THETA, alpha=ALPHA, backend="torch")


def _path(backend: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """PaTH, or PaTH-FoX when the inputs hold a log forget gate ``g``."""

    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return path_attention(x["q"], x["k"], x["v"], x["w"], x["beta"], x.get("g"), backend=backend)

    return fn


def _fla_parallel_path_attn(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """FLA's PaTH(-FoX) kernel, the same function: FLA multiplies the gate's ``G_i − G_j`` by ``scale`` with the
    dot product, ours adds it unscaled, hence ``g / scale``. FLA asserts float32 ``w``, ``beta`` and ``g``; the
    bf16 values upcast exactly, so it sees the inputs the others do."""
    from fla.ops.path_attn.parallel import parallel_path_attn

    scale = x["q"].shape[-1] ** -0.5
    g = None if x.get("g") is None else x["g"].float() / scale
    return parallel_path_attn(x["q"], x["k"], x["v"], x["w"].float(), x["beta"].float(), g, scale=scale)[0]


def _path_op(name: str) -> Op:
    """PaTH (``"path"``) or PaTH-FoX (``"path_fox"``, inputs with a gate): the same implementations."""
    return Op(
        make_inputs=lambda B, T, H, D: make_inputs(name, B, T, H, D),
        reference=_path("torch"),
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "path_triton": Impl(_path("triton")),
            "fla_parallel_path_attn": Impl(_fla_parallel_path_attn),
        },
        flops=causal_attention_flops,
    )


def _fox(backend: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    def fn(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return softmax_attention(x["q"], x["k"], x["v"], x["g"], backend=backend)

    return fn


def _fla_parallel_forgetting_attn(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """FLA's FoX kernel, the same function (it adds ``G_i − G_j`` unscaled too); its gate in float32, which the bf16
    values upcast to exactly."""
    from fla.ops.forgetting_attn.parallel import parallel_forgetting_attn

    return parallel_forgetting_attn(x["q"], x["k"], x["v"], x["g"].float())


# One entry per op of the issues (TAPA 4, VLA 5, PaTH 3 with its gated form PaTH-FoX, FoX 17); a kernel variant joins
# its op's ``impls``.
REGISTRY: dict[str, Op] = {
    "tapa": Op(
        make_inputs=lambda B, T, H, D: make_inputs("tapa", B, T, H, D),
        reference=_tapa_reference,
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "tapa_triton": Impl(_tapa_triton),
            "tapa_flex": Impl(_tapa_flex),
        },
        flops=causal_attention_flops,
    ),
    # Linear-time ops: TFLOP/s are those of causal softmax attention of the same shape (SDPA-equivalent), so
    # the ms and the ratio to SDPA are what to read; the FLA kernels compute other functions (not checked).
    "vla": Op(
        make_inputs=lambda B, T, H, D: make_inputs("vla", B, T, H, D),
        reference=_vla("torch"),
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "vla_triton": Impl(_vla("triton")),
            "vla_torch": Impl(_vla("torch"), checked=False),
            "vla_sequential": Impl(_vla_sequential, checked=False),
            "fla_chunk_delta_rule": Impl(_fla_chunk_delta_rule, checked=False),
            "fla_chunk_linear_attn": Impl(_fla_chunk_linear_attn, checked=False),
        },
        flops=causal_attention_flops,
        linear=True,
    ),
    # PaTH's carries (the Householder products that move queries and keys between chunks) are not counted:
    # TFLOP/s are SDPA-equivalent, so the ratio to SDPA is what the extra work costs.
    "path": _path_op("path"),
    "path_fox": _path_op("path_fox"),
    # FoX (issue 17): softmax attention with the forget gate's bias G_i − G_j, against FLA's FoX kernel.
    "fox": Op(
        make_inputs=lambda B, T, H, D: make_inputs("fox", B, T, H, D),
        reference=_fox("torch"),
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "fox_triton": Impl(_fox("triton")),
            "fla_parallel_forgetting_attn": Impl(_fla_parallel_forgetting_attn),
        },
        flops=causal_attention_flops,
    ),
    # The baselines' linear-time ops (issue 17): linear attention's kernels (their CUDA default once their GPU tests
    # pass) and DeltaNet's (VLA's delta-rule kernels), against FLA's kernels of the same functions.
    "linear": Op(
        make_inputs=lambda B, T, H, D: make_inputs("linear", B, T, H, D),
        reference=_linear("torch"),
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "linear_triton": Impl(_linear("triton")),
            "fla_chunk_linear_attn": Impl(_fla_chunk_linear_attn, checked=False),
        },
        flops=causal_attention_flops,
        linear=True,
    ),
    "deltanet": Op(
        make_inputs=lambda B, T, H, D: make_inputs("deltanet", B, T, H, D),
        reference=_deltanet("torch"),
        impls={
            BASELINE: Impl(_sdpa, heads_first=True, checked=False),
            "deltanet_triton": Impl(_deltanet("triton")),
            "fla_chunk_delta_rule": Impl(_fla_deltanet, checked=False),
        },
        flops=causal_attention_flops,
        linear=True,
    ),
}


def describe(error: BaseException) -> str:
    """One line for a row: the exception's type and the first line of its message, cut to 300 characters."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _layout(t: torch.Tensor, impl: Impl) -> torch.Tensor:
    return t.transpose(1, 2).contiguous() if impl.heads_first else t


def _leaves(x: dict[str, torch.Tensor], impl: Impl, requires_grad: bool) -> dict[str, torch.Tensor]:
    """The shared inputs as fresh leaves of ``impl``'s own (so gradients never mix between implementations)."""
    return {name: _layout(t, impl).detach().requires_grad_(requires_grad) for name, t in x.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_cell(
    op: Op, x: dict[str, torch.Tensor], do: torch.Tensor, impls: dict[str, Impl], grads: dict[str, bool]
) -> dict[str, dict]:
    """``impls`` against ``op.reference`` run in float32 on the same (bf16) values; ``grads[name]``: check the
    gradients of implementation ``name`` too.

    Returns, per implementation, ``errors`` (relative RMS of ``o`` and of ``d<input>``, as far as the calls got),
    ``check_error`` (the exception of a failed call) and ``check_s`` (the wall time of the check: compilation and
    autotuning included).
    """
    with_grads = any(grads.values())
    ref_in = {name: t.to(torch.float32, copy=True).requires_grad_(with_grads) for name, t in x.items()}
    ref_o = op.reference(ref_in)
    expected = {"o": ref_o.detach()}
    if with_grads:
        ref_grads = torch.autograd.grad(ref_o, list(ref_in.values()), do.float())
        expected.update({f"d{name}": g for name, g in zip(ref_in, ref_grads)})
    del ref_in, ref_o
    results = {}
    for name, impl in impls.items():
        errors: dict[str, float] = {}
        start = time.perf_counter()
        try:
            _check_impl(impl, x, do, expected if grads[name] else {"o": expected["o"]}, errors)
        except Exception as error:  # a failing implementation is a result, not a crash
            check_error = describe(error)
        else:
            check_error = None
        results[name] = {"errors": errors or None, "check_error": check_error, "check_s": time.perf_counter() - start}
        _release(do.device)
    return results


def _check_impl(
    impl: Impl, x: dict[str, torch.Tensor], do: torch.Tensor, expected: dict[str, torch.Tensor], errors: dict
) -> None:
    """Put into ``errors`` the relative RMS error of ``impl``'s output, computed without autograd (so a backward
    that fails to build does not hide it), then, when ``expected`` has them, of its gradients (``d<input>``)."""
    with torch.no_grad():
        errors["o"] = rel_rms(impl.fn(_leaves(x, impl, False)), expected["o"])
    if len(expected) > 1:
        leaves = _leaves(x, impl, True)
        grads = torch.autograd.grad(impl.fn(leaves), list(leaves.values()), do)
        errors.update({f"d{name}": rel_rms(g, expected[f"d{name}"]) for name, g in zip(leaves, grads)})


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _step(impl: Impl, leaves: dict[str, torch.Tensor], do: torch.Tensor, mode: str) -> Callable[[], None]:
    if mode == "fwd":

        def step() -> None:
            with torch.no_grad():
                impl.fn(leaves)

    else:

        def step() -> None:
            impl.fn(leaves).backward(do)

    return step


MIN_REPS = 5  # do_bench's repetitions at least, whatever a call takes


def bench_budget(warmup: float, rep: float, call_ms: float) -> tuple[float, float]:
    """``do_bench``'s ``(warmup, rep)`` in ms for a step of ``call_ms``: it runs ``int(rep / its estimate)``
    repetitions, one when a call outlasts ``rep`` (a 150-220 ms PaTH step at 32k got one, so its "median" was one
    sample, 145 ms in one call and 212 in another); at least ``MIN_REPS`` (and a warm-up of two calls), with a
    tenth to spare for the estimate's spread."""
    return max(warmup, 2.2 * call_ms), max(rep, 1.1 * MIN_REPS * call_ms)


def cuda_call_ms(step: Callable[[], None]) -> float:
    """One call of ``step`` in milliseconds, by CUDA events (synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def bench_ms(
    step: Callable[[], None],
    grads: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    rep: int,
    call_ms: float | None = None,
) -> float:
    """Median milliseconds of ``step``: ``do_bench`` on CUDA (``warmup``/``rep`` in ms, stretched by
    :func:`bench_budget` for long steps; ``call_ms`` one call's time, measured here when not given), wall clock
    on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        warmup, rep = bench_budget(warmup, rep, cuda_call_ms(step) if call_ms is None else call_ms)
        return do_bench(step, warmup=warmup, rep=rep, grad_to_none=grads, return_mode="median")
    times = []
    for _ in range(3):
        for t in grads:
            t.grad = None
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_impl(
    impl: Impl, x: dict[str, torch.Tensor], do: torch.Tensor, mode: str, device: torch.device, args: argparse.Namespace
) -> tuple[float, str, int | None]:
    """``(ms, how, peak_bytes)`` of ``impl`` in ``mode``: one warm-up call (compilation), one timed call that
    also gives the peak memory above what was allocated before it (``None`` on CPU), then the median of
    ``bench_ms`` unless that call took over ``args.max_ms`` (``how`` is then ``"one call"``, else ``"do_bench"``).
    """
    leaves = _leaves(x, impl, mode == "fwdbwd")
    grads = list(leaves.values()) if mode == "fwdbwd" else []
    step = _step(impl, leaves, _layout(do, impl), mode)
    step()
    for t in grads:
        t.grad = None
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        once_ms = cuda_call_ms(step)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        begin = time.perf_counter()
        step()
        once_ms = 1e3 * (time.perf_counter() - begin)
    if once_ms > args.max_ms:
        return once_ms, "one call", peak
    return bench_ms(step, grads, device, args.warmup, args.rep, once_ms), "do_bench", peak


def run_cell(
    op_name: str,
    op: Op,
    impls: dict[str, Impl],
    T: int,
    D: int,
    args: argparse.Namespace,
    device: torch.device,
    slow: dict[tuple, str],
) -> list[dict]:
    """Check, then time, every implementation at one ``(T, D)``; one row per implementation and mode.

    ``slow`` maps ``(op, impl, D, mode)`` to why it is skipped at longer ``T`` (too slow for ``do_bench``, or
    failed other than by running out of memory); it is updated here.
    """
    H, B = WIDTH // D, max(1, args.tokens // T)
    torch.manual_seed(0)
    x = {name: t.to(device=device, dtype=torch.bfloat16) for name, t in op.make_inputs(B, T, H, D).items()}
    do = torch.randn_like(x["v"])
    # What failed or was too slow at a shorter T is not checked again: on the GPU that is minutes of compiling.
    checked = {n: impl for n, impl in impls.items() if impl.checked and (op_name, n, D, "fwd") not in slow}
    grads = {
        n: "fwdbwd" in args.modes and T <= args.grad_check_max_t and (op_name, n, D, "fwdbwd") not in slow
        for n in checked
    }
    try:
        checks = check_cell(op, x, do, checked, grads)
    except Exception as error:  # without a reference the timings still stand
        print(f"  reference failed: {describe(error)}")
        checks = {}
    for name, check in checks.items():
        shown = " ".join(f"{n} {e:.1e}" for n, e in (check["errors"] or {}).items())
        print(f"  check {op_name} T={T} D={D} {name}: {shown} {check['check_error'] or ''}", flush=True)

    rows = []
    for mode in args.modes:
        for name, impl in impls.items():
            check = checks.get(name, {})
            row = {
                "op": op_name, "impl": name, "T": T, "D": D, "B": B, "H": H, "mode": mode,
                "ms": None, "tflops": None, "ratio_to_sdpa": None, "peak_mem_bytes": None, "mem_ratio_to_sdpa": None,
                "timing": None, "error": None, "errors": check.get("errors"), "check_error": check.get("check_error"),
                "check_s": check.get("check_s"),
            }  # fmt: skip
            rows.append(row)
            key = (op_name, name, D, mode)
            if key in slow:
                row["error"] = f"skipped: {slow[key]}"
                continue
            try:
                ms, how, peak = time_impl(impl, x, do, mode, device, args)
            except Exception as error:  # out of memory, compile failure: record it and go on
                row["error"] = describe(error)
                if not isinstance(error, torch.OutOfMemoryError):
                    slow[key] = f"failed at T={T}"
            else:
                flops = op.flops(B, T, H, D) * FLOP_FACTOR[mode]
                row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12, peak_mem_bytes=peak, timing=how)
                row["tokens_per_s"] = B * T / (ms * 1e-3)
                if how == "one call":
                    slow[key] = f"one call took {ms:.0f} ms at T={T} (over --max-ms {args.max_ms:g})"
            _release(device)
            shown = f"{row['ms']:.3f} ms ({row['timing']})" if row["ms"] is not None else row["error"]
            print(f"  time  {op_name} T={T} D={D} {mode:6s} {name}: {shown}", flush=True)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """Fill ``ratio_to_sdpa`` (time) and ``mem_ratio_to_sdpa`` from the SDPA row of the same cell and mode."""
    base = {(r["op"], r["T"], r["D"], r["mode"]): r for r in rows if r["impl"] == BASELINE}
    for r in rows:
        b = base.get((r["op"], r["T"], r["D"], r["mode"]))
        if b is None:
            continue
        if r["ms"] is not None and b["ms"]:
            r["ratio_to_sdpa"] = r["ms"] / b["ms"]
        if r["peak_mem_bytes"] is not None and b["peak_mem_bytes"]:
            r["mem_ratio_to_sdpa"] = r["peak_mem_bytes"] / b["peak_mem_bytes"]


def _git(*git_args: str) -> str | None:
    try:
        done = subprocess.run(["git", *git_args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def source_fingerprint() -> str:
    """SHA-1 of the ``.py`` files under ``attnkit/`` and ``benchmarks/`` (paths and contents, sorted): it names
    the code that ran where the tree was copied without its ``.git`` (compute it on a checkout to match)."""
    digest = hashlib.sha1()
    for path in sorted([*ROOT.glob("attnkit/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment(device: torch.device) -> dict[str, object]:
    """The machine and code a measurement came from."""
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    status = _git("status", "--porcelain")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "source_sha1": source_fingerprint(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["ms"] is None:
        return "skipped" if (row["error"] or "").startswith("skipped") else "error"
    ratio = f" {row['ratio_to_sdpa']:5.2f}x" if row["ratio_to_sdpa"] is not None else ""
    return f"{row['ms']:8.3f}{ratio}{'*' if row['timing'] == 'one call' else ''}"


def _mem_cell(row: dict | None) -> str:
    if row is None or row["peak_mem_bytes"] is None:
        return "-"
    ratio = f" {row['mem_ratio_to_sdpa']:5.2f}x" if row["mem_ratio_to_sdpa"] is not None else ""
    return f"{row['peak_mem_bytes'] / 2**20:8.0f}{ratio}"


def _check_cell(row: dict | None) -> str:
    if row is None or not (row["errors"] or row["check_error"]):
        return "-"
    errs = row["errors"] or {}
    grads = [e for n, e in errs.items() if n != "o"]
    shown = [f"{errs['o']:.1e}"] if "o" in errs else []
    if grads:
        shown.append(f"{max(grads):.1e}")
    ok = errs.get("o", math.inf) <= BARS["o"] and all(e <= BARS["grads"] for e in grads)
    return " ".join([*shown, "error" if row["check_error"] else "ok" if ok else "FAIL"])


def _table(title: str, rows: list[dict], impls: list[str], cell: Callable[[dict | None], str]) -> list[str]:
    by = {(r["T"], r["impl"]): r for r in rows}
    lines = [title, f"{'T':>6} " + " ".join(f"{i:>18}" for i in impls)]
    for T in sorted({r["T"] for r in rows}):
        lines.append(f"{T:>6} " + " ".join(f"{cell(by.get((T, i))):>18}" for i in impls))
    return lines


def crossovers(rows: list[dict]) -> list[str]:
    """For the linear ops: per (D, mode, implementation), the shortest measured ``T`` from which it is faster than
    SDPA at every longer measured ``T``, or its ratio at the longest one."""
    lines = []
    linear = [r for r in rows if REGISTRY.get(r["op"]) and REGISTRY[r["op"]].linear and r["impl"] != BASELINE]
    for key in sorted({(r["op"], r["D"], r["mode"], r["impl"]) for r in linear}):
        series = sorted(
            (r["T"], r["ratio_to_sdpa"])
            for r in linear
            if (r["op"], r["D"], r["mode"], r["impl"]) == key and r["ratio_to_sdpa"] is not None
        )
        if not series:
            continue
        faster = [T for i, (T, _) in enumerate(series) if all(ratio < 1 for _, ratio in series[i:])]
        op_name, D, mode, impl = key
        shown = (
            f"faster than SDPA from T={faster[0]}"
            if faster
            else f"slower than SDPA up to T={series[-1][0]} ({series[-1][1]:.2f}x there)"
        )
        lines.append(f"{op_name}/{impl} D={D} {mode}: {shown}")
    return lines


def format_tables(rows: list[dict]) -> str:
    """Per op and D: the check (relative RMS of ``o`` and the largest of the gradients), then per mode the
    milliseconds with the ratio to SDPA, then the peak memory of forward+backward; the linear ops' crossover
    lengths; the failures. ``*``: timed by one call. (Rows also hold ``tokens_per_s``.)"""
    lines: list[str] = []
    for op_name, D in sorted({(r["op"], r["D"]) for r in rows}):
        sub = [r for r in rows if r["op"] == op_name and r["D"] == D]
        impls = list(dict.fromkeys(r["impl"] for r in sub))
        H = sub[0]["H"]
        checked = [i for i in impls if any(r["errors"] or r["check_error"] for r in sub if r["impl"] == i)]
        if checked:
            first = [r for r in sub if r["mode"] == sub[0]["mode"]]
            title = f"{op_name} D={D} H={H} check: rel RMS o [max grads] (bars {BARS['o']:g} / {BARS['grads']:g})"
            lines += _table(title, first, checked, _check_cell) + [""]
        for mode in dict.fromkeys(r["mode"] for r in sub):
            mode_rows = [r for r in sub if r["mode"] == mode]
            lines += _table(f"{op_name} D={D} H={H} {mode}: ms, x SDPA", mode_rows, impls, _cell) + [""]
            if mode == "fwdbwd" and any(r["peak_mem_bytes"] is not None for r in mode_rows):
                title = f"{op_name} D={D} H={H} fwdbwd peak memory above inputs: MiB, x SDPA"
                lines += _table(title, mode_rows, impls, _mem_cell) + [""]
    lines += crossovers(rows)
    failures: dict[tuple, list[str]] = {}
    for r in rows:
        where = f"T={r['T']} D={r['D']}"
        if r["check_error"] and r["mode"] == rows[0]["mode"]:
            failures.setdefault((r["op"], r["impl"], "check", r["check_error"]), []).append(where)
        if r["error"] and not r["error"].startswith("skipped"):
            failures.setdefault((r["op"], r["impl"], r["mode"], r["error"]), []).append(where)
    for (op_name, impl, what, error), where in failures.items():
        lines.append(f"{op_name}/{impl} {what} failed at {', '.join(where)}: {error}")
    return "\n".join(lines).rstrip()


def plot(rows: list[dict], path: Path) -> None:
    """TFLOP/s against T: one panel per (op, D, mode), one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["op"], r["D"], r["H"], r["mode"]) for r in rows))
    # one colour per implementation in every panel, also where one of them has no point
    colours = {impl: f"C{i}" for i, impl in enumerate(dict.fromkeys(r["impl"] for r in rows))}
    lengths = sorted({r["T"] for r in rows})
    cols = len(MODES)
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    for ax, (op_name, D, H, mode) in zip(axes.flat, panels):
        sub = [r for r in rows if (r["op"], r["D"], r["mode"]) == (op_name, D, mode) and r["tflops"] is not None]
        for impl in dict.fromkeys(r["impl"] for r in sub):
            points = sorted((r["T"], r["tflops"]) for r in sub if r["impl"] == impl)
            ax.plot(*zip(*points), marker="o", label=impl, color=colours[impl])
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{T // 1024}k" if T >= 1024 else str(T) for T in lengths])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{op_name} D={D} H={H} {mode}")
        ax.set_xlabel("T (B = tokens / T)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        if sub:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` fills the lengths, warm-up and repetitions left unset."""
    impl_names = list(dict.fromkeys(name for op in REGISTRY.values() for name in op.impls))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", choices=list(REGISTRY), default=list(REGISTRY), help="ops to benchmark")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=None, help=f"lengths T (default {SEQ_LENS})")
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(HEAD_DIMS), help="head dims D (H = 1024 // D)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="fwd and/or fwdbwd")
    parser.add_argument("--impls", nargs="+", choices=impl_names, default=None, help="implementations (default all)")
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_SEQ_LENS}, shorter warm-up and repetitions")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens per batch, B = max(1, tokens // T)")
    parser.add_argument("--warmup", type=int, default=None, help="do_bench warm-up in ms (25; --quick 10)")
    parser.add_argument("--rep", type=int, default=None, help="do_bench repetition time in ms (100; --quick 40)")
    parser.add_argument(
        "--max-ms", type=float, default=1000.0, help="an implementation slower than this per call is timed once"
    )
    parser.add_argument(
        "--grad-check-max-t", type=int, default=2048, help="check gradients at T up to this (outputs at every T)"
    )
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the harness on tiny shapes (smoke test)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for NAME.json, NAME.png")
    parser.add_argument("--name", default="ops", help="file stem of the outputs, e.g. ops_tapa_h200")
    parser.add_argument(
        "--replot", metavar="JSON", help="measure nothing: the table and TFLOP/s plot of a run's JSON (one cut short)"
    )
    args = parser.parse_args(argv)
    if args.seq_lens is None:
        args.seq_lens = list(QUICK_SEQ_LENS if args.quick else SEQ_LENS)
    if args.warmup is None:
        args.warmup = 10 if args.quick else 25
    if args.rep is None:
        args.rep = 40 if args.quick else 100
    for T in args.seq_lens:
        if T <= 0 or (T < args.tokens and args.tokens % T) or (T > args.tokens and T % args.tokens):
            parser.error(f"--seq-lens: {T} and --tokens {args.tokens} must divide one another (B=1 beyond it)")
    for D in args.head_dims:
        if D <= 0 or WIDTH % D:
            parser.error(f"--head-dims: {D} does not divide H·D = {WIDTH}")
    return args


def replot(path: Path) -> int:
    """The table and the plot (``path`` with ``.png``) of a JSON written by an earlier run."""
    payload = json.loads(path.read_text())
    rows, env = payload["rows"], payload["environment"]
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")
    print(f"\n{env['device']}, bf16, causal, {payload['settings']['tokens']} tokens per batch")
    print(format_tables(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/ops.py needs a CUDA device (or --device cpu for a smoke run); none is available here.")
        return 2
    # FlexAttention compiles once per shape and grad mode; past the default limit of 8 Dynamo would quietly fall
    # back to eager FlexAttention, which materialises the T×T scores.
    torch._dynamo.config.recompile_limit = 64
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}", flush=True)
    started = time.perf_counter()
    rows: list[dict] = []
    slow: dict[tuple, str] = {}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "name")}
    out = Path(args.out)
    for op_name in args.ops:
        op = REGISTRY[op_name]
        impls = {n: impl for n, impl in op.impls.items() if args.impls is None or n in args.impls}
        for D in args.head_dims:
            for T in sorted(args.seq_lens):
                print(f"{op_name} T={T} D={D}", flush=True)
                rows += run_cell(op_name, op, impls, T, D, args, device, slow)
                # after every cell, so that a run stopped by a time limit still leaves what it measured
                settings["wall_s"] = time.perf_counter() - started
                payload = {"environment": env, "settings": settings, "bars": BARS, "rows": rows}
                write_json(str(out / f"{args.name}.json"), payload)
    try:
        plot(rows, out / f"{args.name}.png")
        print(f"wrote {out / f'{args.name}.png'}")
    except Exception as error:  # the JSON holds the numbers; a plotting failure must not hide them
        print(f"plot failed: {describe(error)}")
    print(f"\n{env['device']}, bf16, causal, {args.tokens} tokens per batch, {settings['wall_s']:.0f} s")
    print(format_tables(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
