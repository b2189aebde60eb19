"""State-norm probe (VLA paper): ``‖S_t‖_F`` of an untrained recurrent layer on random inputs, against ``t``.

    python -m attnkit probe-state [--lengths 1000 2000 5000 10000] [--plot probe.png] [--out probe.json]

One layer of each mixer (``VLAAttention``, with ``normalize_write=False`` as ``vla_unnormalized``,
``LinearAttention``, ``DeltaNetAttention``), freshly initialised with
the same seed, reads the first ``T`` of one random sequence of hidden states ``[1, T_max, hidden]`` (standard
normal) for each requested ``T``; the Frobenius norm of the cached ``S [H, V, K]`` is taken per head and averaged
over heads.

Linear attention only ever adds ``v kᵀ`` with positive features, so its norm grows like ``t``; VLA's penalised
write and DeltaNet's delta rule keep it bounded.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from attnkit.layers import DeltaNetAttention, LinearAttention, VLAAttention

from .output import write_json

LAYERS: dict[str, Callable[..., nn.Module]] = {
    "vla": VLAAttention,
    # the paper's ablation: VLA writing along the unnormalised A_t k̂_t (its state grows like d_h / lam0)
    "vla_unnormalized": functools.partial(VLAAttention, normalize_write=False),
    "linear": LinearAttention,
    "deltanet": DeltaNetAttention,
}
# TASKS.md: published ‖S‖_F at T = 1000 (VLA paper), printed beside ours; not a target to reproduce exactly
PUBLISHED_T1000 = {"linear": 1634.0, "vla": 14.5, "deltanet": 1.2}


@torch.no_grad()
def probe_state(
    mixers: Sequence[str] = ("vla", "linear", "deltanet"),
    lengths: Sequence[int] = (1000, 2000, 5000, 10000),
    hidden_size: int = 64,
    num_heads: int = 2,
    seed: int = 0,
) -> list[dict]:
    """``‖S_T‖_F`` (mean over heads) of an untrained layer of each mixer at each ``T`` in ``lengths``.

    Returns one row per (mixer, T): ``{"mixer", "T", "state_norm", "published_T1000"}`` (the last is the
    published value at T = 1000, or None).
    """
    unknown = [m for m in mixers if m not in LAYERS]
    if unknown:
        raise ValueError(f"mixers: unknown mixer {unknown[0]!r}; expected some of {tuple(LAYERS)}")
    lengths = sorted(set(int(t) for t in lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths: expected positive integers, got {lengths}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, lengths[-1], hidden_size, generator=gen)
    rows = []
    for mixer in mixers:
        torch.manual_seed(seed)
        layer = LAYERS[mixer](hidden_size, num_heads, backend="torch").eval()
        for T in lengths:
            # the layer's own prefill (chunked op) returns the state after T tokens in its cache
            _, state = layer(x[:, :T], use_cache=True)
            norm = state["S"].float().flatten(2).norm(dim=-1).mean().item()
            rows.append({"mixer": mixer, "T": T, "state_norm": norm, "published_T1000": PUBLISHED_T1000.get(mixer)})
    return rows


def format_rows(rows: list[dict]) -> str:
    """A table: one line per mixer, one column per T, then the published value at T = 1000."""
    lengths = sorted({r["T"] for r in rows})
    mixers = list(dict.fromkeys(r["mixer"] for r in rows))
    norms = {(r["mixer"], r["T"]): r["state_norm"] for r in rows}
    lines = [f"{'mixer':<10}" + "".join(f"{'T=' + str(T):>12}" for T in lengths) + f"{'paper T=1000':>14}"]
    for m in mixers:
        published = PUBLISHED_T1000.get(m)
        lines.append(
            f"{m:<10}"
            + "".join(f"{norms[(m, T)]:>12.4g}" for T in lengths)
            + (f"{published:>14.4g}" if published is not None else f"{'-':>14}")
        )
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: str) -> None:
    """``‖S_T‖_F`` against ``T`` per mixer, log-log, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for m in dict.fromkeys(r["mixer"] for r in rows):
        mine = [r for r in rows if r["mixer"] == m]
        ax.plot([r["T"] for r in mine], [r["state_norm"] for r in mine], marker="o", label=m)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="T (tokens)",
        ylabel="‖S_T‖_F (mean over heads)",
        title="State norm of an untrained layer",
    )
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mixers", nargs="+", default=list(LAYERS), choices=list(LAYERS), help="recurrent mixers to probe"
    )
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=[1000, 2000, 5000, 10000], help="sequence lengths T to record"
    )
    parser.add_argument("--hidden-size", type=int, default=64, help="width of the probed layer")
    parser.add_argument("--num-heads", type=int, default=2, help="heads of the probed layer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the layer's weights and of the inputs")
    parser.add_argument("--plot", default=None, help="write a PNG of the norms against T to this path")
    parser.add_argument("--out", default=None, help="write the rows as JSON to this path")


def run(args: argparse.Namespace) -> int:
    rows = probe_state(args.mixers, args.lengths, args.hidden_size, args.num_heads, args.seed)
    print(f"‖S_T‖_F of an untrained layer (hidden {args.hidden_size}, {args.num_heads} heads), random inputs:")
    print(format_rows(rows))
    if args.plot:
        plot_rows(rows, args.plot)
        print(f"wrote {args.plot}")
    if args.out:
        write_json(args.out, {"args": vars(args), "rows": rows})
    return 0
