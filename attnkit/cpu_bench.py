"""CPU timing and accuracy of the PyTorch backends: the table of ``python -m attnkit`` and
``benchmarks/cpu_ops.py``.

Every mechanism is timed against causal SDPA with RoPE at the same shape (the baseline its paper
improves on), forward and forward+backward, as the median of repeated runs.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .ops import delta_rule, linear_attention, path_attention, softmax_attention, tapa_attention, vla_attention
from .ops.baselines.rope import apply_rope, rope_cos_sin, rope_inv_freq
from .ops.common.utils import rel_rms

BASELINE = "sdpa+rope"
MECHANISMS = (BASELINE, "path", "path_fox", "tapa", "vla", "fox", "linear", "deltanet")


def make_inputs(
    name: str, B: int, T: int, H: int, D: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random inputs of the shape and value ranges the layers pass to mechanism ``name``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = {"q": randn(B, T, H, D), "k": randn(B, T, H, D), "v": randn(B, T, H, D)}
    if name in ("path", "path_fox"):
        x["w"] = F.normalize(randn(B, T, H, D), dim=-1)
        x["beta"] = 2 * torch.sigmoid(randn(B, T, H))
        if name == "path_fox":
            x["g"] = F.logsigmoid(randn(B, T, H) + 3)
    elif name == "fox":
        x["g"] = F.logsigmoid(randn(B, T, H) + 3)
    elif name in ("vla", "linear"):
        x["q"], x["k"] = F.elu(x["q"]) + 1, F.elu(x["k"]) + 1
        if name == "vla":
            x["u"] = F.normalize(randn(B, T, H, D), dim=-1) / D**0.5
    elif name == "deltanet":
        x["k"] = F.normalize(x["k"], dim=-1)
        x["beta"] = torch.sigmoid(randn(B, T, H))
    return x


def run(name: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output of mechanism ``name`` (``[B, T, H, D]``) through the PyTorch backend."""
    if name == BASELINE:
        T, D = x["q"].shape[1], x["q"].shape[-1]
        inv_freq, factor = rope_inv_freq(D)
        cos, sin = rope_cos_sin(torch.arange(T), inv_freq, factor, x["q"].dtype)
        q, k = apply_rope(x["q"], cos, sin), apply_rope(x["k"], cos, sin)
        return softmax_attention(q, k, x["v"])
    if name in ("path", "path_fox"):
        return path_attention(x["q"], x["k"], x["v"], x["w"], x["beta"], x.get("g"), backend="torch")
    if name == "tapa":
        return tapa_attention(x["q"], x["k"], x["v"], backend="torch")
    if name == "vla":
        return vla_attention(x["q"], x["k"], x["v"], x["u"], backend="torch")[0]
    if name == "fox":
        return softmax_attention(x["q"], x["k"], x["v"], x["g"])
    if name == "linear":
        return linear_attention(x["q"], x["k"], x["v"])[0]
    if name == "deltanet":
        return delta_rule(x["q"], x["k"], x["v"], x["beta"])[0]
    raise ValueError(f"name: expected one of {MECHANISMS}, got {name!r}")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def time_mechanism(name: str, B: int, T: int, H: int, D: int, repeats: int = 5) -> tuple[float, float]:
    """Median milliseconds of the forward and of forward+backward (all floating inputs need gradients)."""
    x = make_inputs(name, B, T, H, D)
    with torch.no_grad():
        fwd = median_ms(lambda: run(name, x), repeats)
    xg = {n: t.requires_grad_() for n, t in x.items()}
    do = torch.randn(B, T, H, D)

    def fwd_bwd() -> None:
        run(name, xg).backward(do)
        for t in xg.values():
            t.grad = None

    return fwd, median_ms(fwd_bwd, repeats)


def timing_rows(
    B: int, T: int, H: int, D: int, repeats: int = 5, names: tuple[str, ...] = MECHANISMS
) -> list[dict[str, float | str]]:
    """One row per mechanism with milliseconds and ratios to ``sdpa+rope`` (always timed, first)."""
    base_fwd, base_fb = time_mechanism(BASELINE, B, T, H, D, repeats)
    rows = []
    for name in names:
        fwd, fb = (base_fwd, base_fb) if name == BASELINE else time_mechanism(name, B, T, H, D, repeats)
        rows.append(
            {"name": name, "fwd_ms": fwd, "fwd_bwd_ms": fb, "fwd_ratio": fwd / base_fwd, "fwd_bwd_ratio": fb / base_fb}
        )
    return rows


def environment() -> dict[str, str | int]:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit}


def _reference(name: str, x: dict[str, torch.Tensor]) -> torch.Tensor:
    from .ops.path.naive import path_naive
    from .ops.tapa.naive import tapa_naive
    from .ops.vla.naive import vla_naive

    if name in ("path", "path_fox"):
        return path_naive(x["q"], x["k"], x["v"], x["w"], x["beta"], x.get("g"))
    if name == "tapa":
        return tapa_naive(x["q"], x["k"], x["v"], 0.5, 0.1)
    return vla_naive(x["q"], x["k"], x["v"], x["u"], 0.1, 1e-4, True, None, False)[0]


def accuracy_rows(T: int = 48, B: int = 1, H: int = 2, D: int = 16) -> list[dict[str, float | str]]:
    """Relative RMS error of the float32 PyTorch backend against the float64 definitional loops."""
    rows = []
    for name in ("path", "path_fox", "tapa", "vla"):
        x64 = make_inputs(name, B, T, H, D, dtype=torch.float64)
        ref = _reference(name, x64)
        out = run(name, {n: t.float() for n, t in x64.items()}).double()
        rows.append({"name": name, "rel_rms_fp32": rel_rms(out, ref)})
    return rows


def format_accuracy(rows: list[dict[str, float | str]]) -> str:
    lines = [f"{'mechanism':<10} {'rel. RMS error (fp32 vs fp64 loops)':>36}"]
    lines += [f"{r['name']:<10} {r['rel_rms_fp32']:>36.2e}" for r in rows]
    return "\n".join(lines)


def format_timing(rows: list[dict[str, float | str]], bars: dict[str, float] | None = None) -> str:
    """A table of milliseconds and ratios to SDPA+RoPE; with ``bars``, the fwd+bwd bar and pass/fail."""
    head = f"{'mechanism':<10} {'fwd ms':>9} {'fwd+bwd ms':>11} {'fwd ×':>7} {'fwd+bwd ×':>10}"
    lines = [head + (f" {'bar':>6} {'ok':>4}" if bars else "")]
    for r in rows:
        line = (
            f"{r['name']:<10} {r['fwd_ms']:>9.1f} {r['fwd_bwd_ms']:>11.1f} "
            f"{r['fwd_ratio']:>7.2f} {r['fwd_bwd_ratio']:>10.2f}"
        )
        if bars and r["name"] in bars:
            bar = bars[r["name"]]
            line += f" {bar:>6.1f} {'yes' if r['fwd_bwd_ratio'] <= bar else 'NO':>4}"
        lines.append(line)
    return "\n".join(lines)
