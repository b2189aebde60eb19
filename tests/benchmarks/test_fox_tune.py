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
