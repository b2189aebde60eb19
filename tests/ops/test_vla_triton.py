"""VLA's Triton backend (the generalised delta rule in fused kernels, forward and backward) against the PyTorch
backend, and the delta-rule kernels against ``chunk_generalized_delta_rule``.

On CPU the kernels run through Triton's interpreter (``conftest.py``) with 16-token chunks, so a few dozen
tokens cross several chunks; on a GPU the same tests run with 64-token chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.common.delta import chunk_generalized_delta_rule
from attnkit.ops.common.delta_parallel import delta_rule_bwd_op, delta_rule_fwd_op, delta_rule_triton
from attnkit.ops.vla import vla_attention
from attnkit.ops.vla.parallel import (
    gates_chunk_size,
    vla_gates_bwd_op,
    vla_gates_fwd_op,
    vla_gates_triton,
    vla_normalize_bwd_op,
    vla_normalize_fwd_op,
    vla_normalize_triton,
)
from attnkit.ops.vla.torch_impl import vla_chunk_gates
from tests.helpers import (
    OPERATOR_COUNT_IDS,
    OPERATOR_COUNT_SHAPES,
    assert_close,
    full_size_ops_outside_kernels,
    launch_arguments,
    launch_counter,
    recorded_launches,
    rel_rms,
)
from tests.ops.test_vla import make_inputs, make_state

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def grads_of(fn, inputs, state, seed=0):
    """Output, final state and the gradients of every input and state tensor under random cotangents."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    st = [s.detach().clone().requires_grad_() for s in state] if state else None
    o, final = fn(*xs, st)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen).to(o)).sum()
    loss = loss + sum((f * torch.randn(f.shape, generator=gen).to(f)).sum() for f in final)
    gs = torch.autograd.grad(loss, xs + (st or []))
    return (o, *final, *gs)


def vla(backend, **kwargs):
    def fn(q, k, v, u, state):
        return vla_attention(q, k, v, u, initial_state=state, output_final_state=True, backend=backend, **kwargs)

    return fn


def check(actual, expected, tol):
    names = ["o", "S", "A", "n", "dq", "dk", "dv", "du", "dS0", "dA0", "dn0"]
    for name, a, e in zip(names, actual, expected):
        assert_close(name, a, e, tol)


CASES = [  # B, T, H, K, V, with_state, lam0
    (1, 16, 1, 16, 16, False, 0.1),
    (2, 37, 2, 16, 32, False, 0.1),
    (1, 50, 2, 32, 16, True, 0.1),
    (1, 45, 1, 16, 16, True, 0.01),
    (1, 45, 1, 16, 16, False, 10.0),
    (1, 40, 1, 128, 128, True, 0.1),  # the largest head dims: 128-wide sweeps, two value blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-K{}-V{}-state{}-lam{}".format(*c))
def test_matches_torch_backend(case):
    B, T, H, K, V, with_state, lam0 = case
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, H, K, V)]
    state = [s.float().to(DEVICE) for s in make_state(B, H, K, V, lam0)] if with_state else None
    check(grads_of(vla("triton", lam0=lam0), inputs, state), grads_of(vla("torch", lam0=lam0), inputs, state), 1e-4)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_unnormalized_write_matches_torch_backend(with_state):
    """``normalize_write=False`` through the kernels (the gates' forward stores ``a``, the backward skips the
    projection) against the PyTorch backend: outputs, final states, every gradient."""
    B, T, H, K, V = 2, 45, 2, 16, 16
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, H, K, V)]
    state = [s.float().to(DEVICE) for s in make_state(B, H, K, V, 0.1)] if with_state else None
    kwargs = dict(normalize_write=False)
    check(grads_of(vla("triton", **kwargs), inputs, state), grads_of(vla("torch", **kwargs), inputs, state), 1e-4)


@pytest.mark.parametrize("offsets", [[0, 5, 37, 60], [0, 0, 20, 20, 60]], ids=["ragged", "empty"])
def test_varlen_matches_torch_backend(offsets):
    inputs = [x.float().to(DEVICE) for x in make_inputs(1, offsets[-1], 2, 16, 16)]
    cu = torch.tensor(offsets, device=DEVICE)
    actual = grads_of(vla("triton", cu_seqlens=cu), inputs, None)
    expected = grads_of(vla("torch", cu_seqlens=cu), inputs, None)
    check(actual, expected, 1e-4)


VARLEN_CASES = {  # offsets, with_state, normalize_output, normalize_write
    "odd-lengths-state": ([0, 1, 34, 35, 70], True, True, True),
    "empty-first-middle-last-state": ([0, 0, 33, 33, 61, 61], True, True, True),
    "one-sequence-state-nonorm": ([0, 45], True, False, True),
    "ragged-raw-write": ([0, 3, 40, 59], False, True, False),
}


@pytest.mark.parametrize("case", VARLEN_CASES.values(), ids=VARLEN_CASES.keys())
def test_packed_sequences_in_one_launch_match_torch_backend(case):
    """Packed sequences through the single-launch kernels (every sequence its own recurrence, its own row of
    ``initial_state`` and of the final state; empty sequences pass their state through) against the PyTorch
    backend, which runs each sequence separately: outputs, final states and every gradient."""
    offsets, with_state, normalize_output, normalize_write = case
    H, K, V = 2, 16, 24
    inputs = [x.float().to(DEVICE) for x in make_inputs(1, offsets[-1], H, K, V)]
    state = [s.float().to(DEVICE) for s in make_state(len(offsets) - 1, H, K, V, 0.1)] if with_state else None
    kwargs = dict(cu_seqlens=torch.tensor(offsets, device=DEVICE), normalize_output=normalize_output)
    kwargs["normalize_write"] = normalize_write
    check(grads_of(vla("triton", **kwargs), inputs, state), grads_of(vla("torch", **kwargs), inputs, state), 1e-4)


COLUMN_CASES = {  # B, offsets, K, with_state, normalize_write
    "dense-K48-state": (2, None, 48, True, True),
    "packed-K40-raw-write": (1, [0, 3, 40, 59], 40, False, False),
}


@pytest.mark.parametrize("columns", [16, 32, 64])
@pytest.mark.parametrize("case", COLUMN_CASES.values(), ids=COLUMN_CASES.keys())
def test_gate_backward_in_column_blocks(monkeypatch, columns, case):
    """The gate backward as two launches over column blocks (``gates.BWD_COLUMNS``, 64 by default: padded ``K``, a
    partial last block, packed sequences, the raw write) gives the one-program kernel's gradients and the PyTorch
    backend's."""
    import attnkit.ops.vla.triton.gates as gates

    B, offsets, K, with_state, normalize_write = case
    T = 45 if offsets is None else offsets[-1]
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, 2, K, 16)]
    N = B if offsets is None else len(offsets) - 1
    state = [s.float().to(DEVICE) for s in make_state(N, 2, K, 16, 0.1)] if with_state else None
    kwargs = dict(normalize_write=normalize_write)
    if offsets is not None:
        kwargs["cu_seqlens"] = torch.tensor(offsets, device=DEVICE)
    monkeypatch.setattr(gates, "BWD_COLUMNS", None)
    one = grads_of(vla("triton", **kwargs), inputs, state)
    launches = []
    monkeypatch.setattr(gates, "BWD_COLUMNS", columns)
    for name in ("vla_gates_bwd_kernel", "vla_gates_bwd_g_kernel", "vla_gates_bwd_u_kernel"):
        kernel = getattr(gates, name)
        monkeypatch.setattr(
            kernel, "run", lambda *a, _run=kernel.run, _name=name, **k: launches.append(_name) or _run(*a, **k)
        )
    split = grads_of(vla("triton", **kwargs), inputs, state)
    assert launches == ["vla_gates_bwd_g_kernel", "vla_gates_bwd_u_kernel"]
    check(split, one, 1e-5)
    check(split, grads_of(vla("torch", **kwargs), inputs, state), 1e-4)


def test_packed_sequences_launch_each_kernel_once(monkeypatch):
    """Two packed sequences run the gates, the delta rule and the normaliser once each, forward and backward, and
    nothing reads the device back (no ``.item()`` or ``.tolist()``)."""
    import attnkit.ops.vla.parallel as parallel

    calls = []
    for name in ("vla_write_fwd_fn", "vla_write_bwd_fn", "normalize_fwd_fn", "normalize_bwd_fn"):
        real = getattr(parallel, name)
        monkeypatch.setattr(parallel, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    import attnkit.ops.common.delta_parallel as delta_parallel

    for name in ("delta_fwd_fn", "delta_bwd_fn"):
        real = getattr(delta_parallel, name)
        monkeypatch.setattr(
            delta_parallel, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw)
        )

    def no_sync(*args, **kwargs):
        raise AssertionError("read the device")

    inputs = [x.float().to(DEVICE).requires_grad_() for x in make_inputs(1, 50, 2, 16, 16)]
    cu = torch.tensor([0, 20, 50], device=DEVICE)
    with monkeypatch.context() as m:
        for name in ("item", "tolist"):
            m.setattr(torch.Tensor, name, no_sync)
        o, _ = parallel.vla_triton(*inputs, 0.1, 1e-4, True, True, None, cu)
        o.sum().backward()
    assert sorted(calls) == sorted(
        ["vla_write_fwd_fn", "vla_write_bwd_fn", "normalize_fwd_fn", "normalize_bwd_fn", "delta_fwd_fn", "delta_bwd_fn"]
    )


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on the CPU, under the interpreter")
@pytest.mark.parametrize("shapes", OPERATOR_COUNT_SHAPES, ids=OPERATOR_COUNT_IDS)
def test_operator_count(shapes):
    """One forward+backward dispatches at most 30 PyTorch operators outside the Triton kernels (leaf ATen operators
    that do work, :func:`tests.helpers.count_aten_ops`), and the same number whatever the batch, the length or the
    packed sequences, with no read of the device (``_local_scalar_dense``): nothing loops over sequences or chunks
    in Python."""
    from tests.helpers import count_aten_ops

    totals = []
    for B, T, offsets in shapes:
        leaves = [x.float().requires_grad_() for x in make_inputs(B, T, 2, 16, 16)]
        cu = None if offsets is None else torch.tensor(offsets)
        do = torch.randn(B, T, 2, 16)

        def step(leaves=leaves, cu=cu, do=do):
            vla_attention(*leaves, cu_seqlens=cu, backend="triton")[0].backward(do)

        counts = count_aten_ops(step)
        totals.append(sum(counts.values()))
        assert totals[-1] <= 30 and "_local_scalar_dense" not in counts, counts
    assert len(set(totals)) == 1, totals


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on the CPU, under the interpreter")
def test_operator_count_with_state():
    """With an initial state and the final state's gradients too (``A_init`` is inverted in float64, in PyTorch, and
    validated), the count is still at most 30 and the same, dense or packed."""
    from tests.helpers import count_aten_ops

    totals = []
    for B, T, offsets in [(2, 40, None), (3, 170, None), (1, 100, [0, 7, 7, 100]), (1, 170, [0, 1, 60, 60, 170])]:
        leaves = [x.float().requires_grad_() for x in make_inputs(B, T, 2, 16, 16)]
        cu = None if offsets is None else torch.tensor(offsets)
        N = B if offsets is None else len(offsets) - 1
        state = [s.float().requires_grad_() for s in make_state(N, 2, 16, 16, 0.1)]
        do = torch.randn(B, T, 2, 16)

        def step(leaves=leaves, cu=cu, state=state, do=do):
            o, final = vla_attention(
                *leaves, cu_seqlens=cu, initial_state=state, output_final_state=True, backend="triton"
            )
            torch.autograd.backward([o, *final], [do, *(torch.ones_like(f) for f in final)])

        counts = count_aten_ops(step)
        totals.append(sum(counts.values()))
        assert totals[-1] <= 30, counts
    assert len(set(totals)) == 1, totals


def fused(*xs):
    """``[B, T, H, ·]`` tensors (and ``[B, T, H]`` ones) of one dtype as slices of one fused projection
    ``[B, T, Σ H·d]``, the way a layer's ``qkv`` projection hands them over: strided views whose tokens lie
    ``Σ H·d`` apart."""
    B, T = xs[0].shape[:2]
    whole = torch.cat([x.reshape(B, T, -1) for x in xs], -1)
    views, start = [], 0
    for x in xs:
        width = x[0, 0].numel()
        views.append(whole[..., start : start + width].view(x.shape))
        start += width
    assert not any(v.is_contiguous() for v in views)
    return views


def deltanet_inputs(B, T, H, K, V, dtype=torch.float32):
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = 0.5 + 1.49 * torch.rand(B, T, H, generator=gen)
    return [x.to(dtype).to(DEVICE) for x in (q, k, v)] + [beta.to(DEVICE)]


STRIDED_CASES = {  # B, T, cu_seqlens, with_state
    "odd-length-state": (2, 37, None, True),
    "odd-length": (3, 21, None, False),
    "ragged-empty-state": (1, 61, [0, 0, 13, 13, 61], True),
    "ragged-one-token": (1, 45, [0, 1, 30, 45], False),
}


@pytest.mark.parametrize("case", STRIDED_CASES.values(), ids=STRIDED_CASES.keys())
def test_strided_vla_matches_torch_backend(case):
    """``q, k, v, u`` as slices of one fused projection (no copy on the way in): the kernels read them through their
    strides and match the PyTorch backend in the output, the final states and every gradient, dense and packed."""
    B, T, offsets, with_state = case
    H, K, V = 2, 16, 24
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, H, K, V)]
    N = B if offsets is None else len(offsets) - 1
    state = [s.float().to(DEVICE) for s in make_state(N, H, K, V, 0.1)] if with_state else None
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)

    def fn(backend):
        def run(q, k, v, u, st):
            return vla(backend, cu_seqlens=cu)(*fused(q, k, v, u), st)

        return run

    check(grads_of(fn("triton"), inputs, state), grads_of(fn("torch"), inputs, state), 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", STRIDED_CASES.values(), ids=STRIDED_CASES.keys())
def test_strided_deltanet_matches_torch_backend(case, dtype):
    """DeltaNet's ``q, k, v`` and ``beta`` as slices of one fused projection, read in their own dtype (``scale·q`` and
    ``β k`` formed in the kernels), against the PyTorch backend: output, final state, every gradient (``dbeta``
    included), dense and packed, float16 at the bar of the other half-precision tests."""
    from attnkit.ops import delta_rule

    B, T, offsets, with_state = case
    H, K, V = 2, 16, 80  # two value blocks: the gradients' shares summed by a kernel
    inputs = deltanet_inputs(B, T, H, K, V, dtype)
    N = B if offsets is None else len(offsets) - 1
    state = [torch.randn(N, H, V, K, device=DEVICE)] if with_state else None
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)

    def fn(backend):
        def run(q, k, v, beta, st):
            kwargs = dict(initial_state=st and st[0], output_final_state=True, cu_seqlens=cu, backend=backend)
            o, S = delta_rule(*fused(q, k, v), fused(beta, beta)[0], scale=0.3, **kwargs)
            return o, (S,)

        return run

    actual, expected = grads_of(fn("triton"), inputs, state), grads_of(fn("torch"), inputs, state)
    assert actual[0].dtype == dtype
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dS0"], actual, expected):
        assert x.dtype == y.dtype, name
        assert_close(name, x, y, 1e-4 if dtype == torch.float32 else 5e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="profiled on the CPU, under the interpreter")
@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 40]], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("op", ["vla", "deltanet"])
def test_no_copies_outside_the_kernels(op, dtype, offsets):
    """A forward+backward on slices of a fused projection dispatches no copy, cast, transpose or product of a
    ``[B, T, H, D]``-sized tensor outside the kernels: they read the inputs through their strides in their own
    dtypes and write ``o`` and the gradients in the callers' layout and dtypes. (Before, every input was transposed
    to ``[B, H, T, D]`` and widened, DeltaNet's ``scale·q`` and ``β k`` were products, and ``o`` and the gradients
    went back the same way.) What remains for VLA is autograd summing the gradients of ``q``, ``k`` and ``k̂``, which
    reach each of them from two of its operators."""
    from attnkit.ops import delta_rule

    B, T, H, D = (2, 40, 2, 16) if offsets is None else (1, 40, 2, 16)
    if op == "vla":
        q, k, v, u = (x.float() for x in make_inputs(B, T, H, D, D))
        leaves = [x.to(dtype) for x in (q, k, v)] + [u]
    else:
        leaves = deltanet_inputs(B, T, H, D, D, dtype)
    # The slices themselves are the leaves: the profile holds the op's own work, not the fused buffer's backward.
    views = fused(*leaves[:3]) + [fused(leaves[3], leaves[3])[0]]  # beta (u) float32 beside them
    views = [x.detach().requires_grad_() for x in views]
    do = torch.randn(B, T, H, D, dtype=dtype)
    cu = None if offsets is None else torch.tensor(offsets)
    run = vla_attention if op == "vla" else delta_rule

    def step():
        torch.autograd.grad(run(*views, cu_seqlens=cu, backend="triton")[0], views, do)

    counts = full_size_ops_outside_kernels(step, B * T * H * D)
    assert counts == ({"add": 3} if op == "vla" else {}), counts


def test_packed_delta_rule_kernels_match_each_sequence():
    """The delta-rule kernels on packed sequences (``cu_seqlens``; empty ones, partial chunks, two value blocks)
    against ``chunk_generalized_delta_rule`` on each sequence alone: outputs, final states, every gradient."""
    offsets = [0, 0, 7, 40, 40, 75]
    H, K, V = 2, 16, 80
    q, k, v, a = delta_inputs(1, H, offsets[-1], K, V, deltanet=True)
    S0 = torch.randn(len(offsets) - 1, H, V, K, device=DEVICE)
    cu = torch.tensor(offsets, device=DEVICE)

    def packed(q, k, v, a, st):
        o, S = delta_rule_triton(*bthd(q, k, v, a), st[0], False, cu)
        return o.transpose(1, 2), (S,)

    def per_sequence(q, k, v, a, st):
        outs, states = [], []
        for i, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            xs = [x[:, :, bos:eos] for x in (q, k, v, a)]
            o, S = chunk_generalized_delta_rule(*xs, st[0][i : i + 1], 16) if eos > bos else (xs[2], st[0][i : i + 1])
            outs.append(o)
            states.append(S)
        return torch.cat(outs, 2), (torch.cat(states, 0),)

    actual, expected = grads_of(packed, [q, k, v, a], [S0]), grads_of(per_sequence, [q, k, v, a], [S0])
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], actual, expected):
        assert_close(name, x, y, 1e-4)


def test_deltanet_packed_sequences_in_one_launch():
    """DeltaNet's kernels take packed sequences in one launch too: empty sequences (first and between), partial
    chunks and an initial state per sequence, against its PyTorch path (which runs each sequence alone)."""
    from attnkit.ops import delta_rule

    T, H, K, V = 45, 2, 16, 16
    q, k, v = torch.randn(1, T, H, K), F.normalize(torch.randn(1, T, H, K), dim=-1), torch.randn(1, T, H, V)
    beta = 0.5 + 1.49 * torch.rand(1, T, H)
    cu = torch.tensor([0, 0, 20, 20, T], device=DEVICE)

    def fn(backend):
        def run(q, k, v, beta, state):
            kwargs = dict(initial_state=state[0], output_final_state=True, cu_seqlens=cu, backend=backend)
            o, S = delta_rule(q, k, v, beta, **kwargs)
            return o, (S,)

        return run

    inputs = [x.to(DEVICE) for x in (q, k, v, beta)]
    S0 = [torch.randn(4, H, V, K, device=DEVICE)]
    actual, expected = grads_of(fn("triton"), inputs, S0), grads_of(fn("torch"), inputs, S0)
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dS0"], actual, expected):
        assert_close(name, x, y, 1e-4)


def test_gradients_through_the_final_state_alone():
    """A loss on the final state only (the output unused): the kernels' backward gets no output gradient (unused
    outputs are not materialised as zeros) and must still match the PyTorch backend."""
    inputs = [x.float().to(DEVICE) for x in make_inputs(1, 40, 2, 16, 16)]

    def grads(backend):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        _, (S, A, n) = vla_attention(*xs, output_final_state=True, backend=backend)
        return torch.autograd.grad(S.sum() + A.pow(2).sum() + n.sum(), xs, allow_unused=True, materialize_grads=True)

    for name, x, y in zip(["dq", "dk", "dv", "du"], grads("triton"), grads("torch")):
        assert_close(name, x, y, 1e-4)


def test_half_inputs():
    inputs = [x.float().to(DEVICE) for x in make_inputs(2, 40, 2, 16, 16)]
    half = [x.half() for x in inputs[:3]] + [inputs[3]]
    actual = grads_of(vla("triton"), half, None)
    expected = grads_of(vla("torch"), half, None)
    assert actual[0].dtype == torch.float16
    check(actual, expected, 5e-3)


def bthd(*xs):
    """``[B, H, T, ·]`` tensors as the kernels' ``[B, T, H, ·]`` views (strided: nothing is copied)."""
    return [x.transpose(1, 2) for x in xs]


def delta_triton_fn(q, k, v, a, st):
    """The delta-rule kernels on ``[B, H, T, ·]`` inputs (``st``: None or ``[S_0]``), as :func:`grads_of` takes them."""
    o, S = delta_rule_triton(*bthd(q, k, v, a), None if st is None else st[0])
    return o.transpose(1, 2), (S,)


def delta_torch_fn(q, k, v, a, st):
    """The PyTorch rule in chunks of 16, as :func:`delta_triton_fn`."""
    o, S = chunk_generalized_delta_rule(q, k, v, a, None if st is None else st[0], 16)
    return o, (S,)


def delta_inputs(B, H, T, K, V, deltanet=False):
    q = torch.randn(B, H, T, K, device=DEVICE)
    k = F.normalize(torch.randn(B, H, T, K, device=DEVICE), dim=-1)
    v = torch.randn(B, H, T, V, device=DEVICE)
    if deltanet:  # DeltaNet: a = beta k with beta near 2, the eigenvalue 1 - beta near -1
        a = k * (1.99 + 0.01 * torch.rand(B, H, T, 1, device=DEVICE))
    else:
        a = F.normalize(torch.randn(B, H, T, K, device=DEVICE), dim=-1)
    return [q, k, v, a]


@pytest.mark.parametrize(
    "K, V", [(16, 32), (16, 80), (128, 128)], ids=["K16-V32", "K16-V80-two-value-blocks", "K128-V128"]
)
@pytest.mark.parametrize("deltanet", [False, True], ids=["generic", "deltanet-beta-near-2"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_delta_rule_kernels_match_torch(deltanet, with_state, K, V):
    B, H, T = 2, 2, 53
    inputs = delta_inputs(B, H, T, K, V, deltanet)
    state = [torch.randn(B, H, V, K, device=DEVICE)] if with_state else None

    actual, expected = grads_of(delta_triton_fn, inputs, state), grads_of(delta_torch_fn, inputs, state)
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], actual, expected):
        assert_close(name, x, y, 1e-4)


@pytest.mark.parametrize("deltanet", [False, True], ids=["generic", "deltanet-beta-near-2"])
def test_state_passes_in_narrower_blocks(monkeypatch, deltanet):
    """``delta_fwd.STATE_BV`` / ``STATE_STAGES``: the forward's and the backward's state passes in 16-column value
    blocks (two programs a sequence and head at V = 32, where every other kernel takes one 32-column block) and on two
    stages give the default launch's output, final state and every gradient, and match the PyTorch rule."""
    from attnkit.ops.common.triton import delta_fwd

    B, H, T, K, V = 2, 2, 53, 16, 32
    inputs = delta_inputs(B, H, T, K, V, deltanet)
    state = [torch.randn(B, H, V, K, device=DEVICE)]

    default = grads_of(delta_triton_fn, inputs, state)
    monkeypatch.setattr(delta_fwd, "STATE_BV", 16)
    monkeypatch.setattr(delta_fwd, "STATE_STAGES", 2)
    launches = launch_counter(monkeypatch, delta_fwd, "delta_fwd_state_kernel")
    narrow = grads_of(delta_triton_fn, inputs, state)
    assert [grid[0] for grid in launches] == [2]  # two 16-column blocks

    expected = grads_of(delta_torch_fn, inputs, state)
    for name, x, d, y in zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], narrow, default, expected):
        assert_close(name, x, d, 1e-6)
        assert_close(name, x, y, 1e-4)


@pytest.mark.parametrize("sms", [132, 4], ids=["few-programs", "full-device"])
def test_state_passes_narrow_where_few_programs(monkeypatch, sms):
    """Without ``STATE_BV``, the state passes narrow to 16-column value blocks where the default launch would fill
    at most a quarter of the device's multiprocessors (``delta_fwd.multiprocessors``, 0 under the interpreter,
    stubbed here): two sequence-head programs of one 32-column block take two 16-column blocks on 132
    multiprocessors, one block on 4; the same numbers either way."""
    from attnkit.ops.common.triton import delta_fwd

    inputs = delta_inputs(1, 2, 37, 16, 32, True)
    state = [torch.randn(1, 2, 32, 16, device=DEVICE)]

    default = grads_of(delta_triton_fn, inputs, state)
    monkeypatch.setattr(delta_fwd, "multiprocessors", lambda device: sms)
    launches = launch_counter(monkeypatch, delta_fwd, "delta_fwd_state_kernel")
    chosen = grads_of(delta_triton_fn, inputs, state)
    assert [grid[0] for grid in launches] == [2 if sms == 132 else 1]
    for name, x, d in zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], chosen, default):
        assert_close(name, x, d, 1e-6)


def test_state_blocks_keep_their_width_at_wide_keys(monkeypatch):
    """At ``K > 64`` the state passes keep their width however few the programs (16-column blocks hit an illegal
    memory access at K = 128 on the H200), and ``STATE_BV`` below 32 there is refused by name."""
    from attnkit.ops.common.triton import delta_fwd

    monkeypatch.setattr(delta_fwd, "multiprocessors", lambda device: 132)
    CPU, dims = torch.device("cpu"), dict(K=128, V=128)
    assert delta_fwd.state_launch(64, dims, 1, CPU, torch.bfloat16)[0] == 64
    assert delta_fwd.state_launch(64, dict(K=64, V=128), 1, CPU, torch.bfloat16)[0] == 16
    monkeypatch.setattr(delta_fwd, "STATE_BV", 16)
    with pytest.raises(ValueError, match="STATE_BV"):
        delta_fwd.state_launch(64, dims, 1, CPU, torch.bfloat16)
    monkeypatch.setattr(delta_fwd, "STATE_BV", 32)
    assert delta_fwd.state_launch(64, dims, 1, CPU, torch.bfloat16)[0] == 32


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_passes_prefetch(monkeypatch, packed):
    """``delta_fwd.STATE_PREFETCH``: the state passes read each chunk's tiles during the chunk before (the forward
    left to right, the backward right to left): with neither, the forward's (the default) and both, the same output,
    final state and every gradient, bit for bit, and the PyTorch rule's; dense (an odd length, a partial last chunk,
    an initial state) and packed (empty sequences first and between, partial chunks, two value blocks)."""
    from attnkit.ops.common.triton import delta_fwd

    offsets = [0, 0, 7, 40, 40, 75] if packed else None
    B, H, T, K, V = (1, 2, 75, 16, 80) if packed else (2, 2, 53, 16, 32)
    inputs = delta_inputs(B, H, T, K, V, deltanet=True)
    state = [torch.randn(len(offsets) - 1 if packed else B, H, V, K, device=DEVICE)]
    cu = torch.tensor(offsets, device=DEVICE) if packed else None

    def run(q, k, v, a, st):
        o, S = delta_rule_triton(*bthd(q, k, v, a), st[0], False, cu)
        return o.transpose(1, 2), (S,)

    monkeypatch.setattr(delta_fwd, "STATE_PREFETCH", False)
    plain = grads_of(run, inputs, state)
    expected = grads_of(delta_torch_fn, inputs, state) if not packed else None
    for setting in ("forward", True):
        monkeypatch.setattr(delta_fwd, "STATE_PREFETCH", setting)
        prefetched = grads_of(run, inputs, state)
        for i, (name, x, d) in enumerate(zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], prefetched, plain)):
            assert torch.equal(x, d), (setting, name)
            if expected is not None:
                assert_close(name, x, expected[i], 1e-4)
    CPU, dims = torch.device("cpu"), dict(K=16, V=32)
    for setting, passes in (("forward", (True, False)), (True, (True, True)), (False, (False, False))):
        monkeypatch.setattr(delta_fwd, "STATE_PREFETCH", setting)
        launched = [delta_fwd.state_launch(32, dims, 4, CPU, torch.float32, backward=b)[1] for b in (False, True)]
        assert tuple(launch["PREFETCH"] for launch in launched) == passes, setting


@pytest.mark.parametrize("prefetch", [False, True], ids=["in-step", "prefetched"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_state_pass_local_du(monkeypatch, packed, prefetch):
    """``delta_bwd.LOCAL_DU``: the chunk-parallel kernel writes ``triu(A Qᵀ) dO`` into ``du`` and ``Qᵀ dO`` into
    ``dhs``, and the backward's state pass reads them (in the step, or a chunk ahead with the backward's prefetch)
    where it computed them: the same output, final state and every gradient as the pass that computes them, dense in
    DeltaNet's form (``a = β k`` from ``beta`` near 2, queries scaled; an odd length, a partial last chunk, an initial
    state) and packed (generic ``a``; empty sequences first and between, partial chunks, two value blocks, a
    state-pass block narrower than the local kernel's). Under the interpreter (exact dots) bit for bit. On a GPU the
    two forms are different compiled kernels, so their float32 sums may round apart: there the local form runs twice
    and its runs agree bit for bit (a race shows as run-to-run differences), and every output is within 2e-6 of the
    computing form's, relative to its largest entry (a wrong read is far larger)."""
    from attnkit.ops.common.triton import delta_bwd, delta_fwd
    from benchmarks.delta_local_du_probe import local_du_case  # (it imports this module: here, not at the top)

    inputs, state, run = local_du_case(packed)
    monkeypatch.setattr(delta_fwd, "STATE_PREFETCH", True if prefetch else "forward")
    if packed:
        monkeypatch.setattr(delta_fwd, "STATE_BV", 16)
    monkeypatch.setattr(delta_bwd, "LOCAL_DU", False)
    computed = grads_of(run, inputs, state)
    launches = launch_counter(monkeypatch, delta_bwd, "delta_bwd_local_kernel")
    monkeypatch.setattr(delta_bwd, "LOCAL_DU", True)
    local = grads_of(run, inputs, state)
    assert len(launches) == 1
    names = ["o", "S", "dq", "dk", "dv", "da", "dS0"]
    if DEVICE == "cpu":  # the interpreter's dots are exact: the two forms agree bit for bit
        for name, x, c in zip(names, local, computed):
            assert torch.equal(x, c), name
    else:
        # Measured on an H100 (torch 2.11, Triton 3.6, thirty-sixth session; benchmarks/delta_local_du_probe.py):
        # each form bit-identical run to run; dense-prefetched's forms a few float32 ulps apart (largest relative
        # differences dk 3.8e-7, dv 3.0e-7, da 4.0e-7, dS0 2.9e-7; o, S, dq equal), the other three cases bit-equal.
        again = grads_of(run, inputs, state)
        for name, x, y, c in zip(names, local, again, computed):
            assert torch.equal(x, y), name  # a race in the local form shows as run-to-run differences
            assert (x - c).abs().max() <= 2e-6 * c.abs().max(), name
    assert computed[5].abs().sum() > 0  # the gradient reaches a (beta)


@pytest.mark.parametrize("sms", [132, 8], ids=["few-programs", "device-full"])
def test_local_du_where_the_state_pass_launches_few_programs(monkeypatch, sms):
    """``delta_bwd.LOCAL_DU = None`` (the default) computes the state-free terms chunk-parallel exactly where the
    state passes launch at most a quarter of the multiprocessors (``few_state_programs``; 4 sequence-head programs
    here): on 132 multiprocessors (the chain of chunk steps is the time: 4.55 against 4.85 ms at T = 32k, B = 1 on an
    H100) and not on 8 (4 programs fill half of them: the extra kernel cost 6 % at T = 2k, B = 16), with the
    same gradients either way."""
    from attnkit.ops.common.triton import delta_bwd, delta_fwd

    monkeypatch.setattr(delta_fwd, "multiprocessors", lambda device: sms)
    inputs = delta_inputs(2, 2, 40, 16, 32)

    def run(q, k, v, a, st):
        q, k, v, a = bthd(q, k, v, a)
        o, S = delta_rule_triton(q, k, v, a, st[0], False, None)
        return o.transpose(1, 2), (S,)

    state = [torch.randn(2, 2, 32, 16, device=DEVICE)]
    launches = launch_counter(monkeypatch, delta_bwd, "delta_bwd_local_kernel")
    chosen = grads_of(run, inputs, state)
    assert len(launches) == (1 if sms == 132 else 0)
    monkeypatch.setattr(delta_bwd, "LOCAL_DU", sms != 132)  # the other choice
    for name, x, c in zip(["o", "S", "dq", "dk", "dv", "da", "dS0"], grads_of(run, inputs, state), chosen):
        assert torch.equal(x, c), name


def test_state_16bit_operands_skip_narrow_blocks(monkeypatch):
    """``STATE_16BIT`` rounds the state passes' operands on blocks of 32 columns or more only: on 16-column blocks
    (the narrow launch of few programs) the H200 hit an illegal memory access, so those keep float32 operands."""
    from attnkit.ops.common.triton import delta_fwd

    monkeypatch.setattr(delta_fwd, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(delta_fwd, "STATE_16BIT", True)
    CPU, dims = torch.device("cpu"), dict(K=64, V=64)
    bv, launch = delta_fwd.state_launch(64, dims, 1, CPU, torch.bfloat16)
    assert bv == 16 and launch["LOW"] == ""
    assert delta_fwd.state_launch(64, dims, 256, CPU, torch.bfloat16)[1]["LOW"] == "bf16"
    assert delta_fwd.state_launch(64, dims, 256, CPU, torch.float16)[1]["LOW"] == "fp16"
    assert delta_fwd.state_launch(64, dims, 256, CPU, torch.float32)[1]["LOW"] == ""


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_state_passes_on_16bit_operands(monkeypatch, with_state):
    """``delta_fwd.STATE_16BIT``: with float16 inputs the state passes multiply float16 operands (the state, W and U
    rounded for each product): DeltaNet with ``beta`` near 2 over four chunks within the 16-bit bars of the float32
    PyTorch rule on the same rounded inputs, and not the float32-operand launch's numbers (the rounding is there);
    float32 inputs keep float32 operands."""
    from attnkit.ops.common.triton import delta_fwd

    monkeypatch.setattr(delta_fwd, "STATE_BV", 32)  # 16-bit operands take blocks of 32 columns or more
    inputs = delta_inputs(1, 2, 120, 16, 32, True)
    half = [x.half() for x in inputs[:3]] + [inputs[3]]
    state = [torch.randn(1, 2, 32, 16, device=DEVICE)] if with_state else None

    wide = grads_of(delta_triton_fn, half, state)
    floats = grads_of(delta_triton_fn, inputs, state)
    monkeypatch.setattr(delta_fwd, "STATE_16BIT", True)
    narrow = grads_of(delta_triton_fn, half, state)
    expected = grads_of(delta_torch_fn, [x.float() for x in half], state)
    names = ["o", "S", "dq", "dk", "dv", "da", "dS0"]
    for name, x, y in zip(names, narrow, expected):
        assert_close(name, x.float(), y, 5e-3 if name == "o" else 1e-2)
    assert any(not torch.equal(x, y) for x, y in zip(narrow, wide))
    assert all(torch.equal(x, y) for x, y in zip(grads_of(delta_triton_fn, inputs, state), floats))


def gate_inputs(B, H, NC, K, lam0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    C = gates_chunk_size()
    k_hat = F.normalize(torch.randn(B, H, NC * C, K, generator=gen, dtype=torch.float64), dim=-1)
    u = F.normalize(torch.randn(B, H, NC * C, K, generator=gen, dtype=torch.float64), dim=-1) / K**0.5
    return k_hat, u


@pytest.mark.parametrize(
    "K, lam0, with_state",
    [(16, 0.1, False), (48, 0.01, False), (32, 10.0, True), (16, 0.1, True)],
    ids=["K16", "K48-padded-lam0.01", "K32-lam10-state", "K16-state"],
)
def test_gate_kernels_match_torch_gates(K, lam0, with_state):
    """The gate kernels alone (write directions and final ``A``, and the gradients of ``k̂``, ``u``, ``A_init``)
    against the batched-Cholesky gates of the PyTorch backend, in float64 as the reference."""
    B, H, NC = 2, 2, 3
    k_hat, u = gate_inputs(B, H, NC, K, lam0)
    state = [make_state(B, H, K, 4, lam0)[1]] if with_state else None
    C = gates_chunk_size()

    def run(fn, k_hat, u, st):
        alpha, A_end = fn(k_hat, u, lam0, None if st is None else st[0], C)
        return alpha, (A_end,)

    def triton_fn(k_hat, u, st):
        alpha, A_end = run(vla_gates_triton, *bthd(k_hat, u), st)
        return alpha.transpose(1, 2), A_end

    def torch_fn(k_hat, u, st):
        return run(vla_chunk_gates, k_hat, u, st)

    on_device = [x.float().to(DEVICE) for x in (k_hat, u)]
    actual = grads_of(triton_fn, on_device, state and [state[0].float().to(DEVICE)])
    expected = grads_of(torch_fn, [k_hat, u], state)
    names = ["alpha", "A_end", "dk_hat", "du", "dA_init"]
    for name, x, y in zip(names, actual, expected):
        assert_close(name, x.double().cpu(), y, 1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gate_kernels_ignore_autocast(dtype):
    """The Gram sums that the gate kernels invert, and the final inverse, are float32 under autocast: the same bits
    as without it."""
    k_hat, u = bthd(*(x.float().to(DEVICE) for x in gate_inputs(1, 2, 3, 16, 0.1)))
    expected = vla_gates_triton(k_hat, u, 0.1, None, gates_chunk_size())
    with torch.autocast(DEVICE, dtype=dtype):
        actual = vla_gates_triton(k_hat, u, 0.1, None, gates_chunk_size())
    for name, x, y in zip(("alpha", "A_end"), actual, expected, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y), name


@pytest.mark.parametrize("group", [2, 3, 8])
def test_gate_groups_carry_the_inverse(group):
    """Chunks grouped per program and 16-row downdate blocks (``A`` carried by ``A − R_bᵀR_b`` instead of a sweep
    per chunk, with a partial last group) give what one program per chunk and one block per chunk give."""
    from attnkit.ops.vla.triton.gates import vla_gates_fwd_fn

    B, H, NC, K = 1, 2, 4, 32
    k_hat, u = (x.float().to(DEVICE) for x in gate_inputs(B, H, NC, K, 0.1))
    C = gates_chunk_size()
    U = u.reshape(B, H, NC, C, K)
    prefix = torch.cat([torch.zeros_like(U[:, :, :1, :1]).expand(B, H, 1, K, K), (U.mT @ U).cumsum(2)[:, :, :-1]], 2)
    lam = (0.1 * torch.eye(K, device=DEVICE) + prefix).contiguous()
    precision = "ieee" if DEVICE == "cpu" else "tf32x3"
    k_hat, u = (x.transpose(1, 2).contiguous() for x in (k_hat, u))
    one = vla_gates_fwd_fn(k_hat, u, lam, C, precision, dict(num_warps=4, num_stages=1, GROUP=1, SB=C))
    grouped = vla_gates_fwd_fn(k_hat, u, lam, C, precision, dict(num_warps=4, num_stages=1, GROUP=group, SB=16))
    for name, x, y in zip(["alpha", "A0", "R", "anorm"], grouped, one):
        assert_close(name, x, y, 1e-5)


def test_normalize_kernels_match_torch():
    """The normaliser kernels against its PyTorch form, with denominators on both sides of ``eps`` (signed
    features, so the clamp's zero gradient is exercised), a partial last chunk, ``n0`` and ``dn_T``."""
    B, H, T, K, V, eps = 2, 3, 37, 16, 24, 0.05
    gen = torch.Generator().manual_seed(0)
    r, q, k = (torch.randn(B, H, T, d, generator=gen).to(DEVICE) for d in (V, K, K))
    k = k / K
    n0 = torch.randn(B, H, K, generator=gen).to(DEVICE)

    def torch_fn(r, q, k, st):
        n = st[0].unsqueeze(2) + k.cumsum(2)
        den = (n * q).sum(-1, keepdim=True)
        assert (den < eps).any() and (den > eps).any()
        return (r / den.clamp_min(eps)).transpose(1, 2), (n[:, :, -1],)

    def triton_fn(r, q, k, st):
        o, n_end = vla_normalize_triton(*bthd(r, q, k), st[0], eps)
        return o, (n_end,)

    actual, expected = grads_of(triton_fn, [r, q, k], [n0]), grads_of(torch_fn, [r, q, k], [n0])
    for name, x, y in zip(["o", "n_T", "dr", "dq", "dk", "dn0"], actual, expected):
        assert_close(name, x, y, 1e-4)  # float32, as every kernel-vs-PyTorch check of this file
    r, q, k = (x.transpose(1, 2).contiguous() for x in (r, q, k))
    torch.library.opcheck(vla_normalize_fwd_op, (r, q, k, n0, eps))
    o, n_end, den, starts = vla_normalize_fwd_op(r, q, k, n0, eps)
    for dn_end in (torch.randn_like(n_end), None):
        torch.library.opcheck(vla_normalize_bwd_op, (r, q, k, den, starts, torch.randn_like(o), dn_end, eps))


def test_unit_keys_kernels_match_torch():
    """``k̂ = k / ‖k‖`` and its backward in kernels against autograd through PyTorch's normalisation, with rows
    past a whole program (37 rows of 24 channels) and opcheck of both operators."""
    from attnkit.ops.vla.parallel import vla_unit_keys_bwd_op, vla_unit_keys_op

    k = torch.rand(1, 37, 1, 24, device=DEVICE) + 0.1

    def triton_fn(k, st):
        return vla_unit_keys_op(k)[0], ()

    def torch_fn(k, st):
        return k / k.norm(dim=-1, keepdim=True), ()

    for name, x, y in zip(["k_hat", "dk"], grads_of(triton_fn, [k], None), grads_of(torch_fn, [k], None)):
        assert_close(name, x, y, 1e-6)
    torch.library.opcheck(vla_unit_keys_op, (k,))
    k_hat, norm = vla_unit_keys_op(k)
    torch.library.opcheck(vla_unit_keys_bwd_op, (k_hat, norm, torch.randn_like(k_hat), torch.float16))


def test_unit_rows_with_a_floor_and_a_scale_match_normalize():
    """``vla_unit_keys_op(x, eps, scale)`` (the VLA layer's directions ``u``): ``F.normalize(x, eps=eps) · scale`` and
    its gradient from autograd in float64, a zero row included (zero forward, ``scale · dy / eps`` backward, as
    PyTorch's); bf16 input read through strides; opcheck of both operators with the floor and the scale."""
    from attnkit.ops.vla.parallel import vla_unit_keys_bwd_op, vla_unit_keys_op

    x = torch.randn(2, 19, 3, 48, device=DEVICE)[..., 8:32]  # strided rows of 24 channels
    x[1, 4, 2] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xi = x.detach().to(dtype).requires_grad_()
        y = vla_unit_keys_op(xi, 1e-12, 24**-0.5)[0]
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, xi, dy)
        x64 = xi.detach().double().requires_grad_()
        y64 = F.normalize(x64, dim=-1, eps=1e-12) * 24**-0.5
        (dx64,) = torch.autograd.grad(y64, x64, dy.double())
        assert y.dtype == torch.float32 and dx.dtype == dtype
        assert torch.equal(y[1, 4, 2], torch.zeros_like(y[1, 4, 2]))
        assert_close("y", y, y64.float(), 1e-6)
        rows = torch.ones(x.shape[:-1], dtype=torch.bool, device=DEVICE)
        rows[1, 4, 2] = False
        assert_close("dx", dx[rows].float(), dx64[rows].to(dtype).float(), 1e-6 if dtype == torch.float32 else 1e-2)
        assert_close("dx at the floor", dx[1, 4, 2].float(), dx64[1, 4, 2].float(), 1e-2)
    x = torch.randn(1, 7, 2, 24, device=DEVICE)  # no row at the floor: its float16 gradient would overflow
    torch.library.opcheck(vla_unit_keys_op, (x, 1e-12, 0.5))
    y, norm = vla_unit_keys_op(x, 1e-12, 0.5)
    torch.library.opcheck(vla_unit_keys_bwd_op, (y, norm, torch.randn_like(y), torch.float16, 1e-12, 0.5))


def test_gate_ops_opcheck():
    k_hat, u = (x.float().to(DEVICE).transpose(1, 2).contiguous() for x in gate_inputs(1, 2, 2, 16, 0.1))
    X = torch.randn(1, 2, 2, 48, 16, device=DEVICE) / 16
    lam = 0.1 * torch.eye(16, device=DEVICE) + X.mT @ X  # one SPD penalty per chunk
    torch.library.opcheck(vla_gates_fwd_op, (k_hat, u, lam))
    alpha, a0, r, anorm = vla_gates_fwd_op(k_hat, u, lam)
    torch.library.opcheck(vla_gates_bwd_op, (u, alpha, a0, r, anorm, torch.randn_like(alpha)))
    # A0 is each chunk's inverse penalty
    assert_close("A0", a0, torch.linalg.inv(lam), 1e-4)


def test_prepare_kernel_blocks_at_the_gpu_chunk_size():
    """The GPU's 64-token chunks (four 16-row blocks of the triangular inverse, sums of up to three products)
    under the interpreter: the saved ``T`` is ``(I + strict_tril(K Aᵀ))⁻¹`` and the output and final state match
    the PyTorch delta rule, with ``beta`` near 2."""
    from attnkit.ops.common.triton.delta_fwd import delta_fwd_fn

    B, H, T, K, V = 1, 2, 70, 16, 16
    q, k, v, a = delta_inputs(B, H, T, K, V, deltanet=True)
    o, ht, saved = delta_fwd_fn(*bthd(q, k, v, a), None, 64, "ieee")
    o_ref, s_ref = chunk_generalized_delta_rule(q, k, v, a, None, 64)
    assert_close("o", o.transpose(1, 2), o_ref, 1e-4)
    assert_close("S", ht, s_ref, 1e-4)
    kc, ac = k[:, :, :64], a[:, :, :64]
    expected = torch.linalg.inv(torch.eye(64, device=DEVICE) + (kc @ ac.mT).tril(-1))
    assert_close("T", saved["tm"][:, :, :64], expected, 1e-5)


@pytest.mark.parametrize("deltanet", [True, False], ids=["deltanet-beta", "generic-a"])
def test_prepare_products_on_16bit_rows(monkeypatch, deltanet):
    """``delta_fwd.PREPARE_16BIT_Z``: with float16 ``k`` and ``a`` (or DeltaNet's ``beta`` near 2) the prepare
    kernel multiplies ``K Aᵀ`` on the 16-bit rows and scales the columns by ``beta`` after (``LOW_Z``): ``T``, ``W``,
    the output and the final state those of the float32-row products to float32 rounding, over three 64-token
    chunks with a partial last one; float32 inputs keep the float32 rows."""
    from attnkit.ops.common.triton import delta_fwd

    B, H, T, K, V = 1, 2, 150, 16, 32
    q, k, v, a = (x.half() for x in delta_inputs(B, H, T, K, V))
    beta = 1.9 + 0.1 * torch.rand(B, T, H, device=DEVICE) if deltanet else None
    inputs = (*bthd(q, k, v), None if deltanet else bthd(a)[0])
    flags = launch_arguments(monkeypatch, delta_fwd, "delta_prepare_kernel", "LOW_Z")
    runs = {}
    for low in (False, True):
        monkeypatch.setattr(delta_fwd, "PREPARE_16BIT_Z", low)
        o, ht, saved = delta_fwd.delta_fwd_fn(*inputs, None, 64, "ieee", None, beta, 0.25)
        runs[low] = (o.float(), ht, saved["tm"], saved["w"])
    assert flags == [False, True]
    for name, x, ref in zip(["o", "S", "T", "W"], runs[True], runs[False]):
        tol = 1e-3 if name == "o" else 1e-5  # o is float16
        assert_close(name, x, ref, tol)
    wide = [None if x is None else x.float() for x in inputs]
    delta_fwd.delta_fwd_fn(*wide, None, 64, "ieee", None, beta, 0.25)
    assert flags[-1] is False


def test_opcheck_and_compile():
    q, k, v, a = bthd(*delta_inputs(1, 1, 21, 16, 16))
    s0 = torch.randn(1, 1, 16, 16, device=DEVICE)
    torch.library.opcheck(delta_rule_fwd_op, (q, k, v, a, s0))
    o, ht, w, hs, u_new, tm = delta_rule_fwd_op(q, k, v, a, s0)
    dht = torch.randn_like(ht)
    torch.library.opcheck(delta_rule_bwd_op, (q, k, v, a, w, hs, u_new, tm, torch.randn_like(o), dht))

    inputs = [x.float().to(DEVICE) for x in make_inputs(1, 21, 1, 16, 16)]

    def f(q, k, v, u):
        return vla_attention(q, k, v, u, backend="triton")[0] * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_close("o", compiled(*inputs), f(*inputs), 1e-6)


def test_float64_refused():
    inputs = make_inputs(1, 8, 1, 16, 16)
    with pytest.raises(ValueError, match="^backend"):
        vla_attention(*[x.to(DEVICE) for x in inputs], backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize("T", [4096, 65536])
def test_real_sizes_on_gpu(T):
    inputs = [x.float().cuda() for x in make_inputs(1, T, 4, 64, 64)]
    actual = grads_of(vla("triton"), [x.bfloat16() for x in inputs[:3]] + [inputs[3]], None)
    expected = grads_of(vla("torch"), [x.bfloat16() for x in inputs[:3]] + [inputs[3]], None)
    check(actual, expected, 1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize("T, K, packed", [(4096, 64, False), (4096, 128, False), (8192, 64, True)], ids=str)
def test_deltanet_real_sizes_on_gpu(T, K, packed):
    """DeltaNet's kernels at real sizes in bf16 (issue 17: they become its CUDA default once these pass): output,
    final state and every gradient against the PyTorch backend on the same rounded inputs, in float32 (bars 5e-3
    for outputs, 1e-2 for gradients); unit keys, ``beta ∈ (0, 2)``, packed sequences with an empty one."""
    from attnkit.ops import delta_rule

    gen = torch.Generator(device="cuda").manual_seed(K)
    B, H = (1, 4) if packed else (2, 4)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
    k = F.normalize(torch.randn(B, T, H, K, device="cuda", generator=gen), dim=-1).bfloat16()
    v = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
    beta = 2 * torch.rand(B, T, H, device="cuda", generator=gen)
    cu = torch.tensor([0, 1000, 1000, 5000, T], device="cuda") if packed else None
    N = 4 if packed else B

    def fn(backend, dtype):
        def run(q, k, v, beta, state):
            xs = [x.to(dtype) for x in (q, k, v)]
            o, S = delta_rule(*xs, beta, initial_state=state[0], output_final_state=True, cu_seqlens=cu,
                              backend=backend)  # fmt: skip
            return o.float(), (S,)

        return run

    S0 = [0.1 * torch.randn(N, H, K, K, device="cuda", generator=gen)]
    actual = grads_of(fn("triton", torch.bfloat16), [q, k, v, beta], S0)
    expected = grads_of(fn("torch", torch.float32), [q, k, v, beta], S0)
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dS0"], actual, expected):
        assert_close(name, x.float(), y.float(), 5e-3 if name in ("o", "S") else 1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize("K, deltanet", [(64, True), (128, True), (64, False)], ids=str)
def test_blocked_prepare_on_gpu(K, deltanet):
    """The prepare kernel compiled for the GPU at its 64-token chunks, float32 inputs with float32-accurate products,
    against the PyTorch delta rule (``beta`` near 2 for DeltaNet's keys, a partial last chunk): the output and final
    state, and every chunk's saved ``T = (I + strict_tril(K Aᵀ))⁻¹``, ``W = T K`` and ``U = T (V − K S_cᵀ)``, ``S_c``
    the PyTorch state at the chunk's start. (Until the row-by-row kernel was deleted, the same inputs held the blocked
    kernel to it, to 1e-4; on the H200 in the fifteenth session.)"""
    from attnkit.ops.common.triton.delta_fwd import delta_fwd_fn

    B, H, T, C = 2, 4, 1000, 64
    q, k, v, a = delta_inputs(B, H, T, K, K, deltanet)
    o, ht, saved = delta_fwd_fn(*bthd(q, k, v, a), None, C, "tf32x3")
    o_ref, s_ref = chunk_generalized_delta_rule(q, k, v, a, None, C)
    assert_close("o", o.transpose(1, 2), o_ref, 1e-4)
    assert_close("S", ht, s_ref, 1e-4)
    NC = -(-T // C)
    kc, ac, vc = (F.pad(x, (0, 0, 0, NC * C - T)).unflatten(2, (NC, C)) for x in (k, a, v))
    t_ref = torch.linalg.inv(torch.eye(C, device=DEVICE) + (kc @ ac.mT).tril(-1))
    starts = [chunk_generalized_delta_rule(q[:, :, :n], k[:, :, :n], v[:, :, :n], a[:, :, :n], None, C)[1]
              for n in range(0, NC * C, C)]  # fmt: skip
    u_ref = t_ref @ (vc - kc @ torch.stack(starts, 2).mT)
    for name, x, y in [("T", saved["tm"], t_ref), ("W", saved["w"], t_ref @ kc), ("U", saved["u_new"], u_ref)]:
        assert_close(name, x, y.flatten(2, 3)[:, :, :T], 1e-5 if name == "T" else 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize("K", [64, 128])
def test_prepare_products_on_16bit_rows_on_gpu(monkeypatch, K):
    """``delta_fwd.PREPARE_16BIT_Z`` compiled for the GPU with bf16 DeltaNet inputs (``beta`` near 2, a partial last
    chunk): every chunk's ``T`` within 1e-5 of ``(I + strict_tril(K (β K)ᵀ))⁻¹`` in float64 on the same bf16 rows,
    ``T`` and ``W`` those of the float32-row products to rounding, and the output as close to the float64 delta rule
    on those rows as the float32-row output (within 10 %: the two outputs differ by ~2e-3 relative RMS with ``beta``
    near 2, two roundings of the same product, thirty-second session)."""
    from attnkit.ops.common.triton import delta_fwd

    B, H, T, C = 2, 4, 1000, 64
    q, k, v, _ = (x.bfloat16() for x in delta_inputs(B, H, T, K, K))
    beta = 1.9 + 0.1 * torch.rand(B, T, H, device=DEVICE)
    runs = {}
    for low in (False, True):
        monkeypatch.setattr(delta_fwd, "PREPARE_16BIT_Z", low)
        o, _, saved = delta_fwd.delta_fwd_fn(*bthd(q, k, v), None, None, C, "tf32", None, beta, K**-0.5)
        runs[low] = (o.float(), saved["tm"], saved["w"])
    NC = -(-T // C)
    kc = F.pad(k.double(), (0, 0, 0, NC * C - T)).unflatten(2, (NC, C))
    bc = F.pad(beta.transpose(1, 2).double(), (0, NC * C - T)).unflatten(2, (NC, C))
    t_ref = torch.linalg.inv(
        torch.eye(C, device=DEVICE, dtype=torch.float64) + (kc @ kc.mT * bc[..., None, :]).tril(-1)
    )
    assert_close("T", runs[True][1].double(), t_ref.flatten(2, 3)[:, :, :T], 1e-5)
    # W = T K is one TF32 pass: T's last-digit differences can flip its roundings (~1e-3 each)
    for name, x, y, tol in zip(["T", "W"], runs[True][1:], runs[False][1:], [1e-5, 1e-4]):
        assert_close(name, x, y, tol)
    a = k.double() * beta.transpose(1, 2).double()[..., None]
    o_ref = chunk_generalized_delta_rule(q.double() * K**-0.5, k.double(), v.double(), a, None, C)[0].transpose(1, 2)
    err = {low: rel_rms(runs[low][0].double(), o_ref) for low in runs}
    assert err[True] <= 1.1 * err[False], f"o: relative RMS error {err[True]:.3e} on 16-bit rows, {err[False]:.3e} not"


def test_head_dim_limit_and_auto_dispatch(monkeypatch):
    """``"triton"`` refuses head dims past the kernels' limit by name; ``"auto"`` takes the kernels for CUDA
    tensors within it and PyTorch otherwise (CPU tensors, float64, larger head dims)."""
    inputs = [x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 256, 16)]
    with pytest.raises(ValueError, match="^backend: .*head dims"):
        vla_attention(*inputs, backend="triton")

    import attnkit.ops.common.delta_parallel as parallel

    calls = []
    real = parallel.delta_rule_triton
    monkeypatch.setattr(parallel, "delta_rule_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    vla_attention(*inputs)  # K = 256: PyTorch
    vla_attention(*[x.float().to(DEVICE) for x in make_inputs(1, 8, 1, 16, 16)])
    vla_attention(*[x.to(DEVICE) for x in make_inputs(1, 8, 1, 16, 16)])  # float64: PyTorch
    assert len(calls) == (1 if DEVICE == "cuda" else 0)


def test_opcheck_with_strided_inputs():
    """Fakes must report the strides the kernels produce (contiguous), also for transposed inputs."""
    q, k, v, a = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in delta_inputs(1, 2, 21, 16, 16))
    assert not q.is_contiguous()
    torch.library.opcheck(delta_rule_fwd_op, (q, k, v, a, None))
    o, ht, w, hs, u_new, tm = delta_rule_fwd_op(q, k, v, a, None)
    torch.library.opcheck(delta_rule_bwd_op, (q, k, v, a, w, hs, u_new, tm, torch.randn_like(o), None))


def test_deltanet_baseline_triton_backend():
    """DeltaNet (``delta_rule``) through the same kernels, opt-in, against its PyTorch path: output, final state,
    gradients; ragged ``cu_seqlens`` with an initial state per sequence."""
    from attnkit.ops import delta_rule

    T, H, K, V = 45, 2, 16, 16
    q, k, v = torch.randn(1, T, H, K), F.normalize(torch.randn(1, T, H, K), dim=-1), torch.randn(1, T, H, V)
    beta = 0.5 + 1.49 * torch.rand(1, T, H)
    S0 = torch.randn(2, H, V, K)
    cu = torch.tensor([0, 20, T], device=DEVICE)

    def fn(backend):
        def run(q, k, v, beta, state):
            o, S = delta_rule(
                q, k, v, beta, initial_state=state[0], output_final_state=True, cu_seqlens=cu, backend=backend
            )
            return o, (S,)

        return run

    inputs = [x.to(DEVICE) for x in (q, k, v, beta)]
    actual = grads_of(fn("triton"), inputs, [S0.to(DEVICE)])
    expected = grads_of(fn("torch"), inputs, [S0.to(DEVICE)])
    for name, x, y in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dS0"], actual, expected):
        assert_close(name, x, y, 1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_no_final_state_skips_the_final_inverse(monkeypatch, packed):
    """``output_final_state=False`` (what training asks for): the Gram kernel skips the final ``A``'s sweep
    (``WRITE_END`` false), and the output and every gradient are those of a call that asks for the state, bit for
    bit."""
    import attnkit.ops.vla.triton.gates as gates

    offsets = [0, 5, 5, 37] if packed else None
    B, T = (1, 37) if packed else (2, 29)
    inputs = [x.float().to(DEVICE) for x in make_inputs(B, T, 2, 16, 16)]
    kwargs = {} if offsets is None else dict(cu_seqlens=torch.tensor(offsets, device=DEVICE))
    ends = recorded_launches(monkeypatch, gates, "gram_prefix_kernel", lambda grid, kw: kw["WRITE_END"])
    results = []
    for final in (True, False):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        o, state = vla_attention(*xs, output_final_state=final, backend="triton", **kwargs)
        assert (state is None) == (not final)
        gen = torch.Generator().manual_seed(0)
        gs = torch.autograd.grad((o * torch.randn(o.shape, generator=gen).to(o)).sum(), xs)
        results.append((o, *gs))
    assert ends == [True, False]
    for name, with_state, without in zip(("o", "dq", "dk", "dv", "du"), *results):
        assert torch.equal(with_state, without), name
    if packed:
        return  # (packed, A0 has chunk slots no chunk fills: opcheck would compare their garbage)
    # the operators' fake shapes (A_end empty without the final state) and autograd, both ways
    from attnkit.ops.vla.parallel import vla_write_bwd_op, vla_write_fwd_op

    k_hat = torch.nn.functional.normalize(inputs[1], dim=-1).contiguous()
    for final in (True, False):
        args = (k_hat, inputs[3], None, None, 0.1, 16, True, final)
        torch.library.opcheck(vla_write_fwd_op, args)
        alpha, a_end, a0, r, anorm = vla_write_fwd_op(*args)
        assert a_end.shape == ((B, 2, 16, 16) if final else (0,))
        bwd = (inputs[3], alpha, a0, r, anorm, a_end, torch.randn_like(alpha), None, None, 16, True)
        torch.library.opcheck(vla_write_bwd_op, bwd)
