"""The model-level training step (forward, backward, AdamW step) per mixer: tokens/s and peak memory.

    python benchmarks/train_throughput.py [--mixers path path_fox tapa vla rope ...] [--seq-lens 4096 16384]
                                          [--tokens 16384] [--layers 4] [--hidden 1024] [--heads 16]
                                          [--vocab 32000] [--steps 5] [--warmup 2] [--backend auto] [--fla]
                                          [--out JSON] [--png PNG] [--device cuda] [--dtype bfloat16]
                                          [--profile N]

Per (T, mixer): a fresh ``AttnKitForCausalLM`` (``--layers`` layers of ``--hidden`` width, ``--heads`` heads,
``--vocab`` tokens) and AdamW (fused on CUDA), ``B = max(1, tokens // T)`` sequences of random token ids with
``labels = input_ids`` (the model shifts them), float32 weights under bf16 autocast (``--dtype float32``: none).
``--warmup`` untimed steps (compilation and autotuning), then the median of ``--steps`` timed steps (CUDA events
on GPU, ``time.perf_counter`` on CPU); peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps:
weights, gradients, optimizer state and activations together. ``x_rope`` is a row's tokens/s over RoPE's at the
same T. With ``--fla``, flash-linear-attention's own PaTH, PaTH-FoX, FoX and DeltaNet models of the same sizes
(their defaults otherwise: fused norms, SwiGLU and cross-entropy) are timed as anchors.
A failure (out of memory, not implemented, FLA missing) is recorded in its row and the run goes on.

Writes ``--out`` (rows, settings, environment) after every cell, so that a run cut short keeps what it measured,
and ``--png`` (tokens/s and peak memory, grouped by T), then prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
# Run as a script on a machine where attnkit is not installed (the GPU machine's bare copy of the tree).
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.models import MIXERS, AttnKitConfig, AttnKitForCausalLM  # noqa: E402
from benchmarks.kernel_profile import profile_kernels  # noqa: E402
from benchmarks.ops import describe, environment  # noqa: E402

SEQ_LENS = (4096, 16384)
TOKENS = 16384
BASELINE = "rope"
FLA_MODELS = ("fla_path", "fla_path_fox", "fla_fox", "fla_deltanet")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "train_throughput.json"


def attnkit_model(mixer: str, args: argparse.Namespace) -> nn.Module:
    config = AttnKitConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_heads=args.heads,
        mixer=mixer,
        backend=args.backend,
        use_cache=False,
    )
    return AttnKitForCausalLM(config)


def fla_model(name: str, args: argparse.Namespace) -> nn.Module:
    """flash-linear-attention's model ``name`` (one of ``FLA_MODELS``) at attnkit's sizes, the MLP width included
    (FLA would round ``8/3 · hidden`` up to 256, attnkit to 32)."""
    import fla.models

    sizes = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_heads": args.heads,
        "intermediate_size": AttnKitConfig(hidden_size=args.hidden, num_heads=args.heads).intermediate_size,
        "use_cache": False,
    }
    if name in ("fla_path", "fla_path_fox"):
        config = fla.models.PaTHAttentionConfig(**sizes, use_forget_gate=name == "fla_path_fox")
        return fla.models.PaTHAttentionForCausalLM(config)
    if name == "fla_fox":
        return fla.models.ForgettingTransformerForCausalLM(fla.models.ForgettingTransformerConfig(**sizes))
    if name == "fla_deltanet":
        return fla.models.DeltaNetForCausalLM(fla.models.DeltaNetConfig(**sizes))
    raise ValueError(f"fla_model: unknown model {name!r}; expected one of {FLA_MODELS}")


def build(name: str, args: argparse.Namespace) -> nn.Module:
    return fla_model(name, args) if name in FLA_MODELS else attnkit_model(name, args)


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, autocast: Callable
) -> torch.Tensor:
    """One forward, backward and optimizer step on ``input_ids [B, T]``; the loss, not synchronised."""
    with autocast():
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def time_steps(step: Callable[[], torch.Tensor], n: int, device: torch.device) -> tuple[list[float], torch.Tensor]:
    """The wall time of ``n`` calls of ``step`` in ms each, and the last call's result."""
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - start_s) * 1e3)
    return times, out


def measure(name: str, B: int, T: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Build model ``name``, warm it up and time its training step at ``[B, T]``; raises what the model raises."""
    model = build(name, args).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    input_ids = torch.randint(0, args.vocab, (B, T), device=device)
    bf16 = args.dtype == "bfloat16"
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else nullcontext

    def step() -> torch.Tensor:
        return train_step(model, optimizer, input_ids, autocast)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    step_ms, loss = time_steps(step, args.steps, device)
    ms = statistics.median(step_ms)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    kernels = step_kernels(step, device) if args.profile else None
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "ms": ms,
        "step_ms": step_ms,
        "tokens_per_s": B * T / (ms / 1e3),
        "peak_mem_bytes": peak,
        "loss": float(loss),
        **({} if kernels is None else {"kernels": kernels}),
    }


def step_kernels(step: Callable[[], torch.Tensor], device: torch.device, steps: int = 2) -> list[dict]:
    """``--profile``: the GPU kernels of a training step (:func:`benchmarks.kernel_profile.profile_kernels`, the mean
    of ``steps`` steps); none off CUDA. Their sum against the step's time shows what waits on the host."""
    return profile_kernels(step, steps) if device.type == "cuda" else []


def run_cell(name: str, B: int, T: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One row: ``name``'s measurement at ``[B, T]``, or the error that stopped it."""
    row = {"name": name, "source": "fla" if name in FLA_MODELS else "attnkit", "T": T, "B": B, "tokens": B * T}
    row.update({"params": None, "ms": None, "step_ms": None, "tokens_per_s": None, "peak_mem_bytes": None})
    row.update({"loss": None, "x_rope": None, "error": None})
    try:
        row.update(measure(name, B, T, args, device))
    except Exception as error:  # a failing model is a result, not a crash
        row["error"] = describe(error)
    # The traceback, and with it the frames that hold the model and optimizer, is gone once the except block has
    # ended; collect them before the next model is built.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_kernels(kernels: list[dict] | None, top: int) -> None:
    """The ``top`` largest kernels of a ``--profile`` row, under their total."""
    if not kernels:
        return
    print(f"  {sum(k['us'] for k in kernels) / 1e3:.2f} ms of GPU kernels a step, {len(kernels)} distinct:")
    for k in kernels[:top]:
        print(f"    {k['us']:9.1f} us {k['calls']:5.0f}x  {k['kernel']}")


def add_ratios(rows: list[dict]) -> None:
    """``x_rope``: each row's tokens/s over RoPE's at the same T (where RoPE ran)."""
    base = {r["T"]: r["tokens_per_s"] for r in rows if r["name"] == BASELINE and r["tokens_per_s"]}
    for r in rows:
        if r["tokens_per_s"] is not None and r["T"] in base:
            r["x_rope"] = r["tokens_per_s"] / base[r["T"]]


def format_table(rows: list[dict]) -> str:
    """One block per T: tokens/s, the ratio to RoPE, step time and peak memory of every model; errors last."""
    lines = []
    for T in sorted({r["T"] for r in rows}):
        at_T = [r for r in rows if r["T"] == T]
        lines += [
            f"T={T} B={at_T[0]['B']}",
            f"  {'model':<14} {'tokens/s':>10} {'x rope':>7} {'step ms':>9} {'peak MiB':>9}",
        ]
        for r in at_T:
            if r["error"] is not None:
                lines.append(f"  {r['name']:<14} {'error':>10}")
                continue
            ratio = "-" if r["x_rope"] is None else f"{r['x_rope']:.2f}x"
            peak = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
            lines.append(f"  {r['name']:<14} {r['tokens_per_s']:>10.0f} {ratio:>7} {r['ms']:>9.1f} {peak:>9}")
    lines += [f"{r['name']} failed at T={r['T']}: {r['error']}" for r in rows if r["error"] is not None]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Bars of tokens/s (and peak memory where measured), one group per T, one bar per model (FLA's hatched)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["name"] for r in rows))
    lengths = sorted({r["T"] for r in rows})
    by = {(r["name"], r["T"]): r for r in rows}
    panels = [("tokens_per_s", "tokens/s", 1.0)]
    if any(r["peak_mem_bytes"] for r in rows):
        panels.append(("peak_mem_bytes", "peak memory (GiB)", 2.0**-30))
    width = 0.8 / len(names)
    colours = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    panel_width = max(5.0, 0.35 * len(names) * len(lengths) + 1.5)
    figsize = (panel_width * len(panels) + 1.5, 4.5)
    fig, axes = plt.subplots(1, len(panels), figsize=figsize, squeeze=False, layout="constrained")
    for ax, (key, label, scale) in zip(axes.flat, panels):
        for i, name in enumerate(names):
            cells = [by.get((name, T)) for T in lengths]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(lengths))]
            values = [0.0 if c is None or c[key] is None else c[key] * scale for c in cells]
            hatch = "//" if name in FLA_MODELS else None
            ax.bar(xs, values, width, label=name, color=colours(i % colours.N), hatch=hatch, edgecolor="white")
            for x, c in zip(xs, cells):
                if c is not None and c["error"] is not None:
                    ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"T={T}" for T in lengths])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside right upper", fontsize=7)
    fig.suptitle(f"training step (fwd+bwd+AdamW), {rows[0]['tokens']} tokens a step" if rows else "training step")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixers", nargs="+", choices=MIXERS, default=list(MIXERS), help="attnkit mixers to time")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=list(SEQ_LENS), help="lengths T")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens a step, B = max(1, tokens // T)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported; at least 5 advised)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, autotuning)")
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto", help="attnkit ops' backend")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="bf16 autocast or none")
    parser.add_argument("--fla", action="store_true", help=f"also time FLA's models: {' '.join(FLA_MODELS)}")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run on tiny sizes")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="JSON path")
    parser.add_argument("--png", default=None, help="bar chart path (default: --out with .png)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="after timing, profile a step's GPU kernels (CUDA): kept in the JSON, the N largest printed",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("tokens", "layers", "hidden", "heads", "vocab", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    if args.warmup < 0 or args.profile < 0:
        bad = "--warmup" if args.warmup < 0 else "--profile"
        parser.error(f"{bad}: expected a non-negative integer, got {getattr(args, bad[2:])}")
    if args.hidden % args.heads:
        parser.error(f"--heads: {args.heads} does not divide --hidden {args.hidden}")
    for T in args.seq_lens:
        if T <= 0 or (T < args.tokens and args.tokens % T) or (T > args.tokens and T % args.tokens):
            parser.error(f"--seq-lens: {T} and --tokens {args.tokens} must divide one another (B=1 beyond it)")
    if args.png is None:
        args.png = str(Path(args.out).with_suffix(".png"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/train_throughput.py needs a CUDA device (or --device cpu); none is available here.")
        return 2
    env = environment(device)
    env.update({"transformers": _version("transformers"), "fla": _version("flash-linear-attention")})
    env["command"] = shlex.join(["python", "benchmarks/train_throughput.py", *argv])
    print(f"{env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}", flush=True)
    if args.steps < 5:
        print(f"--steps {args.steps}: fewer than 5 timed steps, the median is noisy", flush=True)
    names = [*args.mixers, *(FLA_MODELS if args.fla else ())]
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "png")}
    started = time.perf_counter()
    rows: list[dict] = []
    for T in sorted(args.seq_lens):
        B = max(1, args.tokens // T)
        for name in names:
            print(f"T={T} B={B} {name} ...", flush=True)
            row = run_cell(name, B, T, args, device)
            rows.append(row)
            if row["error"] is None:
                peak = "" if row["peak_mem_bytes"] is None else f", peak {row['peak_mem_bytes'] / 2**30:.2f} GiB"
                print(f"  {row['tokens_per_s']:.0f} tokens/s, {row['ms']:.1f} ms a step{peak}", flush=True)
                print_kernels(row.get("kernels"), args.profile)
            else:
                print(f"  {row['error']}", flush=True)
            add_ratios(rows)
            # after every cell, so that a run stopped by a time limit still leaves what it measured
            settings["wall_s"] = time.perf_counter() - started
            write_json(args.out, {"environment": env, "settings": settings, "rows": rows})
    try:
        plot(rows, Path(args.png))
        print(f"wrote {args.png}")
    except Exception as error:  # the JSON holds the numbers; a plotting failure must not hide them
        print(f"plot failed: {describe(error)}")
    precision = "bf16 autocast" if args.dtype == "bfloat16" else "float32"
    print(
        f"\n{env['device']}, {precision}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"vocab {args.vocab}, {args.tokens} tokens a step, {settings['wall_s']:.0f} s"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
