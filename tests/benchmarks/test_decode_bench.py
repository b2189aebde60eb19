"""``benchmarks/decode.py``: every timed step runs (CPU, kernels under the interpreter) and the PaTH steps agree."""

from __future__ import annotations

import torch

from benchmarks import decode
from tests.helpers import assert_close


def test_steps_run_and_agree():
    # float16: the interpreter's bfloat16 tl.dot is wrong (the GPU runs bfloat16).
    fns = decode.steps(B=1, L=20, H=2, D=16, device=torch.device("cpu"), dt=torch.float16)
    assert set(fns) == {"sdpa", "path_fused", "path_torch", "path_copy", "tapa_triton"}
    o_torch = fns["path_torch"]()[0]
    o_copy = fns["path_copy"]()[0]  # the caches as given, copied; path_fused carries its own copy in place
    o_fused = fns["path_fused"]()
    assert_close("o", o_fused.float(), o_torch.float(), 5e-3)  # half caches, carried in different precisions
    assert_close("o", o_copy.float(), o_fused.float(), 1e-3)
    assert fns["tapa_triton"]().shape == (1, 1, 2, 16)
