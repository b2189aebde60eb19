"""TAPA's linear phase (issue 20, the paper's phase ablation): ``φ = (Σ q_P − Σ k_P)/sqrt(2·dP)`` in place of
``(q_P·k_P)/sqrt(dP)``, on every backend and the decode step, against the definitional loop.

The PyTorch backend is held to the loop in float64 (and float32); the Triton kernels (under the interpreter on
CPU, fp32 and fp16) and the decode kernel to the PyTorch backend, forward and every gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.ops.tapa import tapa_attention, tapa_decode_step
from attnkit.ops.tapa.naive import tapa_naive
from attnkit.ops.tapa.triton.backward import tapa_bwd_fn
from attnkit.ops.tapa.triton.decode import tapa_decode_fn
from attnkit.ops.tapa.triton.forward import tapa_fwd_fn
from tests.helpers import assert_close, rel_rms, tol_for
from tests.ops.test_tapa_decoding_triton import make_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton against the PyTorch backend: as in test_tapa_triton.py.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 1e-2)}


def make(B, T, HQ, H, D, V, dtype=torch.float64, device="cpu"):
    """Drawn in float32 so that every dtype sees the same inputs."""
    q, k, v = torch.randn(B, T, HQ, D), torch.randn(B, T, H, D), torch.randn(B, T, H, V)
    do = torch.randn(B, T, HQ, V)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, do))


def run(fn, q, k, v, do):
    """``(o, dq, dk, dv)`` of ``fn(q, k, v)``."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do.to(o.dtype)))


def check(actual, expected, tol_o, tol_grad):
    for name, a, e, tol in zip(("o", "dq", "dk", "dv"), actual, expected, (tol_o, tol_grad, tol_grad, tol_grad)):
        assert a.dtype == e.dtype, name
        assert_close(name, a, e, tol)


# B, T, HQ, H, D, V, theta, alpha
CASES = [
    (2, 2, 4, 2, 16, 16, 0.5, 0.5),  # distances 0 and 1 only
    (2, 37, 4, 2, 32, 32, 0.5, 0.5),  # GQA, odd length
    (1, 50, 4, 1, 32, 16, 0.5, 0.1),  # MQA, V != D
    (1, 45, 2, 1, 12, 8, 0.25, 0.5),  # dA = 3, dP = 9: masked channel blocks
    (1, 40, 2, 2, 32, 32, 0.5, 0.0),  # 0^0 = 0 on the diagonal only
    (1, 131, 2, 1, 16, 16, 0.75, 0.3),  # dP = 4, several blocks of the PyTorch backend
]


def case_id(case):
    B, T, HQ, H, D, V, theta, alpha = case
    return f"B{B}-T{T}-HQ{HQ}-H{H}-D{D}-V{V}-theta{theta}-alpha{alpha}"


def linear(**kwargs):
    return lambda q, k, v: tapa_attention(q, k, v, phase="linear", **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_torch_backend_matches_naive(case, dtype):
    B, T, HQ, H, D, V, theta, alpha = case
    q, k, v, do = make(B, T, HQ, H, D, V)
    expected = run(lambda q, k, v: tapa_naive(q, k, v, theta, alpha, "linear"), q, k, v, do)
    actual = run(linear(theta=theta, alpha=alpha, backend="torch"), *(x.to(dtype) for x in (q, k, v, do)))
    tol = tol_for(dtype)
    check([x.double() for x in actual], expected, tol, tol)


@pytest.mark.parametrize(
    "offsets",
    [[0, 5, 37, 100], [0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token"],
)
def test_varlen_matches_naive_per_segment(offsets):
    q, k, v, do = make(1, offsets[-1], 4, 2, 16, 12)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)

    def per_segment(q, k, v):
        bounds = zip(offsets[:-1], offsets[1:])
        return torch.cat([tapa_naive(q[:, s:e], k[:, s:e], v[:, s:e], 0.5, 0.5, "linear") for s, e in bounds], 1)

    actual = run(linear(alpha=0.5, cu_seqlens=cu_seqlens), q, k, v, do)
    check(actual, run(per_segment, q, k, v, do), 1e-10, 1e-10)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 3, 3, 7]], ids=["dense", "varlen"])
def test_gradcheck(cu_seqlens):
    B = 2 if cu_seqlens is None else 1
    q, k, v, _ = make(B, 7, 4, 2, 6, 3)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(linear(alpha=0.5, cu_seqlens=cu), inputs)


def test_is_the_quadratic_phase_of_two_synthetic_channels():
    """``Σ q_P − Σ k_P`` is the product of ``[Σ q_P, 1]`` and ``[1, −Σ k_P]``: the linear phase of ``D`` channels is
    the quadratic phase of ``dP = 2`` built that way (the ``1/sqrt(dP)`` of the two normalisations folded into the
    query), so one backend's quadratic path checks the other's linear one, gradients included (through the
    construction, by autograd)."""
    q, k, v, do = make(2, 29, 4, 2, 16, 8)
    amp, dP = 8, 8

    def synthetic(q, k, v):
        u, w = q[..., amp:].sum(-1, keepdim=True), k[..., amp:].sum(-1, keepdim=True)
        q2 = torch.cat([q[..., :amp], u / math.sqrt(dP), torch.ones_like(u) / math.sqrt(dP)], -1)
        k2 = torch.cat([k[..., :amp], torch.ones_like(w), -w], -1)
        return tapa_attention(q2, k2, v, theta=0.8, alpha=0.4)  # round(0.8 · 10) = 8 amplitude channels

    check(run(linear(alpha=0.4), q, k, v, do), run(synthetic, q, k, v, do), 1e-12, 1e-12)


def test_differs_from_the_quadratic_phase():
    q, k, v, do = make(1, 40, 2, 2, 16, 16)
    quadratic = run(lambda q, k, v: tapa_attention(q, k, v, alpha=0.5), q, k, v, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), run(linear(alpha=0.5), q, k, v, do), quadratic):
        assert rel_rms(a, b) > 0.1, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_torch_backend(case, dtype):
    B, T, HQ, H, D, V, theta, alpha = case
    inputs = make(B, T, HQ, H, D, V, dtype, DEVICE)
    kwargs = dict(theta=theta, alpha=alpha)
    actual = run(linear(backend="triton", **kwargs), *inputs)
    check(actual, run(linear(backend="torch", **kwargs), *inputs), *TOL[dtype])


@pytest.mark.parametrize(
    "offsets", [[0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100]], ids=["empty-segment", "leading-empty", "one-token"]
)
def test_triton_varlen_matches_torch_backend(offsets):
    inputs = make(1, offsets[-1], 4, 2, 32, 16, torch.float32, DEVICE)
    kwargs = dict(alpha=0.5, cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=DEVICE))
    actual = run(linear(backend="triton", **kwargs), *inputs)
    check(actual, run(linear(backend="torch", **kwargs), *inputs), *TOL[torch.float32])


# The GPU's block shapes, and its dQ by atomics from the dK/dV kernel (the interpreter's default computes dQ in a
# kernel of its own).
GPU_CONFIGS = {
    "gpu-blocks": ((128, 64, 8, 2), {"dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 2), "atomic_dq": False}),
    "atomic-dq": ((64, 32, 4, 2), {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2), "atomic_dq": True}),
}


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_triton_block_configs(name):
    fwd_config, bwd_config = GPU_CONFIGS[name]
    q, k, v, do = make(1, 203, 4, 2, 32, 32, torch.float32, DEVICE)
    cu = torch.tensor([0, 70, 200, 203], device=DEVICE)
    o, lse = tapa_fwd_fn(q, k, v, 16, 0.3, cu, config=fwd_config, phase="linear")
    grads = tapa_bwd_fn(q, k, v, o, lse, do, 16, 0.3, cu, config=bwd_config, phase="linear")
    expected = run(linear(alpha=0.3, cu_seqlens=cu, backend="torch"), q, k, v, do)
    check((o, *grads), expected, *TOL[torch.float32])


def test_decode_step_matches_naive():
    """The PyTorch decode step is the last row of the loop over each row's real slots."""
    q, k, v, q_pos, positions, mask = make_cache(3, 30, 4, 2, 16, 8, torch.float64, pad=4)
    o = tapa_decode_step(q, k, v, q_pos, positions, mask, alpha=0.5, phase="linear", backend="torch")
    for b in range(3):
        real = mask[b]
        full_q = q.new_zeros(1, int(real.sum()), 4, 16)
        full_q[:, -1] = q[b, 0]
        expected = tapa_naive(full_q, k[b : b + 1, real], v[b : b + 1, real], 0.5, 0.5, "linear")[:, -1]
        assert_close(f"row {b}", o[b], expected, 1e-12)


# B, L, HQ, H, D, V, theta, alpha, pad, split_size (None: the launcher's choice; 1 forces splits of 64 slots).
# make_cache: row b has b·pad masked slots of junk on the left, then positions 0, 1, ...; the last is the query's.
DECODE_CASES = [
    (2, 37, 4, 2, 16, 16, 0.5, 0.5, 0, None),
    (1, 1, 2, 2, 16, 16, 0.5, 0.5, 0, None),
    (2, 40, 4, 1, 12, 8, 0.25, 0.1, 9, None),  # MQA, dP = 9, left padding
    (2, 150, 4, 2, 16, 16, 0.5, 0.3, 70, 1),  # three splits; row 1's first split is all padding
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}-L{c[1]}-D{c[4]}-pad{c[8]}-split{c[9]}")
def test_decode_kernel_matches_torch(case, dtype):
    B, L, HQ, H, D, V, theta, alpha, pad, split_size = case
    q, k, v, q_pos, positions, mask = make_cache(B, L, HQ, H, D, V, dtype, pad)
    kwargs = dict(theta=theta, alpha=alpha, phase="linear")
    expected = tapa_decode_step(q, k, v, q_pos, positions, mask, backend="torch", **kwargs)
    if split_size is None:
        actual = tapa_decode_step(q, k, v, q_pos, positions, mask, backend="triton", **kwargs)
    else:
        amp_dim = round(theta * D)
        actual = tapa_decode_fn(q, k, v, q_pos, positions, mask, amp_dim, alpha, split_size, phase="linear")
    assert actual.dtype == dtype
    assert_close("o", actual, expected, 1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("phase", ["cubic", "Linear", "", None, 1])
def test_bad_phase_is_a_value_error(phase):
    q, k, v, _ = make(1, 4, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="^phase: expected one of"):
        tapa_attention(q, k, v, phase=phase)
    positions, mask = torch.arange(4)[None], torch.ones(1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="^phase: expected one of"):
        tapa_decode_step(q[:, -1:], k, v, torch.tensor([3]), positions, mask, phase=phase)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU; the interpreter runs the small cases")
@pytest.mark.parametrize("B, T, HQ, H, D", [(2, 8192, 16, 4, 64), (1, 16384, 4, 4, 128)], ids=str)
def test_real_sizes_on_gpu(B, T, HQ, H, D):
    inputs = make(B, T, HQ, H, D, D, torch.bfloat16, "cuda")
    check(run(linear(backend="triton"), *inputs), run(linear(backend="torch"), *inputs), 5e-3, 1e-2)
