"""The delta rule's backward with ``delta_bwd.LOCAL_DU`` on and off, each run twice, on the inputs of
``tests/ops/test_vla_triton.py::test_state_pass_local_du`` (dense in DeltaNet's form, packed in the generic form; with
and without the state passes' prefetch): run-to-run differences of one form point at a race, differences between the
forms alone at the two computing the same terms apart. Prints the largest relative difference of every output and
gradient.

    python benchmarks/delta_local_du_probe.py

On CPU (Triton's interpreter, exact dots) every difference is zero, and the test holds the two forms bit-equal
there. On a GPU the forms are different compiled kernels: on an H100 (torch 2.11, Triton 3.6, thirty-sixth session)
each form repeated bit for bit, and the dense prefetched case's forms differed by a few float32 ulps (dk, dv, da, dS0
up to 4.0e-7 relative; o, S, dq equal); the test holds a form's repeats bit-equal there and the forms within 2e-6.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
# first even where it is already on the path further down: an installed wheel's top-level ``tests`` package shadowed
# ours on the GPU machine (``No module named 'tests.ops'``)
sys.path.insert(0, str(ROOT))

from attnkit.ops.common.delta_parallel import delta_rule_triton  # noqa: E402
from attnkit.ops.common.triton import delta_bwd, delta_fwd  # noqa: E402
from benchmarks.kernel_profile import applied  # noqa: E402
from tests.ops.test_vla_triton import DEVICE, bthd, delta_inputs, grads_of  # noqa: E402

NAMES = ("o", "S", "dq", "dk", "dv", "da", "dS0")


def local_du_case(packed: bool):
    """``(inputs, state, run)`` of ``test_state_pass_local_du``: dense in DeltaNet's form (``a = β k`` from ``beta``
    near 2, queries scaled; an odd length, a partial last chunk, an initial state) or packed (generic ``a``; empty
    sequences first and between, partial chunks, two value blocks), for :func:`tests.ops.test_vla_triton.grads_of`."""
    offsets = [0, 0, 7, 40, 40, 75] if packed else None
    B, H, T, K, V = (1, 2, 75, 16, 80) if packed else (2, 2, 53, 16, 32)
    inputs = delta_inputs(B, H, T, K, V)
    if not packed:  # the fourth input is beta [B, H, T, 1]
        inputs[3] = 1.9 + 0.1 * torch.rand(B, H, T, 1, device=DEVICE)
    state = [torch.randn(len(offsets) - 1 if packed else B, H, V, K, device=DEVICE)]
    cu = torch.tensor(offsets, device=DEVICE) if packed else None

    def run(q, k, v, a, st):
        q, k, v, a = bthd(q, k, v, a)
        if packed:
            o, S = delta_rule_triton(q, k, v, a, st[0], False, cu)
        else:
            o, S = delta_rule_triton(q, k, v, None, st[0], False, None, beta=a[..., 0], scale=0.25)
        return o.transpose(1, 2), (S,)

    return inputs, state, run


def probe(packed: bool, prefetch: bool) -> list[dict]:
    """One case's rows: per output, the two forms' repeat differences and their difference from each other."""
    torch.manual_seed(0)
    inputs, state, run = local_du_case(packed)
    passes = [f"{delta_fwd.__name__}.STATE_PREFETCH={True if prefetch else 'forward'!r}",
              f"{delta_fwd.__name__}.STATE_BV={16 if packed else None}"]  # fmt: skip
    runs = {}
    for local in (False, True):
        with applied([*passes, f"{delta_bwd.__name__}.LOCAL_DU={local}"]):
            runs[local] = [grads_of(run, inputs, state) for _ in range(2)]

    def rel(x, y):
        return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()

    return [
        dict(packed=packed, prefetch=prefetch, name=name,
             repeat_off=rel(runs[False][1][i], runs[False][0][i]), repeat_on=rel(runs[True][1][i], runs[True][0][i]),
             on_vs_off=rel(runs[True][0][i], runs[False][0][i]))
        for i, name in enumerate(NAMES)
    ]  # fmt: skip


def main() -> list[dict]:
    rows = [row for packed in (False, True) for prefetch in (False, True) for row in probe(packed, prefetch)]
    print(f"{'packed':>6} {'prefetch':>8} {'out':>4} {'repeat off':>10} {'repeat on':>10} {'on vs off':>10}")
    for r in rows:
        diffs = " ".join(f"{r[key]:>10.1e}" for key in ("repeat_off", "repeat_on", "on_vs_off"))
        print(f"{r['packed']!s:>6} {r['prefetch']!s:>8} {r['name']:>4} {diffs}")
    return rows


if __name__ == "__main__":
    main()
