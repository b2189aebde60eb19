"""benchmarks/tile_probe.py on the CPU: every launch of its forward and backward loops under the interpreter, held to
the float32 reference (the script's own check, which the GPU run repeats before it times)."""

import pytest
import torch

from attnkit.ops.common.triton_utils import interpreting
from benchmarks import tile_probe


@pytest.mark.skipif(torch.cuda.is_available() or not interpreting(), reason="the interpreter's smoke run")
def test_every_launch_matches_the_reference():
    result = tile_probe.main(["--device", "cpu"])
    labels = [tile_probe.fwd_label(*row) for row in tile_probe.FWD] + [tile_probe.bwd_label(*r) for r in tile_probe.BWD]
    labels += [tile_probe.dq_label(*row) for row in tile_probe.DQ]
    assert sorted(result["errors"]) == sorted(labels)
    assert all(error < 2e-3 for error in result["errors"].values()), result["errors"]


def test_reference_gradients_are_autograds():
    """The reference's log-sum-exp and Δ are those of its own softmax: a backward from them reproduces its ``dk``."""
    x = tile_probe.inputs(1, 8, 2, 4, "cpu", torch.float32)
    ref = tile_probe.reference(x, 0.5)
    q, k, v, do = (x[n].transpose(1, 2) for n in ("q", "k", "v", "do"))
    p = torch.exp(q @ k.transpose(-1, -2) * 0.5 - ref["lse"].transpose(1, 2)[..., None])
    ds = p * (do @ v.transpose(-1, -2) - ref["delta"].transpose(1, 2)[..., None])
    torch.testing.assert_close((ds.transpose(-1, -2) @ q * 0.5).transpose(1, 2), ref["dk"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "argv, message",
    [(["--seq-len", "100"], "--seq-len"), (["--head-dim", "48"], "--head-dim"), (["--heads", "0"], "--heads")],
)
def test_shapes_the_unmasked_kernels_cannot_take_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        tile_probe.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
