"""Linear attention and DeltaNet: the chunked PyTorch implementations against their loops, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.baselines.delta_rule import delta_rule, delta_rule_chunk
from attnkit.ops.baselines.linear import linear_attention, linear_attention_chunk
from attnkit.ops.baselines.naive import delta_rule_naive, linear_attention_naive
from tests.helpers import assert_close, tol_for


def leaf_copy(xs, dtype):
    return tuple(x.detach().to(dtype).requires_grad_() for x in xs)


def features(*shape):
    return F.elu(torch.randn(*shape, dtype=torch.float64)) + 1


def compare(run, run_ref, inputs, state, dtype, names):
    """Output, final state and gradients of every input of ``run`` in ``dtype`` vs ``run_ref`` in float64."""
    ref_in, ref_state = leaf_copy(inputs, torch.float64), leaf_copy(state, torch.float64)
    tst_in, tst_state = leaf_copy(inputs, dtype), leaf_copy(state, dtype)
    o_ref, final_ref = run_ref(*ref_in, ref_state or None)
    o, final = run(*tst_in, tst_state or None)
    tol = tol_for(dtype)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, tol)
    for i, (x, x_ref) in enumerate(zip(final, final_ref, strict=True)):
        assert x.dtype == dtype
        assert_close(f"state[{i}]", x, x_ref, tol)
    cotangents = [torch.randn_like(x) for x in (o_ref, *final_ref)]
    for outs in ((o_ref, *final_ref), (o, *final)):
        sum((x * g.to(x.dtype)).sum() for x, g in zip(outs, cotangents, strict=True)).backward()
    for name, x, x_ref in zip(names, tst_in + tst_state, ref_in + ref_state, strict=False):
        assert_close(name, x.grad, x_ref.grad, tol)


SHAPES = [
    (2, 1, 2, 2, 16, 32),
    (2, 2, 4, 2, 16, 32),
    (2, 63, 4, 4, 16, 32),
    (1, 100, 4, 1, 32, 16),
    (1, 300, 2, 2, 16, 24),
]
IDS = [f"B{b}-T{t}-HQ{hq}-H{h}-K{k}-V{v}" for b, t, hq, h, k, v in SHAPES]
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])


# Linear attention.


def linear_inputs(B, T, HQ, H, K, V, with_state):
    inputs = (features(B, T, HQ, K), features(B, T, H, K), torch.randn(B, T, H, V, dtype=torch.float64))
    state = (0.5 * torch.randn(B, H, V, K, dtype=torch.float64), 3 * torch.rand(B, H, K, dtype=torch.float64))
    return inputs, (state if with_state else ())


@DTYPES
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("B, T, HQ, H, K, V", SHAPES, ids=IDS)
def test_linear_matches_naive(B, T, HQ, H, K, V, normalize, dtype):
    # With T = 1 and no state the normalised output is exactly v (dq = 0), so start from a state there.
    inputs, state = linear_inputs(B, T, HQ, H, K, V, with_state=T != 63)

    def run(q, k, v, s):
        return linear_attention(q, k, v, normalize=normalize, initial_state=s, output_final_state=True)

    def run_ref(q, k, v, s):
        return linear_attention_naive(q, k, v, normalize, 1e-4, s, True)

    compare(run, run_ref, inputs, state, dtype, ("dq", "dk", "dv", "dS0", "dn0"))


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_linear_chunk_sizes(chunk_size):
    inputs, state = linear_inputs(1, 37, 4, 2, 8, 6, with_state=True)
    o, final = linear_attention_chunk(*inputs, True, 1e-4, state, chunk_size=chunk_size)
    o_ref, final_ref = linear_attention_naive(*inputs, True, 1e-4, state, True)
    assert_close("o", o, o_ref, 1e-10)
    for x, x_ref in zip(final, final_ref, strict=True):
        assert_close("state", x, x_ref, 1e-10)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_linear_varlen(with_state):
    bounds = [0, 5, 5, 37, 100]
    inputs, _ = linear_inputs(1, 100, 4, 2, 8, 6, with_state=False)
    state = linear_inputs(4, 1, 4, 2, 8, 6, with_state=True)[1] if with_state else None
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    o, final = linear_attention(*inputs, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens)
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg_state = None if state is None else tuple(s[i : i + 1] for s in state)
        o_ref, final_ref = linear_attention_naive(*(x[:, bos:eos] for x in inputs), True, 1e-4, seg_state, True)
        if eos > bos:
            assert_close(f"o[{i}]", o[:, bos:eos], o_ref, 1e-10)
        for x, x_ref in zip(final, final_ref, strict=True):
            torch.testing.assert_close(x[i : i + 1], x_ref, rtol=1e-10, atol=1e-12)


def test_linear_gradcheck():
    inputs, state = linear_inputs(1, 6, 2, 1, 3, 2, with_state=True)
    leaves = leaf_copy(inputs + state, torch.float64)

    def fn(q, k, v, S, n):
        o, final = linear_attention_chunk(q, k, v, True, 1e-4, (S, n), chunk_size=4)
        return (o, *final)

    assert torch.autograd.gradcheck(fn, leaves)


# DeltaNet.


def delta_inputs(B, T, H, K, V, with_state, beta_high=2.0):
    k = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1)
    q = torch.randn(B, T, H, K, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    beta = beta_high * torch.rand(B, T, H, dtype=torch.float64).clamp(0.05, 0.99)
    state = (0.5 * torch.randn(B, H, V, K, dtype=torch.float64),) if with_state else ()
    return (q, k, v, beta), state


DELTA_SHAPES = [(b, t, h, k, v) for b, t, _, h, k, v in SHAPES]
DELTA_IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in DELTA_SHAPES]


@DTYPES
@pytest.mark.parametrize("B, T, H, K, V", DELTA_SHAPES, ids=DELTA_IDS)
def test_delta_rule_matches_naive(B, T, H, K, V, dtype):
    inputs, state = delta_inputs(B, T, H, K, V, with_state=T in (2, 100, 300))

    def run(q, k, v, beta, s):
        o, S = delta_rule(q, k, v, beta, initial_state=None if s is None else s[0], output_final_state=True)
        return o, (S,)

    def run_ref(q, k, v, beta, s):
        o, S = delta_rule_naive(q, k, v, beta, None, None if s is None else s[0], True)
        return o, (S,)

    compare(run, run_ref, inputs, state, dtype, ("dq", "dk", "dv", "dbeta", "dS0"))


def test_delta_rule_scale_and_chunks():
    inputs, (S0,) = delta_inputs(2, 45, 2, 8, 4, with_state=True)
    o, (S,) = delta_rule_chunk(*inputs, 0.3, (S0,), chunk_size=8)
    o_ref, S_ref = delta_rule_naive(*inputs, 0.3, S0, True)
    assert_close("o", o, o_ref, 1e-10)
    assert_close("S", S, S_ref, 1e-10)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_delta_rule_varlen(with_state):
    bounds = [0, 5, 5, 37, 100]
    inputs, _ = delta_inputs(1, 100, 2, 8, 6, with_state=False)
    S0 = 0.5 * torch.randn(4, 2, 6, 8, dtype=torch.float64) if with_state else None
    cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
    o, S = delta_rule(*inputs, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens)
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg_state = None if S0 is None else S0[i : i + 1]
        o_ref, S_ref = delta_rule_naive(*(x[:, bos:eos] for x in inputs), None, seg_state, True)
        if eos > bos:
            assert_close(f"o[{i}]", o[:, bos:eos], o_ref, 1e-10)
        torch.testing.assert_close(S[i : i + 1], S_ref, rtol=1e-10, atol=1e-12)


def test_delta_rule_gradcheck_beta_near_two():
    inputs, state = delta_inputs(1, 7, 2, 3, 2, with_state=True)
    q, k, v, _ = inputs
    beta = 1.9 + 0.09 * torch.rand(1, 7, 2, dtype=torch.float64)
    leaves = leaf_copy((q, k, v, beta) + state, torch.float64)

    def fn(q, k, v, beta, S):
        o, (S,) = delta_rule_chunk(q, k, v, beta, 0.5, (S,), chunk_size=4)
        return o, S

    def fn_public(q, k, v, beta, S):
        return delta_rule(q, k, v, beta, initial_state=S, output_final_state=True)

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradcheck(fn_public, leaves)


def test_dtypes_and_no_state():
    q, k, v = (features(1, 20, 2, 8).bfloat16() for _ in range(3))
    beta = torch.rand(1, 20, 2)
    o, S = delta_rule(q, k, v, beta)
    assert o.dtype == torch.bfloat16 and S is None
    o, (S, n) = linear_attention(q, k, v, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == n.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_delta_rule_under_autocast(dtype):
    """Autocast makes the products 16-bit; the triangular solve still runs, in float32, the state stays float32, and
    the output and gradients are as close to float32's as 16-bit products allow."""
    inputs, state = delta_inputs(2, 150, 2, 16, 16, with_state=True)

    def run(xs, st):
        o, S = delta_rule(*xs, initial_state=st[0], output_final_state=True, backend="torch")
        o.square().sum().backward()
        return o, S, *(x.grad for x in xs), st[0].grad

    expected = run(leaf_copy(inputs, torch.float32), leaf_copy(state, torch.float32))
    with torch.autocast("cpu", dtype=dtype):
        actual = run(leaf_copy(inputs, torch.float32), leaf_copy(state, torch.float32))
    assert actual[1].dtype == torch.float32
    for name, x, y in zip(("o", "S", "dq", "dk", "dv", "dbeta", "dS0"), actual, expected, strict=True):
        assert_close(name, x, y, 3e-2)


# Validation: one test per rule, each naming the argument.


def base_args(B=1, T=8, H=2, K=4, V=3):
    return dict(q=torch.rand(B, T, H, K), k=torch.rand(B, T, H, K), v=torch.rand(B, T, H, V))


COMMON_BAD = {
    "q-rank": (dict(q=torch.rand(1, 8, 2)), {}, "^q"),
    "k-shape": (dict(k=torch.rand(1, 8, 2, 5)), {}, "^k"),
    "v-shape": (dict(v=torch.rand(1, 9, 2, 3)), {}, "^v"),
    "v-dtype": (dict(v=torch.rand(1, 8, 2, 3, dtype=torch.float64)), {}, "^v"),
    "k-device": (dict(k=torch.rand(1, 8, 2, 4, device="meta")), {}, "^k"),
    "heads-not-multiple": (dict(q=torch.rand(1, 8, 3, 4)), {}, "^q"),
    "cu_seqlens-batch": (base_args(B=2), dict(cu_seqlens=torch.tensor([0, 8])), "^cu_seqlens"),
    "cu_seqlens-non-monotone": ({}, dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "^cu_seqlens"),
    "cu_seqlens-dtype": ({}, dict(cu_seqlens=torch.tensor([0.0, 8.0])), "^cu_seqlens"),
    "cu_seqlens-end": ({}, dict(cu_seqlens=torch.tensor([0, 9])), "^cu_seqlens"),
}

LINEAR_BAD = {
    **COMMON_BAD,
    "eps-zero": ({}, dict(eps=0.0), "^eps"),
    "eps-nan": ({}, dict(eps=float("nan")), "^eps"),
    "initial_state-not-tuple": ({}, dict(initial_state=torch.zeros(1, 2, 3, 4)), "^initial_state"),
    "initial_state-S-shape": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4))),
        r"^initial_state\[0\]",
    ),
    "initial_state-n-shape": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3))),
        r"^initial_state\[1\]",
    ),
    "initial_state-n-dtype": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, dtype=torch.float16))),
        r"^initial_state\[1\]",
    ),
    "initial_state-N-vs-cu_seqlens": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4)), cu_seqlens=torch.tensor([0, 2, 8])),
        r"^initial_state\[0\]",
    ),
}


@pytest.mark.parametrize("overrides, kwargs, match", LINEAR_BAD.values(), ids=LINEAR_BAD.keys())
def test_linear_bad_input_raises(overrides, kwargs, match):
    args = {**base_args(), **overrides}
    with pytest.raises(ValueError, match=match):
        linear_attention(args["q"], args["k"], args["v"], **kwargs)


DELTA_BAD = {
    **COMMON_BAD,
    "gqa-heads": (dict(q=torch.rand(1, 8, 4, 4)), {}, "^q"),
    "beta-shape": (dict(beta=torch.rand(1, 8, 3)), {}, "^beta"),
    "beta-rank": (dict(beta=torch.rand(1, 8, 2, 1)), {}, "^beta"),
    "beta-device": (dict(beta=torch.rand(1, 8, 2, device="meta")), {}, "^beta"),
    "beta-int": (dict(beta=torch.ones(1, 8, 2, dtype=torch.int32)), {}, "^beta"),
    "scale-zero": ({}, dict(scale=0.0), "^scale"),
    "scale-nan": ({}, dict(scale=float("nan")), "^scale"),
    "initial_state-shape": ({}, dict(initial_state=torch.zeros(1, 2, 4, 4)), "^initial_state"),
    "initial_state-tuple": ({}, dict(initial_state=(torch.zeros(1, 2, 3, 4),)), "^initial_state"),
    "initial_state-dtype": (
        {},
        dict(initial_state=torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)),
        "^initial_state",
    ),
    "initial_state-device": (
        {},
        dict(initial_state=torch.zeros(1, 2, 3, 4, device="meta")),
        "^initial_state",
    ),
}


@pytest.mark.parametrize("overrides, kwargs, match", DELTA_BAD.values(), ids=DELTA_BAD.keys())
def test_delta_rule_bad_input_raises(overrides, kwargs, match):
    args = {**base_args(), **overrides}
    args.setdefault("beta", torch.rand(args["v"].shape[:3]))
    with pytest.raises(ValueError, match=match):
        delta_rule(args["q"], args["k"], args["v"], args["beta"], **kwargs)


def test_delta_rule_empty_sequence_backward():
    """T = 0: an empty output on the inputs' graph, whose backward gives empty gradients (it was detached)."""
    q, k, v = (torch.randn(2, 0, 2, 8, requires_grad=True) for _ in range(3))
    beta = torch.rand(2, 0, 2, requires_grad=True)
    o, _ = delta_rule(q, k, v, beta)
    assert o.shape == (2, 0, 2, 8)
    o.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v, beta))
