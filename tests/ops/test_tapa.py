"""TAPA (SPEC §3): the blockwise PyTorch backend against the definitional loops, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.ops.tapa import tapa_attention, tapa_decode_step
from attnkit.ops.tapa.naive import tapa_naive
from attnkit.ops.tapa.torch_impl import check_alpha, tapa_split
from tests.helpers import assert_close, tol_for


def make_inputs(B, T, HQ, H, D, V, dtype=torch.float64):
    """Drawn in float32 so that a float32 run and the float64 reference see exactly the same inputs."""
    q = torch.randn(B, T, HQ, D)
    k = torch.randn(B, T, H, D)
    v = torch.randn(B, T, H, V)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run(fn, q, k, v, do, dtype):
    """Output and gradients of ``fn`` on ``(q, k, v)`` cast to ``dtype``."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
    return (o, *grads)


def check_against(actual, expected, tol):
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
        assert_close(name, a, e, tol)


# B, T, HQ, H, D, V, theta, alpha. float32 error grows with the phase |φ| ~ 2π·T^alpha·|q_P·k_P|/sqrt(dP)
# (rounding φ costs ~1e-7·|φ|), so the alpha = 0.5 cases stay short enough for the 1e-5 bar; the long
# sequence test below covers large phases with a bar sized to them.
CASES = [
    (2, 1, 4, 2, 32, 32, 0.5, 0.1),
    (2, 2, 4, 2, 32, 32, 0.5, 0.1),
    (2, 63, 4, 2, 32, 32, 0.5, 0.1),
    (2, 100, 4, 2, 32, 32, 0.5, 0.1),
    (1, 300, 4, 2, 32, 32, 0.5, 0.1),
    (1, 64, 4, 1, 16, 16, 0.5, 0.1),  # MQA
    (2, 50, 2, 2, 16, 24, 0.5, 0.1),  # V != D
    (1, 70, 2, 1, 12, 8, 0.25, 0.1),  # dA = 3, dP = 9
    (1, 70, 2, 2, 5, 7, 0.5, 0.1),  # round(2.5) = 2: dA = 2, dP = 3
    (1, 100, 4, 2, 16, 16, 0.5, 0.0),
    (1, 48, 4, 2, 16, 16, 0.5, 0.5),
    (1, 48, 2, 1, 16, 16, 0.75, 0.5),  # dP = 4: the largest phases of the set
]


def case_id(case):
    B, T, HQ, H, D, V, theta, alpha = case
    return f"B{B}-T{T}-HQ{HQ}-H{H}-D{D}-V{V}-theta{theta}-alpha{alpha}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_naive(case, dtype):
    B, T, HQ, H, D, V, theta, alpha = case
    q, k, v = make_inputs(B, T, HQ, H, D, V)
    do = torch.randn(B, T, HQ, V, dtype=torch.float64)
    expected = run(lambda q, k, v: tapa_naive(q, k, v, theta, alpha), q, k, v, do, torch.float64)
    actual = run(lambda q, k, v: tapa_attention(q, k, v, theta=theta, alpha=alpha), q, k, v, do, dtype)
    for x in actual:
        assert x.dtype == dtype
    check_against(actual, expected, tol_for(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize(
    "offsets",
    [[0, 5, 37, 100], [0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token"],
)
def test_varlen_matches_naive_per_segment(offsets, dtype):
    T, HQ, H, D, V = offsets[-1], 4, 2, 16, 12
    q, k, v = make_inputs(1, T, HQ, H, D, V)
    do = torch.randn(1, T, HQ, V, dtype=torch.float64)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)

    def per_segment(q, k, v):
        # Each segment is its own sequence: positions restart at 0.
        bounds = zip(offsets[:-1], offsets[1:])
        return torch.cat([tapa_naive(q[:, s:e], k[:, s:e], v[:, s:e], 0.5, 0.5) for s, e in bounds], dim=1)

    expected = run(per_segment, q, k, v, do, torch.float64)
    actual = run(
        lambda q, k, v: tapa_attention(q, k, v, theta=0.5, alpha=0.5, cu_seqlens=cu_seqlens),
        q,
        k,
        v,
        do,
        dtype,
    )
    check_against(actual, expected, tol_for(dtype))


def test_varlen_int64_equals_int32():
    q, k, v = make_inputs(1, 40, 2, 2, 8, 8)
    o32 = tapa_attention(q, k, v, cu_seqlens=torch.tensor([0, 17, 40], dtype=torch.int32))
    o64 = tapa_attention(q, k, v, cu_seqlens=torch.tensor([0, 17, 40], dtype=torch.int64))
    assert torch.equal(o32, o64)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 0]], ids=["dense", "varlen"])
def test_empty_sequence(cu_seqlens):
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 0, 2, 1, 8, 6))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    o = tapa_attention(q, k, v, cu_seqlens=cu)
    assert o.shape == (1, 0, 2, 6)
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_empty_batch():
    """B = 0: an empty output on the inputs' graph (it raised a reshape error)."""
    q, k, v = (x.requires_grad_() for x in make_inputs(0, 5, 2, 1, 8, 6))
    o = tapa_attention(q, k, v)
    assert o.shape == (0, 5, 2, 6)
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("cu_seqlens", [None, [0, 3, 3, 7]], ids=["dense", "varlen"])
def test_gradcheck(cu_seqlens):
    B, T = (2, 7) if cu_seqlens is None else (1, 7)
    q, k, v = (x.requires_grad_() for x in make_inputs(B, T, 4, 2, 6, 3))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    assert torch.autograd.gradcheck(
        lambda q, k, v: tapa_attention(q, k, v, theta=0.5, alpha=0.5, cu_seqlens=cu), (q, k, v)
    )


def test_alpha_zero_diagonal_has_no_phase():
    """``0^alpha = 0`` also for ``alpha = 0``: the diagonal logit is the bare amplitude, while every
    earlier key gets the constant phase ``2π·(q_P·k_P)/sqrt(dP)``."""
    q, k, v = make_inputs(1, 2, 1, 1, 4, 3)
    o = tapa_attention(q, k, v, theta=0.5, alpha=0.0)
    amp = (q[0, 1, 0, :2] @ k[0, :, 0, :2].T) / math.sqrt(2)
    phase = (q[0, 1, 0, 2:] @ k[0, :, 0, 2:].T) / math.sqrt(2)
    logits = amp * torch.cos(2 * math.pi * phase * torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert_close("o", o[0, 1, 0], logits.softmax(-1) @ v[0, :, 0], 1e-12)
    assert_close("o", o[0, 0, 0], v[0, 0, 0], 1e-12)


@pytest.mark.parametrize("alpha, tol", [(0.1, 1e-5), (0.5, 1e-4)], ids=["alpha0.1", "alpha0.5"])
def test_long_sequence_float32_stays_accurate(alpha, tol):
    """At T = 4096 the phase argument grows like d^alpha: at alpha = 0.5 it reaches ~2π·64·|q_P·k_P|/sqrt(dP),
    hundreds of radians, where float32 rounding of the phase alone costs ~1e-5 of relative accuracy in the
    gradients. float32 must stay within that of float64 (same code) on the output and the gradients."""
    T, D = 4096, 16
    q, k, v = make_inputs(1, T, 1, 1, D, D)
    do = torch.randn(1, T, 1, D, dtype=torch.float64)

    def fn(q, k, v):
        return tapa_attention(q, k, v, theta=0.5, alpha=alpha)

    expected = run(fn, q, k, v, do, torch.float64)
    actual = run(fn, q, k, v, do, torch.float32)
    assert_close("o", actual[0], expected[0], 1e-5)
    check_against(actual, expected, tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs(dtype):
    q, k, v = make_inputs(2, 33, 4, 2, 16, 8, dtype=torch.float32)
    do = torch.randn(2, 33, 4, 8)
    actual = run(lambda q, k, v: tapa_attention(q, k, v), q, k, v, do, dtype)
    # The reference sees the same rounded inputs, so only the output rounding is left.
    rounded = [x.to(dtype) for x in (q, k, v)]
    expected = run(lambda q, k, v: tapa_naive(q, k, v, 0.5, 0.1), *rounded, do, torch.float64)
    for x in actual:
        assert x.dtype == dtype
    check_against(actual, expected, 1e-2)


@pytest.mark.parametrize(
    "theta, D, split",
    [(0.5, 5, (2, 3)), (0.5, 7, (4, 3)), (0.25, 12, (3, 9)), (0.3, 10, (3, 7))],
    ids=["2.5-rounds-down", "3.5-rounds-up", "quarter", "0.3"],
)
def test_split_is_python_round(theta, D, split):
    assert tapa_split(theta, D) == split


BAD_INPUTS = {
    "q-rank": ("q", lambda q, k, v: dict(q=q[0])),
    "q-int": ("q", lambda q, k, v: dict(q=q.long())),
    "k-shape": ("k", lambda q, k, v: dict(k=k[:, :-1])),
    "k-dtype": ("k", lambda q, k, v: dict(k=k.float())),
    "v-shape": ("v", lambda q, k, v: dict(v=v[:, :, :1])),
    "heads-not-multiple": ("q", lambda q, k, v: dict(q=q[:, :, :3])),
    "cu_seqlens-batch": ("cu_seqlens", lambda q, k, v: dict(cu_seqlens=torch.tensor([0, 8]))),
    "cu_seqlens-non-monotone": (
        "cu_seqlens",
        lambda q, k, v: dict(q=q[:1], k=k[:1], v=v[:1], cu_seqlens=torch.tensor([0, 6, 3, 8])),
    ),
    "cu_seqlens-float": (
        "cu_seqlens",
        lambda q, k, v: dict(q=q[:1], k=k[:1], v=v[:1], cu_seqlens=torch.tensor([0.0, 8.0])),
    ),
    "cu_seqlens-wrong-end": (
        "cu_seqlens",
        lambda q, k, v: dict(q=q[:1], k=k[:1], v=v[:1], cu_seqlens=torch.tensor([0, 7])),
    ),
    "theta-zero": ("theta", lambda q, k, v: dict(theta=0.0)),
    "theta-one": ("theta", lambda q, k, v: dict(theta=1.0)),
    "theta-nan": ("theta", lambda q, k, v: dict(theta=float("nan"))),
    "theta-empty-amplitude": (
        "theta",
        lambda q, k, v: dict(theta=0.1),
    ),  # round(0.4) = 0 amplitude channels at D = 4
    "theta-empty-phase": ("theta", lambda q, k, v: dict(theta=0.9)),  # round(3.6) = 4 = D
    "alpha-nan": ("alpha", lambda q, k, v: dict(alpha=float("nan"))),
    "alpha-inf": ("alpha", lambda q, k, v: dict(alpha=float("inf"))),
    "alpha-negative": ("alpha", lambda q, k, v: dict(alpha=-0.1)),
    "backend-unknown": ("backend", lambda q, k, v: dict(backend="cuda")),
}


@pytest.mark.parametrize("name, change", BAD_INPUTS.values(), ids=list(BAD_INPUTS))
def test_bad_input_raises_value_error(name, change):
    q, k, v = make_inputs(2, 8, 4, 2, 4, 4)
    args = dict(q=q, k=k, v=v)
    args.update(change(q, k, v))
    with pytest.raises(ValueError, match=f"^{name}"):
        tapa_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_alpha_50_float32_against_float64(backend):
    """alpha = 50 gave NaN in float32 (6^50 overflows; issue 18). The phase d^50·(q_P·k_P)/sqrt(dP) cycles is
    rounding noise past d = 1 in any finite precision, so the op takes what float32 can compute and refuses the
    rest: two tokens (distances 0 and 1) match the float64 reference, three are a ValueError naming alpha; a packed
    batch is bounded by its longest sequence, not by T."""
    q, k, v = make_inputs(3, 2, 4, 2, 16, 8)
    expected = tapa_naive(q, k, v, alpha=50.0)
    actual = tapa_attention(q.float(), k.float(), v.float(), alpha=50.0, backend=backend)
    assert_close("o", actual, expected.float(), 1e-6)
    with pytest.raises(ValueError, match="^alpha: distance 2 to the power 50.0 exceeds 2\\^16"):
        tapa_attention(*(x.float() for x in make_inputs(1, 3, 4, 2, 16, 8)), alpha=50.0, backend=backend)
    packed = [x.float().reshape(1, 6, *x.shape[2:]) for x in (q, k, v)]
    cu = torch.tensor([0, 2, 4, 6])
    o = tapa_attention(*packed, alpha=50.0, cu_seqlens=cu, backend=backend)
    assert_close("o packed", o, expected.float().reshape(1, 6, 4, 8), 1e-6)
    with pytest.raises(ValueError, match="^alpha:"):
        tapa_attention(*packed, alpha=50.0, cu_seqlens=torch.tensor([0, 3, 6]), backend=backend)


def test_alpha_range_is_the_distance_power_bound():
    """``max_distance^alpha <= 2^16``: alpha = 1 reaches distance 65536 and not one more, alpha = 0.5 reaches 2^32,
    and distances 0 and 1 take any alpha (their power is 0 or 1)."""
    assert check_alpha(1.0, 65536) == 1.0
    with pytest.raises(ValueError, match="^alpha: .*reaches distances up to 65536"):
        check_alpha(1.0, 65537)
    assert check_alpha(0.5, 2**32) == 0.5
    assert check_alpha(1e6, 1) == 1e6 and check_alpha(1e6, 0) == 1e6


def test_alpha_50_decode_step():
    """The decode step bounds the farthest visible slot (masked slots and slots after the query do not count)."""
    q, k, v = make_inputs(2, 2, 4, 2, 16, 8)
    expected = tapa_naive(q, k, v, alpha=50.0)[:, 1:]
    positions, mask = torch.tensor([[0, 1], [0, 1]]), torch.ones(2, 2, dtype=torch.bool)
    args = (q[:, 1:].float(), k.float(), v.float(), torch.tensor([1, 1]), positions)
    assert_close("o", tapa_decode_step(*args, mask, alpha=50.0), expected.float(), 1e-6)
    far = torch.cat([torch.randn(2, 1, 2, 16), k.float()], 1), torch.cat([torch.randn(2, 1, 2, 8), v.float()], 1)
    far_positions, query = torch.tensor([[0, 1, 2]] * 2), torch.tensor([2, 2])  # slot 0 at distance 2 ...
    with pytest.raises(ValueError, match="^alpha: distance 2"):
        tapa_decode_step(args[0], *far, query, far_positions, torch.ones(2, 3, dtype=torch.bool), alpha=50.0)
    masked = torch.tensor([[False, True, True]] * 2)  # ... unless it is padding
    o = tapa_decode_step(args[0], *far, query, far_positions, masked, alpha=50.0)
    assert_close("o masked", o, expected.float(), 1e-6)
    later = torch.tensor([[3, 0, 1]] * 2)  # or after the query
    o = tapa_decode_step(args[0], *far, torch.tensor([1, 1]), later, torch.ones(2, 3, dtype=torch.bool), alpha=50.0)
    assert_close("o later", o, expected.float(), 1e-6)
