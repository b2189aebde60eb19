"""Linear attention's fused Triton kernels against the chunk-parallel PyTorch backend, forward, final state and every
gradient (``q``, ``k``, ``v`` and the initial state, with gradients reaching the final state too).

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``) at tiny shapes
in float32 and float16 (the interpreter's bfloat16 ``tl.dot`` is wrong), with 16-token chunks so that short
sequences cross several; on a GPU the same tests run with 64-token chunks, and one more at a real size in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit.ops.baselines.linear as linear
from attnkit.ops.baselines.linear import linear_attention
from tests.helpers import OPERATOR_COUNT_IDS, OPERATOR_COUNT_SHAPES, assert_close, count_aten_ops

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="real sizes need a GPU; the interpreter runs the small cases")
# Triton vs the PyTorch backend on the same inputs. float32: IEEE dots, only summation order separates them. Half
# inputs: the PyTorch backend computes in float32 from the same rounded values, the kernels' dots in tf32.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 1e-2), torch.bfloat16: (5e-3, 1e-2)}
NAMES = ("o", "S", "n", "dq", "dk", "dv", "dS0", "dn0")


def make(B, T, HQ, H, K, V, N=None, dtype=torch.float32, positive=True, device=DEVICE):
    """``(q, k, v, S0, n0)`` drawn in float32 (features ``elu + 1`` unless ``positive`` is false) and cast, so that
    runs in different dtypes see the same values; the state float32, for ``N`` sequences (default ``B``)."""
    N = B if N is None else N
    feature = (lambda x: F.elu(x) + 1) if positive else (lambda x: x)
    q, k = feature(torch.randn(B, T, HQ, K)), feature(torch.randn(B, T, H, K))
    v = torch.randn(B, T, H, V)
    S0, n0 = 0.5 * torch.randn(N, H, V, K), 3 * torch.rand(N, H, K)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)] + [x.to(device) for x in (S0, n0)]


def grads(backend, inputs, with_state=True, seed=1, **kwargs):
    """``(o, S, n, dq, dk, dv[, dS0, dn0])``: the outputs and the gradients of a random projection of all three
    outputs, on fresh leaves of ``inputs``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, S0, n0 = leaves
    state = (S0, n0) if with_state else None
    o, (S, n) = linear_attention(q, k, v, initial_state=state, output_final_state=True, backend=backend, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype) for x in (o, S, n)]
    loss = sum((x.float() * c.float()).sum() for x, c in zip((o, S, n), cotangents, strict=True))
    wrt = leaves if with_state else leaves[:3]
    return (o, S, n, *torch.autograd.grad(loss, wrt))


def check(inputs, dtype, with_state=True, **kwargs):
    actual = grads("triton", inputs, with_state, **kwargs)
    expected = grads("torch", inputs, with_state, **kwargs)
    tol_o, tol_grad = TOL[dtype]
    for name, a, e in zip(NAMES, actual, expected):
        assert a.dtype == e.dtype, name
        assert_close(name, a, e, tol_o if name in ("o", "S", "n") else tol_grad)


# B, T, HQ, H, K, V
CASES = [
    (2, 1, 2, 2, 16, 16),  # one token
    (2, 37, 4, 2, 16, 32),  # GQA, odd length, three chunks
    (1, 50, 4, 1, 32, 16),  # MQA, V != K
    (1, 45, 2, 1, 24, 20),  # head dims not powers of two: masked channels
    (2, 64, 2, 2, 32, 32),  # whole chunks
]


def case_id(case):
    return "B{}-T{}-HQ{}-H{}-K{}-V{}".format(*case)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_torch_backend(case, dtype, normalize):
    check(make(*case, dtype=dtype), dtype, normalize=normalize)


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "nonorm"])
def test_without_initial_state(normalize):
    check(make(2, 37, 4, 2, 16, 32), torch.float32, with_state=False, normalize=normalize)


def test_clamped_normaliser():
    """Signed features with a large ``eps``: many rows' ``nᵀq`` fall below it, where the clamp passes no gradient
    to the normaliser."""
    q, k, v, S0, n0 = make(1, 40, 2, 1, 16, 16, positive=False)
    z = ((n0[:, None, None] + k.cumsum(1)) * q).sum(-1)  # one key/value head: [1, T, HQ]
    assert (z < 0.5).any() and (z >= 0.5).any()
    check((q, k, v, S0, n0), torch.float32, eps=0.5)


@pytest.mark.parametrize(
    "offsets", [[0, 5, 37, 50], [0, 5, 5, 37, 50], [0, 0, 50], [0, 1, 50], [0, 50, 50], [0, 16, 32, 48]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token", "trailing-empty", "whole-chunks"],
)  # fmt: skip
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero-state"])
def test_varlen_matches_torch_backend(offsets, with_state):
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    inputs = make(1, offsets[-1], 4, 2, 16, 32, N=len(offsets) - 1)
    check(inputs, torch.float32, with_state, cu_seqlens=cu)


def test_strided_inputs():
    """The kernels read ``[B, T, H, D]`` through strides: head-major storage and a strided output gradient give the
    contiguous inputs' results."""
    q, k, v, S0, n0 = make(2, 37, 4, 2, 16, 32)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert not strided[0].is_contiguous()
    for name, a, e in zip(NAMES, grads("triton", (*strided, S0, n0)), grads("triton", (q, k, v, S0, n0))):
        assert_close(name, a, e, 1e-6)


def test_gradients_from_the_final_state_only():
    """A loss on the final state alone (the output unused) reaches every input through the reverse state pass."""
    q, k, v, S0, n0 = (x.detach().requires_grad_() for x in make(1, 37, 2, 1, 16, 16))
    results = []
    for backend in ("triton", "torch"):
        _, (S, n) = linear_attention(q, k, v, initial_state=(S0, n0), output_final_state=True, backend=backend)
        results.append(torch.autograd.grad(S.sum() + (n * n).sum(), (q, k, v, S0, n0), allow_unused=True))
    for name, a, e in zip(("dq", "dk", "dv", "dS0", "dn0"), *results):
        if e is None or not e.abs().sum():
            assert a is None or not a.abs().sum(), name
        else:
            assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_sequence(backend):
    q, k, v, S0, n0 = make(2, 0, 2, 1, 16, 16)
    o, (S, n) = linear_attention(q, k, v, initial_state=(S0, n0), output_final_state=True, backend=backend)
    assert o.shape == (2, 0, 2, 16)
    torch.testing.assert_close(S, S0)
    torch.testing.assert_close(n, n0)


def test_opcheck():
    """Dense batches only: with ``cu_seqlens`` the chunk states' spare slots are never written, so two runs differ
    there."""
    from attnkit.ops.baselines.linear_triton.chunk import linear_attn_bwd_op, linear_attn_fwd_op

    q, k, v, S0, n0 = make(1, 19, 4, 2, 16, 16)
    cases = (((S0, n0), True, (True, True)), ((None, None), True, (False, False)), ((S0, n0), False, (False, True)))
    for state, normalize, (with_dst, with_dnt) in cases:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        args = (*leaves, *state, None, normalize, 1e-4)
        torch.library.opcheck(linear_attn_fwd_op, args)
        o, S, n, hs, ns, z = linear_attn_fwd_op(*args)
        assert not hs.requires_grad
        dst, dnt = torch.randn_like(S) if with_dst else None, torch.randn_like(n) if with_dnt else None
        bwd_args = (torch.randn_like(o), q, k, v, o.detach(), hs, ns, z, dst, dnt, None, normalize, 1e-4)
        torch.library.opcheck(linear_attn_bwd_op, bwd_args)


def test_compiles_without_graph_breaks():
    q, k, v, S0, n0 = make(1, 21, 2, 1, 16, 16)

    def f(q, k, v, S0, n0):
        o, (S, n) = linear_attention(q, k, v, initial_state=(S0, n0), output_final_state=True, backend="triton")
        return o * 2, (S, n)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    actual, expected = compiled(q, k, v, S0, n0), f(q, k, v, S0, n0)
    assert_close("o", actual[0], expected[0], 1e-6)
    assert_close("S", actual[1][0], expected[1][0], 1e-6)


@pytest.mark.parametrize("shapes", OPERATOR_COUNT_SHAPES, ids=OPERATOR_COUNT_IDS)
def test_operator_count(shapes):
    """One forward+backward dispatches a handful of PyTorch operators outside the kernels, the same number whatever
    the batch, the length or the packed sequences: nothing loops over heads or sequences in Python, nothing reads a
    length."""
    totals = []
    for B, T, offsets in shapes:
        cu = None if offsets is None else torch.tensor(offsets)
        N = B if cu is None else len(offsets) - 1
        q, k, v, S0, n0 = (x.requires_grad_() for x in make(B, T, 4, 2, 16, 16, N=N))

        def step(q=q, k=k, v=v, S0=S0, n0=n0, cu=cu):
            o, (S, n) = linear_attention(
                q, k, v, initial_state=(S0, n0), output_final_state=True, cu_seqlens=cu, backend="triton"
            )
            (o.sum() + S.sum() + n.sum()).backward()

        counts = count_aten_ops(step)
        totals.append(sum(counts.values()))
        assert totals[-1] <= 40, counts
    assert len(set(totals)) == 1, totals


def test_auto_takes_the_kernels_on_cuda(monkeypatch):
    """``AUTO_TRITON`` is on since the kernels passed their GPU tests: "auto" takes them for CUDA tensors only; off,
    it never takes them."""
    import attnkit.ops.baselines.linear_triton.chunk as chunk

    assert linear.AUTO_TRITON
    calls = []
    monkeypatch.setattr(chunk, "linear_attention_triton", lambda *args: calls.append(args) or (args[0], None))
    q, k, v, _, _ = make(1, 4, 1, 1, 16, 16)
    linear_attention(q, k, v)
    assert len(calls) == (1 if CUDA else 0)
    monkeypatch.setattr(linear, "AUTO_TRITON", False)
    linear_attention(q, k, v)
    assert len(calls) == (1 if CUDA else 0)


def test_triton_refuses_wide_heads_and_float64():
    q, k, v, _, _ = make(1, 4, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="head dims up to 128"):
        linear_attention(q, k, torch.randn(1, 4, 1, 256, device=DEVICE), backend="triton")
    with pytest.raises(ValueError, match="float64"):
        linear_attention(q.double(), k.double(), v.double(), backend="triton")


@needs_cuda
@pytest.mark.parametrize("offsets", [None, [0, 1000, 1000, 2500, 4096]], ids=["dense", "packed"])
@pytest.mark.parametrize("K", [64, 128])
def test_real_size_on_gpu(K, offsets):
    """bf16 at T = 4096 with GQA against the PyTorch backend on the same rounded inputs (which computes in float32),
    dense and packed with an empty sequence."""
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    B, N = (2, 2) if cu is None else (1, len(offsets) - 1)
    inputs = make(B, 4096, 8, 4, K, K, N=N, dtype=torch.bfloat16)
    check(inputs, torch.bfloat16, cu_seqlens=cu)
    check(inputs, torch.bfloat16, normalize=False, cu_seqlens=cu)


@needs_cuda
def test_float32_at_chunk_size_64_on_gpu():
    check(make(2, 200, 4, 2, 64, 64), torch.float32)
    check(make(1, 300, 4, 2, 64, 64, N=3), torch.float32, cu_seqlens=torch.tensor([0, 70, 70, 300], device=DEVICE))
