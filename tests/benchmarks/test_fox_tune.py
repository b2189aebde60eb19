"""benchmarks/fox_tune.py off the GPU: its table and its refusal without CUDA (the timing needs a GPU)."""

import math

import pytest
import torch

from benchmarks import fox_tune


def test_table_sorts_each_kind_fastest_first_and_failed_rows_last():
    cell = dict(D=64, T=8192, B=4, H=16, sdpa_fwd=1.0, sdpa_fwdbwd=4.0)
    cell["fwd"] = [
        dict(config=(128, 64, 8, 2), default=True, ms=1.6, ratio=1.6, err=0.0),
        dict(config=(64, 64, 4, 3), default=False, ms=math.nan),  # did not fit
        dict(config=(128, 64, 8, 3), default=False, ms=1.2, ratio=1.2, err=1e-4),
    ]
    cell["bwd"] = [dict(config={"dkdv": (32, 128, 8, 2)}, default=True, ms=3.0, ratio=1.05, err=0.0)]
    lines = fox_tune.table([cell]).splitlines()
    assert lines[0].startswith("D=64 T=8192 (B=4, H=16)")
    assert "(128, 64, 8, 3): 1.200 ms, 1.20x SDPA" in lines[1]
    assert "(128, 64, 8, 2) (default): 1.600 ms" in lines[2]
    assert "(64, 64, 4, 3): nan ms" in lines[3]
    assert "fwd+bwd 1.05x SDPA" in lines[4]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda(capsys):
    with pytest.raises(SystemExit):
        fox_tune.main(["--seq-lens", "64"])
    assert "CUDA GPU" in capsys.readouterr().err


def test_output_and_grads_takes_fresh_leaves_each_call():
    """Two calls on the same float32 inputs give the same gradients: they do not sum onto the inputs' ``.grad``."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 12, 2, 8, generator=gen) for _ in range(4))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 12, 2, generator=gen))
    first = fox_tune.output_and_grads("torch", torch.float32, [q, k, v, g, do])
    second = fox_tune.output_and_grads("torch", torch.float32, [q, k, v, g, do])
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(x.grad is None for x in (q, k, v, g))
    assert [t.shape for t in first] == [v.shape, q.shape, k.shape, v.shape, g.shape]
