"""The segment scan kernel (``attnkit/ops/common/triton/scan.py``: the gates' prefix sums and their gradient's suffix
sums) against ``torch.cumsum`` per sequence, dense and packed, through the input's strides.

On CPU it runs through Triton's interpreter (``conftest.py``); small tiles make a sequence take several steps."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.common.triton import scan
from benchmarks.scan_tune import reference_sums

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("reverse", [False, True], ids=["prefix", "suffix"])
@pytest.mark.parametrize(
    "B, T, HQ, lengths",
    [(2, 37, 3, None), (1, 70, 8, [0, 5, 0, 33, 1, 31]), (3, 16, 1, None), (1, 9, 5, [9])],
    ids=["dense-odd", "packed-empty-segments", "dense-one-head", "packed-one"],
)
@pytest.mark.parametrize("tile", [None, 32], ids=["default-tile", "tile-32"])
def test_segment_cumsum(B, T, HQ, lengths, reverse, tile, monkeypatch):
    """Every token's sum within its own sequence (packed sequences restart, empty ones are skipped), the scale
    applied, read through a non-contiguous view; ``tile`` 32 makes the longer sequences take several steps."""
    if tile is not None:
        monkeypatch.setattr(scan, "TILE_ELEMENTS", tile)
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    assert cu is None or int(cu[-1]) == T
    torch.manual_seed(0)
    base = torch.randn(B, T, HQ + 2, device=DEVICE)
    x = base[..., 1 : HQ + 1]  # strided: the heads are not the innermost contiguous run
    assert not x.is_contiguous()
    config = scan.launch_config(T, HQ)
    if tile is not None:
        pow2 = 1 << (T - 1).bit_length()
        assert config["BT"] == max(16, min(pow2, tile // config["BH"])) and (config["BT"] < T or T <= 16)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        y = scan.segment_cumsum(x, cu, 0.75, reverse, dtype)
        assert y.dtype == dtype and y.shape == (B, T, HQ) and y.is_contiguous()
        want = 0.75 * reference_sums(x, cu, reverse)
        err = ((y.double() - want).abs() / want.abs().clamp_min(1.0)).max().item()
        assert err <= tol, (dtype, err)


def test_launch_config_buckets_the_length():
    """``BT`` grows with ``T`` in powers of two up to the tile's budget, ``BH`` stays within ``MAX_HEADS``."""
    small, long = scan.launch_config(5, 16), scan.launch_config(32768, 16)
    assert small["BT"] == 16 and long["BT"] == scan.TILE_ELEMENTS // scan.MAX_HEADS
    assert small["BH"] == long["BH"] == scan.MAX_HEADS and scan.launch_config(100, 1)["BH"] == 1
    assert scan.launch_config(1000, 3) == dict(BH=2, BT=1024, num_warps=scan.NUM_WARPS)
