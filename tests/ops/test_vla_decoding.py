"""VLA decoding: token-by-token ``vla_decode_step`` against ``vla_attention`` over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.vla import vla_attention, vla_decode_step
from tests.helpers import assert_close, tol_for
from tests.ops.test_vla import leaf_copy, make_inputs
from tests.ops.test_vla import make_state as make_any_state


def make_state(N, H, K, V, lam0):
    """A reachable state with ``A`` exactly symmetric, as ``vla_attention`` and the steps hand it on
    (``vla_attention`` reads the symmetric part of ``A``; the step takes ``A`` as given)."""
    S, A, n = make_any_state(N, H, K, V, lam0)
    return S, 0.5 * (A + A.mT), n


def run_steps(q, k, v, u, state, **kwargs):
    outputs = []
    for t in range(q.shape[1]):
        o, state = vla_decode_step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], u[:, t : t + 1], state, **kwargs)
        outputs.append(o)
    return torch.cat(outputs, 1), state


CASES = [(2, 1, 2, 16, 8), (2, 70, 2, 16, 8), (1, 130, 4, 8, 12)]


@pytest.mark.parametrize("normalize_output", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("with_state", [False, True], ids=["empty", "state"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B, T, H, K, V", CASES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in CASES])
def test_steps_match_chunked(B, T, H, K, V, dtype, with_state, normalize_output):
    lam0 = 0.3
    inputs = tuple(x.to(dtype) for x in make_inputs(B, T, H, K, V))
    state = tuple(x.to(dtype) for x in make_state(B, H, K, V, lam0)) if with_state else None
    kwargs = dict(lam0=lam0, eps=1e-4, normalize_output=normalize_output)
    o_ref, final_ref = vla_attention(*inputs, **kwargs, initial_state=state, output_final_state=True)
    o, final = run_steps(*inputs, state, **kwargs)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert o.dtype == dtype and all(s.dtype == dtype for s in final)
    assert_close("o", o, o_ref, tol)
    for name, x, x_ref in zip(("S", "A", "n"), final, final_ref, strict=True):
        assert_close(name, x, x_ref, tol)
    assert torch.equal(final[1], final[1].mT), "A: the step must keep it exactly symmetric"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_unnormalized_write_steps_match_chunked(dtype):
    """``normalize_write=False`` means the same recurrence in the step as in the chunked op."""
    inputs = tuple(x.to(dtype) for x in make_inputs(2, 70, 2, 16, 8))
    state = tuple(x.to(dtype) for x in make_state(2, 2, 16, 8, 0.3))
    kwargs = dict(lam0=0.3, eps=1e-4, normalize_write=False)
    o_ref, final_ref = vla_attention(*inputs, **kwargs, initial_state=state, output_final_state=True)
    o, final = run_steps(*inputs, state, **kwargs)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert_close("o", o, o_ref, tol)
    for name, x, x_ref in zip(("S", "A", "n"), final, final_ref, strict=True):
        assert_close(name, x, x_ref, tol)


def test_continues_a_prefill():
    """Prefill with ``vla_attention``, then steps: equal to one pass over everything."""
    B, T, P, H, K, V = 2, 80, 67, 2, 16, 8
    inputs = make_inputs(B, T, H, K, V)
    o_ref, final_ref = vla_attention(*inputs, output_final_state=True)
    o_pre, state = vla_attention(*(x[:, :P] for x in inputs), output_final_state=True)
    o_dec, final = run_steps(*(x[:, P:] for x in inputs), state)
    assert_close("o", torch.cat([o_pre, o_dec], 1), o_ref, tol_for(torch.float64))
    for name, x, x_ref in zip(("S", "A", "n"), final, final_ref, strict=True):
        assert_close(name, x, x_ref, tol_for(torch.float64))


def test_gradients_match_chunked():
    B, T, H, K, V = 1, 12, 2, 8, 8
    inputs, state = make_inputs(B, T, H, K, V), make_state(B, H, K, V, 0.1)
    grads = []
    for run in ("chunk", "steps"):
        xs, s0 = leaf_copy(inputs, torch.float64), leaf_copy(state, torch.float64)
        if run == "chunk":
            o, final = vla_attention(*xs, initial_state=s0, output_final_state=True)
        else:
            o, final = run_steps(*xs, s0)
        torch.manual_seed(1)  # one cotangent per output; randn_like would follow each output's strides
        loss = sum((x * torch.randn(x.shape, dtype=x.dtype)).sum() for x in (o, *final))
        loss.backward()
        grads.append([x.grad for x in xs + s0])
    # vla_attention differentiates through the symmetric part of A0, so only that part of dA0 is comparable.
    for grad in grads:
        grad[5] = 0.5 * (grad[5] + grad[5].mT)
    for name, g, g_ref in zip(("dq", "dk", "dv", "du", "dS0", "dA0", "dn0"), grads[1], grads[0], strict=True):
        assert_close(name, g, g_ref, 1e-9)


def test_validation():
    B, H, K, V = 2, 2, 8, 4
    q, k, v, u = make_inputs(B, 1, H, K, V)
    state = make_state(B, H, K, V, 0.1)
    with pytest.raises(ValueError, match="^q:"):
        vla_decode_step(*make_inputs(B, 2, H, K, V), state)
    with pytest.raises(ValueError, match="^u:"):
        vla_decode_step(q, k, v, u[..., :-1], state)
    with pytest.raises(ValueError, match="^lam0:"):
        vla_decode_step(q, k, v, u, None, lam0=0.0)
    with pytest.raises(ValueError, match="^eps:"):
        vla_decode_step(q, k, v, u, state, eps=-1.0)
    with pytest.raises(ValueError, match=r"^state\[1\]:"):
        vla_decode_step(q, k, v, u, (state[0], state[1][:1], state[2]))
    with pytest.raises(ValueError, match=r"^state\[0\]:"):
        vla_decode_step(q, k, v, u, (state[0].half(), state[1], state[2]))
    with pytest.raises(ValueError, match="^state:"):
        vla_decode_step(q, k, v, u, state[:2])
