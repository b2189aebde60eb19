"""The fused Triton VLA decode step against the PyTorch step (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.vla import vla_decode_step
from attnkit.ops.vla.parallel import vla_decode_op
from tests.helpers import assert_close
from tests.ops.test_vla import make_inputs
from tests.ops.test_vla_decoding import make_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def steps(backend, inputs, state, **kwargs):
    q, k, v, u = inputs
    outputs = []
    for t in range(q.shape[1]):
        sl = slice(t, t + 1)
        o, state = vla_decode_step(q[:, sl], k[:, sl], v[:, sl], u[:, sl], state, backend=backend, **kwargs)
        outputs.append(o)
    return torch.cat(outputs, 1), state


@pytest.mark.parametrize("normalize_write", [True, False], ids=["unit-write", "raw-write"])
@pytest.mark.parametrize("normalize_output", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("with_state", [False, True], ids=["empty", "state"])
@pytest.mark.parametrize("B, T, H, K, V", [(2, 5, 2, 16, 8), (1, 4, 3, 12, 20)], ids=str)
def test_matches_torch_step(B, T, H, K, V, with_state, normalize_output, normalize_write):
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, H, K, V)]
    state = tuple(x.float().to(DEVICE) for x in make_state(B, H, K, V, 0.3)) if with_state else None
    kwargs = dict(lam0=0.3, eps=1e-4, normalize_output=normalize_output, normalize_write=normalize_write)
    o, (S, A, n) = steps("triton", inputs, state, **kwargs)
    o_ref, (S_ref, A_ref, n_ref) = steps("torch", inputs, state, **kwargs)
    for name, x, y in zip("oSAn", (o, S, A, n), (o_ref, S_ref, A_ref, n_ref)):
        assert x.dtype == y.dtype, name
        assert_close(name, x, y, 1e-5)
    assert torch.equal(A, A.mT), "the update keeps A exactly symmetric"


def test_half_inputs():
    inputs = [x.float().to(DEVICE) for x in make_inputs(2, 3, 2, 16, 16)]
    inputs = [x.half() for x in inputs[:3]] + [inputs[3]]
    o, _ = steps("triton", inputs, None)
    o_ref, _ = steps("torch", inputs, None)
    assert o.dtype == torch.float16
    assert_close("o", o, o_ref, 5e-3)


def test_opcheck_and_auto_dispatch(monkeypatch):
    """``"auto"`` takes the kernel for CUDA tensors when no gradient is needed, PyTorch otherwise."""
    q, k, v, u = [x.float().to(DEVICE)[:, :1] for x in make_inputs(2, 1, 2, 16, 8)]
    S, A, n = (x.float().to(DEVICE) for x in make_state(2, 2, 16, 8, 0.3))
    torch.library.opcheck(vla_decode_op, (q, k, v, u, S, A, n, 1e-4, True))

    import attnkit.ops.vla.parallel as parallel

    calls = []
    monkeypatch.setattr(parallel, "vla_decode_op", lambda *a: calls.append(1) or vla_decode_op(*a))
    vla_decode_step(q, k, v, u, (S, A, n))
    assert len(calls) == (1 if DEVICE == "cuda" else 0)
    o, _ = vla_decode_step(q.requires_grad_(), k, v, u, (S, A, n))  # a gradient is needed: PyTorch
    assert len(calls) == (1 if DEVICE == "cuda" else 0) and o.requires_grad


def test_float64_refused():
    q, k, v, u = [x.to(DEVICE)[:, :1] for x in make_inputs(1, 1, 1, 8, 8)]
    with pytest.raises(ValueError, match="^backend"):
        vla_decode_step(q, k, v, u, backend="triton")
