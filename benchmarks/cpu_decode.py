"""Decoding speed on CPU: ``generate()`` with the cache against recomputing every step from scratch.

    python benchmarks/cpu_decode.py [--prompt 512] [--new 128] [--out benchmarks/results/cpu_decode.json]

For every mixer, a small model (by default 4 layers, width 256, 4 heads) generates ``--new`` greedy tokens after a
random ``--prompt``-token prompt, once with the cache and once with ``use_cache=False``; both must give the
same tokens. The bar of the models issue: the cache is at least 5× faster for every mixer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from attnkit.cpu_bench import environment
from attnkit.models import MIXERS, AttnKitConfig, AttnKitForCausalLM

BAR = 5.0


def time_generate(model: AttnKitForCausalLM, ids: torch.Tensor, new: int, use_cache: bool) -> tuple[float, object]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=use_cache, pad_token_id=0
        )
    return time.perf_counter() - start, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512, help="prompt length")
    parser.add_argument("--new", type=int, default=128, help="tokens to generate")
    parser.add_argument("--hidden", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="number of layers")
    parser.add_argument("--out", default=None, help="write the rows to this JSON file")
    args = parser.parse_args()

    torch.manual_seed(0)
    ids = torch.randint(1, 256, (1, args.prompt))
    rows = []
    print(f"prompt {args.prompt}, {args.new} new tokens, width {args.hidden}, {args.layers} layers, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'mixer':<10} {'cache s':>8} {'recompute s':>12} {'speed-up':>9} {'same tokens':>12}")
    for mixer in MIXERS:
        config = AttnKitConfig(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_heads=4,
                               mixer=mixer, backend="torch")
        model = AttnKitForCausalLM(config).eval()
        time_generate(model, ids[:, :16], 2, True)  # warm-up
        cached_s, cached = time_generate(model, ids, args.new, True)
        recompute_s, recomputed = time_generate(model, ids, args.new, False)
        row = {"mixer": mixer, "cache_s": cached_s, "recompute_s": recompute_s,
               "speedup": recompute_s / cached_s, "same_tokens": bool(torch.equal(cached, recomputed))}
        rows.append(row)
        same = str(row["same_tokens"])
        print(f"{mixer:<10} {cached_s:>8.2f} {recompute_s:>12.2f} {row['speedup']:>8.1f}× {same:>12}")
    missed = [r["mixer"] for r in rows if r["speedup"] < BAR or not r["same_tokens"]]
    print(f"bar: cache ≥ {BAR}× faster for every mixer -> {'met' if not missed else 'missed by ' + ', '.join(missed)}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "bar": BAR, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
