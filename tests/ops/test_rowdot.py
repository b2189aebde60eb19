"""The softmax backward's row term ``delta = rowsum(dO ⊙ O)`` (``ops/common/triton/rowdot.py``), shared by the
attention kernels' backwards: held to PyTorch in both layouts, for strided inputs and odd sizes."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.common.triton.rowdot import output_delta

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_output_delta(head_major, dtype):
    """``[B, T, HQ]`` or ``[HQ, B·T]`` float32 sums over ``V`` (not a power of two), with ``do`` a transposed view
    and ``T`` past one block."""
    B, T, HQ, V = 2, 70, 3, 24
    o = torch.randn(B, T, HQ, V, device=DEVICE).to(dtype)
    do = torch.randn(B, HQ, T, V, device=DEVICE).to(dtype).transpose(1, 2)
    assert not do.is_contiguous()
    expected = (o.float() * do.float()).sum(-1)
    if head_major:
        expected = expected.permute(2, 0, 1).reshape(HQ, B * T)
    actual = output_delta(o, do, head_major)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_output_delta_of_nothing():
    """No tokens: an empty result, and no launch."""
    o = torch.randn(1, 0, 2, 8, device=DEVICE)
    assert output_delta(o, o).shape == (1, 0, 2) and output_delta(o, o, True).shape == (2, 0)
