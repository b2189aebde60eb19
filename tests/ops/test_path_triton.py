"""PaTH's Triton forward kernels (UT transform, carried keys, right-to-left scan) against the PyTorch backend.

On CPU they run through Triton's interpreter (``conftest.py``) with 16-position chunks, so a few dozen tokens
already cross several chunks; on a GPU the same tests run with 64-position chunks. ``path_attention(backend=
"triton")`` runs the fused forward; its backward is, for now, autograd through the PyTorch backend (the fused
backward is the open part of issue 3), and the tests below hold the wiring of every gradient.
"""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.path import path_attention
from attnkit.ops.path.triton.forward import path_fwd_fn
from tests.helpers import assert_close
from tests.ops.test_path import make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def check(B, T, HQ, H, K, V, gate, dtype, cu_seqlens=None, beta_low=1.5):
    q, k, v, w, beta, g = (
        None if x is None else x.to(DEVICE)
        for x in make_inputs(B, T, HQ, H, K, V, gate=gate, dtype=torch.float32, beta_low=beta_low)
    )
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    actual = path_fwd_fn(q, k, v, w, beta, g, K**-0.5, cu)
    # The reference sees the same rounded inputs, in float32.
    expected = path_attention(q.float(), k.float(), v.float(), w, beta, g, cu_seqlens=cu, backend="torch")
    assert actual.dtype == dtype
    assert_close("o", actual, expected.to(dtype), TOL[dtype])


# B, T, HQ, H, K, V, gate
CASES = [
    (2, 1, 2, 2, 16, 16, False),
    (1, 16, 1, 1, 16, 16, False),  # exactly one chunk
    (2, 37, 4, 2, 16, 16, False),  # GQA, a partial last chunk
    (1, 70, 2, 1, 32, 16, True),  # MQA, PaTH-FoX, five chunks
    (1, 50, 2, 2, 24, 40, True),  # K, V not powers of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-HQ{}-H{}-K{}-V{}-gate{}".format(*c))
def test_forward_matches_torch_backend(case, dtype):
    check(*case, dtype)


@pytest.mark.parametrize(
    "offsets", [[0, 5, 37, 80], [0, 5, 5, 40, 80], [0, 0, 80], [0, 1, 80]], ids=["ragged", "empty", "lead", "one"]
)
def test_varlen_forward(offsets):
    check(1, offsets[-1], 4, 2, 16, 16, True, torch.float32, cu_seqlens=offsets)


def test_beta_near_two_long_history():
    """beta ∈ (1.99, 2): near-reflections, the query carried across many chunks stays accurate."""
    check(1, 160, 2, 1, 16, 16, True, torch.float32, beta_low=1.99)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, T, HQ, H, K", [(2, 4096, 8, 8, 64), (1, 8192, 4, 2, 128), (1, 32768, 2, 1, 64)], ids=str)
def test_real_sizes_on_gpu(B, T, HQ, H, K, dtype):
    check(B, T, HQ, H, K, K, True, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "K, offsets", [(16, None), (24, None), (80, None), (16, [0, 5, 5, 40, 75])], ids=["K16", "K24", "K80", "varlen"]
)
def test_carry_keys_kernel(K, offsets, dtype):
    """The prefill's keys carried to the end of every sequence, against the PyTorch pass (K = 80: two column
    blocks of the suffix product)."""
    from attnkit.ops.path import path_carry_keys

    B, T, H = (2, 53, 2) if offsets is None else (1, offsets[-1], 2)
    _, k, _, w, beta, _ = (
        None if x is None else x.to(DEVICE) for x in make_inputs(B, T, H, H, K, K, gate=False, dtype=torch.float32)
    )
    k = k.to(dtype)
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    actual = path_carry_keys(k, w, beta, cu_seqlens=cu, backend="triton")
    expected = path_carry_keys(k.float(), w, beta, cu_seqlens=cu, backend="torch")
    assert actual.dtype == dtype
    assert_close("k_carried", actual, expected.to(dtype), TOL[dtype])


@pytest.mark.parametrize(
    "B, T, HQ, H, K, V, gate, offsets",
    [(2, 37, 4, 2, 16, 24, True, None), (1, 45, 2, 1, 16, 16, False, None), (1, 60, 4, 2, 16, 16, True, [0, 7, 7, 60])],
    ids=["gqa-fox", "mqa", "varlen"],
)
def test_triton_backend_forward_and_gradients(B, T, HQ, H, K, V, gate, offsets):
    """``path_attention(backend="triton")``: the fused forward and every gradient (q, k, v, w, beta, g) against
    the PyTorch backend, with ``beta`` in (1.5, 2)."""
    inputs = [
        None if x is None else x.to(DEVICE) for x in make_inputs(B, T, HQ, H, K, V, gate=gate, dtype=torch.float32)
    ]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, V, device=DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
        o = path_attention(*leaves, cu_seqlens=cu, backend=backend)
        o.backward(do)
        results[backend] = [o] + [None if x is None else x.grad for x in leaves]
    names = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]
    for name, actual, expected in zip(names, results["triton"], results["torch"]):
        if expected is None:
            assert actual is None, name
            continue
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert_close(name, actual, expected, 1e-5)


def test_triton_backend_bf16_inputs_keep_their_dtypes():
    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 20, 2, 2, 16, 16, gate=True, dtype=torch.float32))
    q, k, v = (x.to(torch.float16).requires_grad_() for x in (q, k, v))
    w, beta, g = (x.requires_grad_() for x in (w, beta, g))
    o = path_attention(q, k, v, w, beta, g, backend="triton")
    assert o.dtype == torch.float16
    o.float().square().sum().backward()
    assert (q.grad.dtype, w.grad.dtype, g.grad.dtype) == (torch.float16, torch.float32, torch.float32)
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, w, beta, g))


def test_triton_backend_rejects_what_the_kernels_do_not_take():
    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 8, 2, 2, 16, 16, gate=True, dtype=torch.float64))
    with pytest.raises(ValueError, match="^backend: .*float64"):
        path_attention(q, k, v, w, beta, g, backend="triton")
    wide = [x.to(DEVICE) for x in make_inputs(1, 4, 1, 1, 160, 16, gate=False, dtype=torch.float32)[:5]]
    with pytest.raises(ValueError, match="^backend: .*head dims up to 128"):
        path_attention(*wide, backend="triton")
    # "auto" falls back to the PyTorch backend for both.
    assert path_attention(q, k, v, w, beta, g).dtype == torch.float64
    assert path_attention(*wide).shape == (1, 4, 1, 16)


def test_forward_opcheck_and_compile():
    """``attnkit::path_fwd`` passes ``opcheck`` (forward: fake tensor, schema, AOT dispatch) and compiles with
    ``fullgraph=True``, forward and backward. The interim backward (autograd through the PyTorch backend inside
    the backward formula) traces with static shapes only, so ``opcheck`` runs on inputs without gradients; the
    fused backward will be checked there too."""
    from attnkit.ops.path.parallel import path_fwd_op

    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 20, 2, 1, 16, 16, gate=True, dtype=torch.float32))
    cu = torch.tensor([0, 6, 20], device=DEVICE, dtype=torch.int32)
    torch.library.opcheck(path_fwd_op, (q, k, v, w, beta, g, cu, 0.25))
    torch.library.opcheck(path_fwd_op, (q, k, v, w, beta, None, None, 0.25))

    leaves = [x.clone().requires_grad_() for x in (q, k, v, w, beta, g)]
    compiled = torch.compile(lambda *a: path_attention(*a, backend="triton"), fullgraph=True, dynamic=False)
    o = compiled(*leaves)
    o.square().sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, w, beta, g)]
    o_ref = path_attention(*ref, backend="torch")
    o_ref.square().sum().backward()
    assert_close("o", o, o_ref, 1e-5)
    for name, a, b in zip(["dq", "dk", "dv", "dw", "dbeta", "dg"], leaves, ref):
        assert_close(name, a.grad, b.grad, 1e-5)
