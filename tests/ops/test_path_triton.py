"""PaTH's Triton forward kernels (UT transform, carried keys, right-to-left scan) against the PyTorch backend.

On CPU they run through Triton's interpreter (``conftest.py``) with 16-position chunks, so a few dozen tokens
already cross several chunks; on a GPU the same tests run with 64-position chunks. ``path_attention(backend=
"triton")`` runs the fused forward and backward (kernels only: ``attnkit.ops.path.parallel.path_bwd_fn``); every
gradient is held to the PyTorch backend.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from attnkit.ops.path import path_attention
from attnkit.ops.path.triton.forward import path_fwd_fn
from tests.helpers import OPERATOR_COUNT_IDS, OPERATOR_COUNT_SHAPES, assert_close, launch_arguments, launch_counter
from tests.ops.test_path import make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def check(B, T, HQ, H, K, V, gate, dtype, cu_seqlens=None, beta_low=1.5, tol=None):
    q, k, v, w, beta, g = (
        None if x is None else x.to(DEVICE)
        for x in make_inputs(B, T, HQ, H, K, V, gate=gate, dtype=torch.float32, beta_low=beta_low)
    )
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    actual, _ = path_fwd_fn(q, k, v, w, beta, g, K**-0.5, cu)
    # The reference sees the same rounded inputs, in float32.
    expected = path_attention(q.float(), k.float(), v.float(), w, beta, g, cu_seqlens=cu, backend="torch")
    assert actual.dtype == dtype
    assert_close("o", actual, expected.to(dtype), TOL[dtype] if tol is None else tol)


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
    """Issue 3's bars at real sizes: float32 1e-3, 16-bit 5e-3. (The float32 PyTorch reference is itself 1.2e-5 from
    float64 at T = 4k and 4.9e-5 at 16k, growing linearly with T, so the small cases' 1e-5 cannot hold here; the
    kernels measured 1.6e-5 / 3.2e-5 / 1.3e-4 from it at these three sizes on an H200.)"""
    check(B, T, HQ, H, K, K, True, dtype, tol=1e-3 if dtype == torch.float32 else None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
@pytest.mark.parametrize(
    "B, T, HQ, H, K, dtype, offsets",
    [
        (1, 8192, 4, 2, 64, torch.bfloat16, None),
        (2, 2048, 2, 2, 128, torch.float32, None),
        (1, 4096, 2, 1, 128, torch.bfloat16, [0, 1000, 1000, 4096]),
        (1, 5000, 4, 2, 64, torch.bfloat16, [0, 700, 700, 2900, 5000]),
        (1, 2048, 2, 2, 256, torch.bfloat16, None),
    ],
    ids=["bf16-K64", "fp32-K128", "bf16-K128-varlen", "bf16-K64-varlen", "bf16-K256"],
)
def test_real_size_gradients_on_gpu(B, T, HQ, H, K, dtype, offsets):
    """The fused backward at real sizes, ``beta`` in (1.5, 2): every gradient against the PyTorch backend on the
    same rounded inputs (bars: float32 1e-3, bf16 1e-2)."""
    inputs = [
        None if x is None else x.to(DEVICE) for x in make_inputs(B, T, HQ, H, K, K, gate=True, dtype=torch.float32)
    ]
    inputs[:3] = [x.to(dtype) for x in inputs[:3]]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, K, device=DEVICE).to(dtype)
    actual = backend_grads(inputs, do, "triton", cu)
    reference = [x.float() for x in inputs[:3]] + inputs[3:]
    expected = backend_grads(reference, do.float(), "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        tol = 1e-3 if dtype == torch.float32 else (5e-3 if name == "o" else 1e-2)
        assert_close(name, a.float(), e, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "K, offsets",
    [(16, None), (24, None), (80, None), (256, None), (16, [0, 5, 5, 40, 75])],
    ids=["K16", "K24", "K80", "K256", "varlen"],
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


def backend_grads(inputs, do, backend, cu=None):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    o = path_attention(*leaves, cu_seqlens=cu, backend=backend)
    o.backward(do)
    return [o] + [None if x is None else x.grad for x in leaves]


GRAD_NAMES = ["o", "dq", "dk", "dv", "dw", "dbeta", "dg"]


def half_inputs(T):
    """``(inputs, do)`` of one PaTH-FoX sequence of ``T`` positions (four query heads on two key heads, K = 16,
    V = 24): ``q``, ``k``, ``v`` and ``do`` in float16, ``w``, ``beta``, ``g`` in float32."""
    inputs = [x.to(DEVICE) for x in make_inputs(1, T, 4, 2, 16, 24, gate=True, dtype=torch.float32)]
    inputs[:3] = [x.half() for x in inputs[:3]]
    return inputs, torch.randn(1, T, 4, 24, device=DEVICE).half()


def assert_16bit_option(monkeypatch, module, name, inputs, do, cu=None):
    """A 16-bit option ``module.name`` set off, then on, on 16-bit inputs: every output and gradient within float16's
    bars of the PyTorch backend on the same rounded inputs in float32, and not the numbers with the option off (the
    rounding is there)."""
    expected = backend_grads([x.float() for x in inputs], do.float(), "torch", cu)
    monkeypatch.setattr(module, name, False)
    off = backend_grads(inputs, do, "triton", cu)
    monkeypatch.setattr(module, name, True)
    actual = backend_grads(inputs, do, "triton", cu)
    for grad, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(grad, a.float(), e, 5e-3 if grad == "o" else 1e-2)
    assert any(not torch.equal(a, b) for a, b in zip(actual[1:], off[1:]))


# B, T, HQ, H, K, V, gate, offsets, beta_low
BACKWARD_CASES = [
    (2, 37, 4, 2, 16, 24, True, None, 1.5),  # GQA, PaTH-FoX, a partial last chunk
    (1, 45, 2, 1, 16, 16, False, None, 1.5),  # MQA
    (1, 40, 3, 1, 16, 16, True, None, 1.5),  # a group of three query heads (not a power of two)
    (2, 3, 2, 2, 16, 16, True, None, 1.5),  # three tokens (one token has zero dq, dk: nothing to compare)
    (1, 16, 2, 2, 16, 16, True, None, 1.5),  # exactly one chunk: only the diagonal block
    (1, 50, 2, 2, 24, 40, True, None, 1.5),  # K, V not powers of two
    (1, 160, 2, 1, 16, 16, True, None, 1.99),  # ten chunks of near-reflections
    (1, 60, 4, 2, 16, 16, True, [0, 7, 7, 60], 1.5),  # ragged, with an empty sequence
    (1, 80, 2, 2, 16, 16, False, [0, 0, 5, 80], 1.5),  # a leading empty sequence, a five-token one
    (1, 40, 2, 1, 256, 32, True, None, 1.5),  # the widest heads: the key-tile kernel, dM and dW projected
]


@pytest.mark.parametrize(
    "B, T, HQ, H, K, V, gate, offsets, beta_low",
    BACKWARD_CASES,
    ids=["gqa-fox", "mqa", "group3", "T3", "one-chunk", "K24-V40", "beta-1.99", "varlen", "varlen-lead", "K256"],
)
def test_triton_backend_forward_and_gradients(B, T, HQ, H, K, V, gate, offsets, beta_low):
    """``path_attention(backend="triton")``, the fused forward and backward kernels: the output and every gradient
    (q, k, v, w, beta, g) against the PyTorch backend's autograd."""
    inputs = make_inputs(B, T, HQ, H, K, V, gate=gate, dtype=torch.float32, beta_low=beta_low)
    inputs = [None if x is None else x.to(DEVICE) for x in inputs]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, V, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        if e is None:
            assert a is None, name
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, name
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 100]], ids=["dense", "varlen"])
def test_backward_takes_every_head_at_once(monkeypatch, offsets):
    """The fused backward runs each of its kernels' launchers once for every head together (no slices of heads), and
    reads nothing back from the device (no ``.item()``, ``.tolist()`` or ``.cpu()`` on a tensor)."""
    from attnkit.ops.path.triton import local

    calls = []
    whole = local.local_bwd_fn

    def spy(q, k, *args, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return whole(q, k, *args, **kwargs)

    def no_sync(*args, **kwargs):
        raise AssertionError("the backward read the device")

    monkeypatch.setattr(local, "local_bwd_fn", spy)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 100, 4, 2, 16, 16, gate=True, dtype=torch.float32)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(1, 100, 4, 16, device=DEVICE)
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = path_attention(*leaves, cu_seqlens=cu, backend="triton")
    with monkeypatch.context() as m:
        for name in ("item", "tolist"):
            m.setattr(torch.Tensor, name, no_sync)
        o.backward(do)
    assert calls == [(4, 2)]
    expected = backend_grads(inputs, do, "torch", cu)
    for name, x, e in zip(GRAD_NAMES[1:], leaves, expected[1:]):
        assert_close(name, x.grad, e, 1e-5)


@pytest.mark.skipif(DEVICE != "cpu", reason="counted on the CPU, under the interpreter")
@pytest.mark.parametrize("shapes", OPERATOR_COUNT_SHAPES, ids=OPERATOR_COUNT_IDS)
def test_operator_count(shapes):
    """One forward+backward dispatches at most 40 PyTorch operators outside the Triton kernels (leaf ATen operators
    that do work, :func:`tests.helpers.count_aten_ops`), and the same number whatever the batch, the length or the
    packed sequences: nothing in the op loops over heads, sequences or chunks in Python."""
    from tests.helpers import count_aten_ops

    totals = []
    for B, T, offsets in shapes:
        inputs = make_inputs(B, T, 4, 2, 16, 16, gate=True, dtype=torch.float32)
        leaves = [x.requires_grad_() for x in inputs]
        cu = None if offsets is None else torch.tensor(offsets)
        do = torch.randn(B, T, 4, 16)
        step = partial(path_attention, *leaves, cu_seqlens=cu, backend="triton")
        counts = count_aten_ops(lambda step=step, do=do: step().backward(do))
        totals.append(sum(counts.values()))
        assert totals[-1] <= 40, counts
    assert len(set(totals)) == 1, totals


@pytest.mark.parametrize("chunk", [16, 8], ids=["forward-chunk", "own-chunk"])
def test_backward_in_waves(monkeypatch, chunk):
    """A scratch budget of one query chunk per launch (many waves) gives the same gradients as one wave; so does a
    backward chunk (8) other than the forward's (16): the backward recomputes its chunk-local terms."""
    from attnkit.ops.path.triton import backward, prepare

    if chunk < 16:  # the GPU's tensor-core dots (3xTF32 for float32 inputs) take at least 16 rows: exact FMA dots
        monkeypatch.setattr(prepare, "FLOAT32_PRECISIONS", ("ieee", "ieee"))
    inputs = [x.to(DEVICE) for x in make_inputs(2, 70, 2, 1, 16, 16, gate=True, dtype=torch.float32)]
    do = torch.randn(2, 70, 2, 16, device=DEVICE)
    whole = backend_grads(inputs, do, "triton")
    monkeypatch.setattr(backward, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(backward, "backward_config", lambda key_dim: (chunk, 1))
    waves = backend_grads(inputs, do, "triton")
    for name, a, e in zip(GRAD_NAMES, waves, whole):
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize(
    "B, T, HQ, H, K, V, offsets",
    [(2, 75, 4, 2, 16, 16, None), (1, 50, 2, 2, 24, 40, None), (1, 60, 4, 2, 16, 16, [0, 7, 7, 60])],
    ids=["gqa", "K24-V40", "varlen"],
)
@pytest.mark.parametrize("every", [1, 2, None], ids=["segments-of-1", "segments-of-2", "default-segments"])
def test_key_tile_kernel(monkeypatch, B, T, HQ, H, K, V, offsets, every):
    """The key side's kernel for wide heads (the key chunk carried and checkpointed instead of the ``K × K``
    product), forced at small K: every gradient against the PyTorch backend, with a one-chunk scratch budget (many
    waves) and segments of one, two or ``⌈√chunks⌉`` chunks."""
    from attnkit.ops.path.triton import backward

    monkeypatch.setattr(backward, "carries_key_tile", lambda key_dim: True)
    monkeypatch.setattr(backward, "SCRATCH_BYTES", 1)
    if every is not None:
        monkeypatch.setattr(backward, "checkpoint_every", lambda chunks: every)
    inputs = [x.to(DEVICE) for x in make_inputs(B, T, HQ, H, K, V, gate=True, dtype=torch.float32, beta_low=1.5)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, V, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("sums_da", [True, False], ids=["dA", "dM-dW"])
@pytest.mark.parametrize("K", [16, 24])
def test_carry_gradient_forms(monkeypatch, sums_da, K):
    """Both forms of the carries' gradient in the query kernel — each chunk's ``dA_m`` summed and taken back by
    autograd, or its projections ``dM_m``, ``dW_m`` summed by atomics — give the PyTorch backend's gradients,
    whichever the launcher would pick (K = 24 pads to a 32-wide ``dA`` tile over 16-position chunks)."""
    from attnkit.ops.path.triton import backward

    monkeypatch.setattr(backward, "sums_carry_gradient", lambda key_dim, chunk: sums_da)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 75, 4, 2, K, 16, gate=True, dtype=torch.float32, beta_low=1.5)]
    do = torch.randn(1, 75, 4, 16, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton"), backend_grads(inputs, do, "torch")
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("every", [1, 2, 100], ids=["segments-of-1", "segments-of-2", "one-segment"])
def test_backward_checkpoint_segments(monkeypatch, every):
    """The query kernel's checkpoints every ``every`` key chunks (one tile a segment, two, or all in one segment)
    give the gradients of the default ``⌈√chunks⌉`` (seven chunks, no superblocks, the carried queries not
    recomputed)."""
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 100)
    monkeypatch.setattr(backward, "INNER_RECOMPUTE", False)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 100, 2, 1, 16, 16, gate=True, dtype=torch.float32)]
    do = torch.randn(1, 100, 2, 16, device=DEVICE)
    default = backend_grads(inputs, do, "triton")
    monkeypatch.setattr(backward, "checkpoint_every", lambda chunks: every)
    for name, a, e in zip(GRAD_NAMES, backend_grads(inputs, do, "triton"), default):
        assert_close(name, a, e, 1e-6)


@pytest.mark.parametrize("below", [64, 0], ids=["default", "kernels-16bit"])
@pytest.mark.parametrize("side_dtype", [torch.float32, torch.float16], ids=["side-fp32", "side-fp16"])
def test_triton_backend_float16_gradients(monkeypatch, side_dtype, below):
    """float16 q, k, v (w, beta, g in float32 or float16): every gradient within 1e-2 of the PyTorch backend on the
    same rounded inputs, in the inputs' dtypes; at K = 32 by default through the backward zero-padded to K = 64
    (``parallel.PAD_BELOW``), and through the kernels' own 16-bit path with the padding off."""
    from attnkit.ops.path import parallel

    monkeypatch.setattr(parallel, "PAD_BELOW", below)
    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 90, 2, 2, 32, 16, gate=True, dtype=torch.float32))
    w, beta, g = (x.to(side_dtype) for x in (w, beta, g))
    q, k, v = (x.half() for x in (q, k, v))
    do = torch.randn(1, 90, 2, 16, device=DEVICE).half()
    actual = backend_grads([q, k, v, w, beta, g], do, "triton")
    expected = backend_grads([x.float() for x in (q, k, v, w, beta, g)], do.float(), "torch")
    for name, a, e, x in zip(GRAD_NAMES, actual, expected, [v, q, k, v, w, beta, g]):
        assert a.dtype == x.dtype, name
        assert_close(name, a.float(), e, 5e-3 if name == "o" else 1e-2)


@pytest.mark.parametrize("key_tile", [False, True], ids=["key-product", "key-tile"])
def test_inner_products_on_16bit_operands(monkeypatch, key_tile):
    """``backward.INNER_LOW_GRAD``: the kernels between chunks inside superblocks (three superblocks of three chunks,
    a partial last one; the key side as the ``K × K`` product or the carried key tile) take their logits' and
    gradients' products on float16 operands: every gradient within float16's bars of the PyTorch backend, and not
    the float32-operand backward's numbers (the rounding is there)."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 3)
    monkeypatch.setattr(backward, "carries_key_tile", lambda key_dim: key_tile)
    # Nine chunks and two positions, whatever the chunk: 16 positions under the interpreter, 64 on a GPU (with 130
    # positions there, one superblock held every chunk, the option had nothing to act on, and the test failed)
    T = 8 * prepare.chunk_size(16) + 2
    assert_16bit_option(monkeypatch, backward, "INNER_LOW_GRAD", *half_inputs(T))


@pytest.mark.parametrize("offsets", [None, [0, 40, 40, 150]], ids=["dense", "varlen"])
def test_sweep_pairs_on_16bit_operands(monkeypatch, offsets):
    """``backward_super.PAIR_16BIT = "16bit"``: the sweep between superblocks takes its three products a (key tile,
    later superblock) pair on float16 operands (superblocks of two chunks, GQA, packed with an empty sequence):
    every gradient within float16's bars of the PyTorch backend, and not the exact pairs' numbers (the rounding is
    there); float32 inputs keep exact products."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import backward_super, prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 2)
    # The lengths in 16-position chunks, scaled to the chunk in use (64 positions on a GPU: unscaled, the packed
    # sequences there had one superblock each, no pairs between superblocks, and the test failed)
    scale = prepare.chunk_size(16) // 16
    T = (150 if offsets else 130) * scale
    inputs, do = half_inputs(T)
    cu = None if offsets is None else torch.tensor([o * scale for o in offsets], device=DEVICE)
    expected = backend_grads([x.float() for x in inputs], do.float(), "torch", cu)
    exact_pairs = backend_grads(inputs, do, "triton", cu)
    monkeypatch.setattr(backward_super, "PAIR_16BIT", "16bit")
    actual = backend_grads(inputs, do, "triton", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a.float(), e, 5e-3 if name == "o" else 1e-2)
    assert any(not torch.equal(a, b) for a, b in zip(actual[1:], exact_pairs[1:]))
    floats = [x.float() for x in inputs]
    sixteen = backend_grads(floats, do.float(), "triton", cu)
    monkeypatch.setattr(backward_super, "PAIR_16BIT", None)
    assert all(torch.equal(a, b) for a, b in zip(sixteen, backend_grads(floats, do.float(), "triton", cu)))


@pytest.mark.parametrize("every", [1, 4], ids=["every-chunk", "one-segment"])
def test_inner_checkpoints(monkeypatch, every):
    """``backward.INNER_EVERY``: the query kernel inside superblocks of four chunks keeps every carried query (no
    recomputation) or one checkpoint for the whole superblock (its default rule takes two): the forward and every
    gradient against the PyTorch backend, packed with an empty sequence, GQA."""
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 4)
    monkeypatch.setattr(backward, "INNER_RECOMPUTE", False)  # the checkpointed form
    monkeypatch.setattr(backward, "INNER_EVERY", every)
    rule = []  # the default rule, which the setting replaces
    monkeypatch.setattr(backward, "checkpoint_every", lambda chunks: rule.append(chunks) or 2)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 150, 4, 2, 16, 16, gate=True, dtype=torch.float32, beta_low=1.5)]
    cu = torch.tensor([0, 20, 20, 150], device=DEVICE)
    do = torch.randn(1, 150, 4, 16, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)
    assert rule == []


# B, T, HQ, H, K, V, offsets, span: the pairs between chunks in several layouts
INNER_PAIR_CASES = pytest.mark.parametrize(
    "B, T, HQ, H, K, V, offsets, span",
    [
        (1, 150, 4, 2, 16, 16, [0, 20, 20, 150], 4),  # superblocks of four chunks, packed with an empty sequence, GQA
        (2, 75, 3, 1, 24, 40, None, 100),  # no superblocks: every pair chunk by chunk; a group of three, K, V odd
        (1, 160, 2, 2, 16, 16, None, 3),  # ten chunks in superblocks of three: partial superblocks
    ],
    ids=["superblocks-varlen-gqa", "no-superblocks", "partial-superblocks"],
)


@pytest.mark.parametrize("stages", [1, 2], ids=["one-stage", "two-stages"])
@INNER_PAIR_CASES
def test_inner_pairs_in_one_kernel(monkeypatch, B, T, HQ, H, K, V, offsets, span, stages):
    """The query kernel adds the key side of the pairs between chunks (``dK̃``, ``dV``, both sides of the gates) by
    atomics up to K = 128 (``KV`` in every launch); ``backward.INNER_STAGES`` launches the kernels between chunks
    with more stages. The forward and every gradient against the PyTorch backend (``beta`` near 2)."""
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    monkeypatch.setattr(backward, "INNER_STAGES", stages)
    inputs = [x.to(DEVICE) for x in make_inputs(B, T, HQ, H, K, V, gate=True, dtype=torch.float32, beta_low=1.9)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, V, device=DEVICE)
    key_side = launch_arguments(monkeypatch, backward, "path_bwd_q_kernel", "KV")
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    assert key_side and all(key_side)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


@INNER_PAIR_CASES
def test_inner_pairs_recomputed(monkeypatch, B, T, HQ, H, K, V, offsets, span):
    """``backward.INNER_RECOMPUTE`` (the default): the query kernel recomputes each pair's carried query from its
    chunk's start in registers, in one launch, where the checkpointed form (its scratch held to a few bytes here)
    runs in waves of one query chunk. The forward and every gradient against the PyTorch backend (``beta`` near 2),
    and equal to the checkpointed backward's within float32 reordering. Sequences longer than ``RECOMPUTE_MAX_CHUNKS``
    chunks keep the checkpoints."""
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    monkeypatch.setattr(backward, "SCRATCH_BYTES", 1)  # the checkpointed form: a wave a query chunk
    monkeypatch.setattr(backward, "INNER_RECOMPUTE", False)
    inputs = [x.to(DEVICE) for x in make_inputs(B, T, HQ, H, K, V, gate=True, dtype=torch.float32, beta_low=1.9)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(B, T, HQ, V, device=DEVICE)
    launches = launch_counter(monkeypatch, backward, "path_bwd_q_kernel")
    checkpointed = backend_grads(inputs, do, "triton", cu)
    waves = len(launches)
    launches.clear()
    monkeypatch.setattr(backward, "INNER_RECOMPUTE", True)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    assert waves > 1 and len(launches) == 1
    for name, a, e, c in zip(GRAD_NAMES, actual, expected, checkpointed):
        assert_close(name, a, e, 1e-5)
        assert_close(name, a, c, 1e-5)
    launches.clear()
    monkeypatch.setattr(backward, "RECOMPUTE_MAX_CHUNKS", 1)  # every sequence here is longer: checkpoints again
    backend_grads(inputs, do, "triton", cu)
    assert len(launches) == waves


def test_inner_carries_on_16bit_operands(monkeypatch):
    """``backward.INNER_CARRY_LOW`` (the default) with ``INNER_RECOMPUTE`` and 16-bit products: the query kernel
    inside superblocks (three superblocks of three chunks and a partial fourth, GQA, gates) carries the query and its
    gradient on float16 operands: every gradient within float16's bars of the PyTorch backend, and not the numbers of
    float32-operand carries (the rounding is there)."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import backward, prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 3)
    monkeypatch.setattr(backward, "INNER_LOW_GRAD", True)
    monkeypatch.setattr(backward, "INNER_RECOMPUTE", True)
    T = 10 * prepare.chunk_size(16) + 2  # ten chunks and two positions, whatever the chunk
    assert_16bit_option(monkeypatch, backward, "INNER_CARRY_LOW", *half_inputs(T))


@pytest.mark.parametrize("in_place", [False, True], ids=["after", "in-place"])
def test_superblock_terms_carry_on_16bit_operands(monkeypatch, in_place):
    """``local.TERMS_CARRY_LOW``: the superblock-local terms carry ``x`` to ``x̂`` and ``S``, ``U``, ``P``, ``V`` on
    float16 operands (three superblocks of three chunks and a partial fourth, GQA, gates; after the kernels between
    chunks or before them, in place): every gradient within float16's bars of the PyTorch backend, and not the
    numbers of the carries' own precision."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import local, prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 3)
    monkeypatch.setattr(local, "SUPER_TERMS_IN_PLACE", in_place)
    T = 10 * prepare.chunk_size(16) + 2  # ten chunks and two positions, whatever the chunk
    assert_16bit_option(monkeypatch, local, "TERMS_CARRY_LOW", *half_inputs(T))
    assert not local.terms_low(torch.float32, 16)  # float32 inputs keep their carries


def test_forward_inner_carries_on_16bit_operands(monkeypatch):
    """``forward.INNER_CARRY_LOW``: the forward kernel carries its query across the chunks of its superblock on
    float16 operands (three superblocks of three chunks and a partial fourth, GQA, gates): the output and every
    gradient within float16's bars of the PyTorch backend, and not the numbers of the carries' own precision."""
    from attnkit.ops.path.triton import forward, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 3)
    T = 10 * prepare.chunk_size(16) + 2  # ten chunks and two positions, whatever the chunk
    assert_16bit_option(monkeypatch, forward, "INNER_CARRY_LOW", *half_inputs(T))
    assert not forward.inner_low(torch.float32, 16)  # float32 inputs keep their carries


@pytest.mark.parametrize("span", [3, None, "together"], ids=["superblocks", "chunks", "with-the-other-options"])
def test_working_buffers_in_16bit(monkeypatch, span):
    """``prepare.BUFFERS_16BIT``: the backward's ``K̃``, ``x`` and ``k̂`` (and the forward's ``K̃`` kept for it) stored
    in float16 for 16-bit inputs, with superblocks of three chunks (the sweep, the superblock
    terms) or none (every pair chunk by chunk), GQA, gates, packed with an empty sequence: the output and every
    gradient within float16's bars of the PyTorch backend, and not the numbers of float32 buffers. The forward keeps
    ``K̃`` in float16 and ``M``, ``M W`` in float32; bfloat16 inputs take float16 too, and float32 inputs keep
    float32. "together": with the other memory and carry options on (the superblock terms first and in place, their
    carries on 16-bit operands, their scratch in waves of one superblock)."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.parallel import path_fwd_op
    from attnkit.ops.path.triton import local, prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    if span == "together":
        span = 3
        for name, value in (("SUPER_TERMS_IN_PLACE", True), ("TERMS_CARRY_LOW", True), ("SCRATCH_BYTES", 1),
                            ("SCRATCH_MIN_PROGRAMS", 1)):  # fmt: skip
            monkeypatch.setattr(local, name, value)
    if span is not None:
        monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    T = 10 * prepare.chunk_size(16) + 2  # ten chunks and two positions, whatever the chunk
    inputs, do = half_inputs(T)
    cu = torch.tensor([0, 3, 3, T], device=DEVICE)
    assert_16bit_option(monkeypatch, prepare, "BUFFERS_16BIT", inputs, do, cu)
    q, k, v, w, beta, g = inputs
    m, kt, mw, kh, sig, x, xh = path_fwd_op(q, k, v, w, beta, g, cu, 0.25, keep=True)[2:]
    assert [t.dtype for t in (m, kt, mw)] == [torch.float32, torch.float16, torch.float32]  # m, K̃, M W
    # the keys carried to their superblock's end in float16 too, the superblocks' transitions in float32
    assert (kh.dtype, sig.dtype, kh.shape) == (torch.float16, torch.float32, k.shape)
    assert (x.dtype, xh.dtype, x.shape, xh.shape) == (torch.float16, q.dtype, q.shape, q.shape)  # carried queries
    assert prepare.buffer_dtype(torch.bfloat16, 16) == torch.float16
    assert prepare.buffer_dtype(torch.float32, 16) == torch.float32


@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 330]], ids=["dense", "varlen"])
def test_superblock_terms_first_in_place(monkeypatch, offsets):
    """``local.SUPER_TERMS_IN_PLACE`` (the default): the superblock terms' adjoint runs before the kernels between
    chunks and overwrites ``dx̂``, ``dk̂`` with its shares of ``dx``, ``dK̃``, to which those kernels then add theirs
    (superblocks of three chunks, GQA, gates, dense and packed with an empty sequence, beta near 2): the output and
    every gradient as the old order's (the same sums in another order) and the PyTorch backend's; it runs in place
    where one program takes a head's columns and the kernels between chunks sum ``dA`` (K = 16), not at K = 24
    (BK 32 > C 16)."""
    from attnkit.ops.path.triton import local, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 3)
    T = 330 if offsets else 20 * prepare.chunk_size(16) + 7
    B = 1 if offsets else 2
    inputs = [x.to(DEVICE) for x in make_inputs(B, T, 4, 2, 16, 24, gate=True, dtype=torch.float32, beta_low=1.9)]
    do = torch.randn(B, T, 4, 24, device=DEVICE)
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    expected = backend_grads([x.double() for x in inputs], do.double(), "torch", cu)
    monkeypatch.setattr(local, "SUPER_TERMS_IN_PLACE", False)
    before = backend_grads(inputs, do, "triton", cu)
    calls = []
    terms = local.super_terms_bwd_fn
    monkeypatch.setattr(local, "super_terms_bwd_fn", lambda *a, **kw: calls.append(kw) or terms(*a, **kw))
    monkeypatch.setattr(local, "SUPER_TERMS_IN_PLACE", True)
    actual = backend_grads(inputs, do, "triton", cu)
    assert [kw.get("in_place", False) for kw in calls] == [True]
    for grad, a, b, e in zip(GRAD_NAMES, actual, before, expected):
        assert_close(grad, a, b, 1e-5)
        assert_close(grad, a.double(), e, 1e-5)
    assert local.terms_in_place(16, 16) and not local.terms_in_place(24, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_backward_takes_the_forward_prepare(monkeypatch, dtype):
    """``parallel.KEEP_PREPARED`` (the default): the forward keeps its prepare kernel's ``M``, ``K̃`` (in float32) and
    ``M W`` for the backward, which then launches no prepare kernel of its own, and its keys carried to their
    superblock's end and the superblocks' transitions (``forward.keeps_carried``; the keys in the backward's buffer
    dtype), which the backward then does not carry again, and its queries carried to their chunk's and superblock's
    start, for which the backward launches no query terms kernel; the forward and every gradient equal
    those of the backward that prepares again (float32: to reordering-free equality; float16: the forward's carried
    keys now start from float32 ``K̃``), against the PyTorch backend too (superblocks, GQA, packed with an empty
    sequence, beta near 2; float16 through the kernels' own 16-bit path, unpadded), and a second backward through the
    same graph gives the same gradients. Without gradients, or where the backward pads the inputs, the forward keeps
    nothing."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.parallel import keeps_prepared, path_fwd_op
    from attnkit.ops.path.triton import local, prepare

    assert not keeps_prepared(torch.float16, 16) and keeps_prepared(torch.float32, 16)  # padded to PAD_BELOW
    monkeypatch.setattr(parallel, "PAD_BELOW", 0)
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: 2)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 150, 4, 2, 16, 24, gate=True, dtype=torch.float32, beta_low=1.9)]
    inputs[:3] = [x.to(dtype) for x in inputs[:3]]
    cu = torch.tensor([0, 40, 40, 150], device=DEVICE)
    do = torch.randn(1, 150, 4, 24, device=DEVICE, dtype=dtype)
    carries, carry = [], parallel.carry_keys_fn  # the backward's own carries (forward.py imports its own by name)
    monkeypatch.setattr(parallel, "carry_keys_fn", lambda *a, **kw: carries.append(a[4]) or carry(*a, **kw))
    terms = launch_counter(monkeypatch, local, "path_query_terms_kernel")
    monkeypatch.setattr(parallel, "KEEP_PREPARED", False)
    again = backend_grads(inputs, do, "triton", cu)
    assert len(carries) == len(terms) == 1  # the backward carries the keys and the queries again
    monkeypatch.setattr(parallel, "KEEP_PREPARED", True)
    launches = launch_counter(monkeypatch, prepare, "path_prepare_kernel")
    kept = backend_grads(inputs, do, "triton", cu)
    assert not launches  # the backward's own prepare kernel (the forward's is imported by name in forward.py)
    assert len(carries) == len(terms) == 1  # and it read the forward's carried keys and queries
    m, kt, mw, kh, sig, x, xh = path_fwd_op(*inputs, cu, 0.25, True)[2:]
    work = prepare.buffer_dtype(dtype, 16)
    dtypes = [torch.float32, work, torch.float32, work, torch.float32, work, dtype]
    assert [t.dtype for t in (m, kt, mw, kh, sig, x, xh)] == dtypes
    assert kh.shape == inputs[1].shape and sig.shape[1:] == (2, 16, 16) and x.shape == xh.shape == inputs[0].shape
    expected = backend_grads([x.float() for x in inputs], do.float(), "torch", cu)
    tol = 0.0 if dtype == torch.float32 else TOL[dtype]
    for name, a, b, e in zip(GRAD_NAMES, kept, again, expected):
        assert_close(name, a, b, tol)
        assert_close(name, a.float(), e, 1e-5 if dtype == torch.float32 else (5e-3 if name == "o" else 1e-2))
    # The kept tensors are read, never written: a second backward through the same graph gives the same gradients.
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = path_attention(*leaves, cu_seqlens=cu, backend="triton")
    first = torch.autograd.grad(o, leaves, do, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(o, leaves, do)))
    with torch.no_grad():
        assert all(t.numel() == 0 for t in path_fwd_op(*inputs, cu, 0.25, False)[2:])


@pytest.mark.parametrize(
    "solve, launched",
    [("bf16x3", "ieee" if DEVICE == "cpu" else "tf32x3"), (None, "substitution")],
    ids=["products", "substitution"],
)
@pytest.mark.parametrize(
    "offsets, beta_low", [(None, 1.99), ([0, 20, 20, 150], 1.5)], ids=["near-reflections", "varlen"]
)
def test_local_solve_by_products(monkeypatch, offsets, beta_low, solve, launched):
    """``local.LOCAL_SOLVE``: the UT transform's adjoint ``L⁻ᵀ dM`` as ``dM − Nᵀ (Mᵀ dM)`` (``L⁻¹ = I − M N``, the
    default) or by the back substitution (None): the kernel is launched with it (for float32 inputs the products in
    their precision, not bf16x3: exact under the interpreter, 3xTF32 on a GPU), and the forward and every gradient
    match the PyTorch backend (ten chunks of ``beta`` near 2; packed with an empty sequence, GQA)."""
    from attnkit.ops.path.triton import local

    launches = []
    kernel = local.path_local_bwd_kernel

    class Spy:  # the kernel's launches, their constexprs recorded
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs["SOLVE"]) or kernel[grid](*args, **kwargs)

    monkeypatch.setattr(local, "path_local_bwd_kernel", Spy())
    assert local.LOCAL_SOLVE == "bf16x3"
    monkeypatch.setattr(local, "LOCAL_SOLVE", solve)
    T = 160 if offsets is None else offsets[-1]
    inputs = [x.to(DEVICE) for x in make_inputs(1, T, 4, 2, 16, 16, gate=True, dtype=torch.float32, beta_low=beta_low)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(1, T, 4, 16, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)
    assert launches == [launched]


def test_triton_backend_rejects_what_the_kernels_do_not_take():
    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 8, 2, 2, 16, 16, gate=True, dtype=torch.float64))
    with pytest.raises(ValueError, match="^backend: .*float64"):
        path_attention(q, k, v, w, beta, g, backend="triton")
    wide = [x.to(DEVICE) for x in make_inputs(1, 4, 1, 1, 288, 16, gate=False, dtype=torch.float32)[:5]]
    with pytest.raises(ValueError, match="^backend: .*head dims up to 256"):
        path_attention(*wide, backend="triton")
    # "auto" falls back to the PyTorch backend for both.
    assert path_attention(q, k, v, w, beta, g).dtype == torch.float64
    assert path_attention(*wide).shape == (1, 4, 1, 16)


def test_forward_opcheck_and_compile():
    """``attnkit::path_fwd`` passes ``opcheck`` (forward: fake tensor, schema, AOT dispatch) and compiles with
    ``fullgraph=True``, forward and backward; so does the fused backward's operator ``attnkit::path_bwd``."""
    from attnkit.ops.path.parallel import path_bwd_op, path_fwd_op
    from attnkit.ops.path.triton import prepare

    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 40, 2, 1, 16, 16, gate=True, dtype=torch.float32))
    cu = torch.tensor([0, 6, 40], device=DEVICE, dtype=torch.int32)
    torch.library.opcheck(path_fwd_op, (q, k, v, w, beta, g, cu, 0.25))
    torch.library.opcheck(path_fwd_op, (q, k, v, w, beta, None, None, 0.25))
    torch.library.opcheck(path_fwd_op, (q, k, v, w, beta, g, cu, 0.25, True))  # the prepared tensors kept
    # The fused backward's operator, packed and with gates, dense and without; with the forward's prepared tensors.
    o, lse, *_ = path_fwd_op(q, k, v, w, beta, g, cu, 0.25)
    do = torch.randn_like(o)
    torch.library.opcheck(path_bwd_op, (q, k, v, w, beta, g, cu, o, lse, do, 0.25))
    o, lse, *prepared = path_fwd_op(q, k, v, w, beta, g, cu, 0.25, True)
    m, kt, mw, kh, sig, x, xh = prepared
    assert all(t.numel() > 0 for t in (m, kt, mw, x))
    # the carried keys, transitions and queries where some chunk has an earlier superblock: under the interpreter's
    # chunks and superblocks, not the GPU's (40 positions in one chunk)
    chunk = prepare.chunk_size(16)
    supers = prepare.superblock_chunks(16, chunk) < -(-40 // chunk)
    assert [t.numel() > 0 for t in (kh, sig, xh)] == [supers] * 3
    torch.library.opcheck(path_bwd_op, (q, k, v, w, beta, g, cu, o, lse, do, 0.25, *prepared))
    o, lse, *_ = path_fwd_op(q, k, v, w, beta, None, None, 0.25)
    torch.library.opcheck(path_bwd_op, (q, k, v, w, beta, None, None, o, lse, do, 0.25))

    leaves = [x.clone().requires_grad_() for x in (q, k, v, w, beta, g)]
    compiled = torch.compile(lambda *a: path_attention(*a, backend="triton"), fullgraph=True, dynamic=False)
    # Compiled fresh: a graph cached on disk by an earlier revision of these operators would call them with the
    # old schema (the caches do not key on it).
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        o = compiled(*leaves)
        o.square().sum().backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, w, beta, g)]
    o_ref = path_attention(*ref, backend="torch")
    o_ref.square().sum().backward()
    assert_close("o", o, o_ref, 1e-5)
    for name, a, b in zip(["dq", "dk", "dv", "dw", "dbeta", "dg"], leaves, ref):
        assert_close(name, a.grad, b.grad, 1e-5)


@pytest.mark.parametrize("span", [1, 3, 1 << 30], ids=["span-1", "span-3", "no-superblocks"])
@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 100]], ids=["dense", "varlen"])
def test_superblock_spans(monkeypatch, span, offsets):
    """Superblocks of one chunk (every chunk pair between superblocks: the dense carries and their gradient across
    six superblocks), of three chunks (a partial last one), or none (chunk by chunk throughout): the forward and
    every gradient against the PyTorch backend, with a one-chunk scratch budget (many waves) and the sweep between
    superblocks a row of ``E`` a wave."""
    from attnkit.ops.path.triton import backward, backward_super, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    monkeypatch.setattr(backward, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(backward_super, "SCRATCH_BYTES", 1)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 100, 4, 2, 16, 24, gate=True, dtype=torch.float32, beta_low=1.5)]
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    do = torch.randn(1, 100, 4, 24, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


def superblock_products(x, kt, A, lo, hi, groups):
    """The superblock-local terms of chunks ``lo .. hi-1`` written out: the queries carried to the superblock's start
    (``x_r A_{r−1} ··· A_lo``), the keys to its end (``k̃_r A_{r+1}ᵀ ··· A_{hi−1}ᵀ``) and ``Σ = A_loᵀ ··· A_{hi−1}ᵀ``;
    ``x [HQ, chunks, C, K]``, ``kt [H, chunks, C, K]``, ``A [H, chunks, K, K]``."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype).expand(A.shape[0], -1, -1)
    xh, kh = [], []
    for r in range(lo, hi):
        into, out = eye, eye  # A_{r−1} ··· A_lo and A_{r+1}ᵀ ··· A_{hi−1}ᵀ
        for c in range(lo, r):
            into = A[:, c] @ into
        for c in range(hi - 1, r, -1):
            out = A[:, c].transpose(-1, -2) @ out
        xh.append(x[:, r] @ into.repeat_interleave(groups, 0))
        kh.append(kt[:, r] @ out)
    sig = eye
    for c in range(hi - 1, lo - 1, -1):
        sig = A[:, c].transpose(-1, -2) @ sig
    return xh, kh, sig


def test_superblock_terms_waves_keep_the_machine_busy(monkeypatch):
    """:func:`local.superblock_wave`: the superblock terms' waves fit ``SCRATCH_BYTES`` but keep at least
    ``SCRATCH_MIN_PROGRAMS`` programs (T = 32k: 64 superblock rows at D = 64, 16 heads, 8 chunks of 64 positions;
    D = 128, 8 heads, 16 chunks of 32, two 64-column programs a head)."""
    from attnkit.ops.path.triton import local

    assert local.SCRATCH_MIN_PROGRAMS == 256 and local.SCRATCH_BYTES == 1 << 26
    monkeypatch.setattr(local, "SCRATCH_BYTES", 1 << 28)
    assert local.superblock_wave(64, 16, 64, 64, 8) == 64  # 256 MiB: one wave
    assert local.superblock_wave(64, 8, 128, 64, 16) == 16  # four waves of 256 programs
    monkeypatch.setattr(local, "SCRATCH_BYTES", 1 << 26)  # the default
    assert local.superblock_wave(64, 16, 64, 64, 8) == 16  # 64 MiB: 16 rows of 4 MiB, 256 programs
    assert local.superblock_wave(64, 8, 128, 64, 16) == 16  # 4 rows would fit; 16 keep 256 programs
    assert local.superblock_wave(3, 8, 128, 64, 16) == 3  # never more than there are
    monkeypatch.setattr(local, "SCRATCH_BYTES", 1)
    monkeypatch.setattr(local, "SCRATCH_MIN_PROGRAMS", 1)
    assert local.superblock_wave(64, 16, 64, 64, 8) == 1


@pytest.mark.parametrize("K", [16, 24])
@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 100]], ids=["dense", "varlen"])
@pytest.mark.parametrize("waves", [False, True], ids=["one-wave", "waves"])
@pytest.mark.parametrize("project", [False, True], ids=["dA", "dM-dW"])
def test_superblock_terms_adjoint(monkeypatch, K, offsets, waves, project):
    """:func:`local.super_terms_bwd_fn`, the adjoint of the superblock-local terms (the queries carried to their
    superblock's start, the keys to its end, each superblock's ``Σ``), against autograd through the products
    written out, in float64 references: superblocks of three 16-position chunks over 100 tokens (a partial last
    one), dense and packed, GQA, ``K`` padded or not; in one wave, or one superblock a wave (a scratch budget of one
    byte); each chunk's ``dA``, or its projections onto ``dM`` and ``dW`` through ``A = I − Wᵀ M W``."""
    from attnkit.ops.common.triton_utils import block_dim
    from attnkit.ops.path.triton import local
    from attnkit.ops.path.triton.prepare import chunk_offsets

    if waves:
        monkeypatch.setattr(local, "SCRATCH_BYTES", 1)
        monkeypatch.setattr(local, "SCRATCH_MIN_PROGRAMS", 1)

    gen = torch.Generator().manual_seed(K)
    B, T, HQ, H, C, span = (2 if offsets is None else 1), 100, 4, 2, 16, 3
    BK = block_dim(K)

    def rand(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=gen, dtype=torch.float64)).float().to(DEVICE)

    x, dxh = rand(B, T, HQ, K), rand(B, T, HQ, K)
    kt, dkh, w, mw = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, K, s=0.3), rand(B, T, H, K, s=0.3)
    seqs = [(b, 0, T) for b in range(B)] if offsets is None else [(0, lo, hi) for lo, hi in zip(offsets, offsets[1:])]
    rows_sb = sum(-(-(hi - lo) // (C * span)) for _, lo, hi in seqs) if offsets else B * -(-T // (C * span))
    rows_c = sum(-(-(hi - lo) // C) for _, lo, hi in seqs) if offsets else B * -(-T // C)
    m = rand(rows_c, H, C, C, s=0.3)
    if project:  # mw is then each chunk's M W, as the prepare kernel writes it
        row_c = 0
        for b, lo, hi in seqs:
            for c0 in range(lo, hi, C):
                n_c = min(C, hi - c0)
                mw[b, c0 : c0 + n_c] = torch.einsum("hij,jhk->ihk", m[row_c, :, :n_c, :n_c], w[b, c0 : c0 + n_c])
                row_c += 1
    dsig = torch.zeros(rows_sb, H, BK, BK, device=DEVICE)
    dsig[..., :K, :K] = rand(rows_sb, H, K, K)
    dx, dkt, da = torch.zeros_like(x), torch.zeros_like(kt), torch.zeros(rows_c, H, BK, BK, device=DEVICE)
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    offsets = chunk_offsets(cu, C), chunk_offsets(cu, C * span)
    dm, dw = torch.zeros_like(m), torch.zeros_like(w)
    if project:
        local.super_terms_bwd_fn(
            x, kt, w, mw, dxh, dkh, dsig, dx, dkt, None, cu, C, span, torch.float32, *offsets, None, m, dm, dw
        )
    else:
        local.super_terms_bwd_fn(x, kt, w, mw, dxh, dkh, dsig, dx, dkt, da, cu, C, span, torch.float32, *offsets)

    # the references live on the CPU, where autograd computes them in float64
    expected_dx = torch.zeros(x.shape, dtype=torch.float64)
    expected_dkt = torch.zeros(kt.shape, dtype=torch.float64)
    expected_da = torch.zeros(rows_c, H, K, K, dtype=torch.float64)
    expected_dm = torch.zeros(rows_c, H, C, C, dtype=torch.float64)
    expected_dw = torch.zeros(w.shape, dtype=torch.float64)
    row_c = row_sb = 0
    for b, lo, hi in seqs:
        n = -(-(hi - lo) // C)
        if n == 0:
            continue

        def chunks(t, b=b, lo=lo, hi=hi, n=n):  # [·, T, heads, K] -> [heads, n, C, K], zero-padded
            t = t[b, lo:hi].double().cpu()
            return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, n * C - (hi - lo))).view(n, C, -1, K).permute(2, 0, 1, 3)

        xs, kts = chunks(x).requires_grad_(), chunks(kt).requires_grad_()
        ws = chunks(w).requires_grad_()
        ms = m[row_c : row_c + n].double().cpu().transpose(0, 1).requires_grad_()  # [heads, n, C, C]
        A = torch.eye(K, dtype=torch.float64) - ws.transpose(-1, -2) @ (ms @ ws if project else chunks(mw))
        loss = 0
        for s_i, c_lo in enumerate(range(0, n, span)):
            xh, kh, sig = superblock_products(xs, kts, A, c_lo, min(c_lo + span, n), HQ // H)
            for r, (a, e) in enumerate(zip(xh, kh)):
                loss = loss + (a * chunks(dxh)[:, c_lo + r]).sum() + (e * chunks(dkh)[:, c_lo + r]).sum()
            loss = loss + (sig * dsig[row_sb + s_i, :, :K, :K].double().cpu()).sum()
        gx, gk, ga, gm, gw = torch.autograd.grad(loss, (xs, kts, A, ms, ws), allow_unused=True)
        if project:
            expected_dm[row_c : row_c + n] = gm.transpose(0, 1)
            expected_dw[b, lo:hi] = gw.permute(1, 2, 0, 3).reshape(n * C, H, K)[: hi - lo]
        expected_dx[b, lo:hi] = gx.permute(1, 2, 0, 3).reshape(n * C, HQ, K)[: hi - lo]
        expected_dkt[b, lo:hi] = gk.permute(1, 2, 0, 3).reshape(n * C, H, K)[: hi - lo]
        expected_da[row_c : row_c + n] = ga.transpose(0, 1)
        row_c, row_sb = row_c + n, row_sb + -(-n // span)
    assert_close("dx", dx.double().cpu(), expected_dx, 1e-5)
    assert_close("dkt", dkt.double().cpu(), expected_dkt, 1e-5)
    if project:  # the loss reaches M and W through A alone: these are the projections of dA
        assert_close("dM", dm.double().cpu(), expected_dm, 1e-5)
        assert_close("dW", dw.double().cpu(), expected_dw, 1e-5)
        assert not da.any()
    else:
        assert_close("dA", da[..., :K, :K].double().cpu(), expected_da, 1e-5)


@pytest.mark.parametrize("offsets", [None, [0, 7, 7, 100]], ids=["dense", "ragged"])
def test_superblock_terms_project_onto_dm_dw(monkeypatch, offsets):
    """Where the kernels between chunks project their ``dA`` (``BK > chunk``: K = 32 on the interpreter's 16-position
    chunks), the superblock terms project theirs onto ``dM``, ``dW`` too (``local.SUPER_DA_PROJECT``, no ``K × K``
    matrix a chunk), or with it off sum it as one: every gradient against the PyTorch backend either way, GQA, K ≠ V,
    a partial last superblock, packed sequences with an empty one."""
    from attnkit.ops.path.triton import local

    took, run = [], local.super_terms_bwd_fn

    def recorded(*args, **kwargs):
        took.append(args[9] is None)  # da
        return run(*args, **kwargs)

    monkeypatch.setattr(local, "super_terms_bwd_fn", recorded)
    inputs = [x.to(DEVICE) for x in make_inputs(1, 100, 4, 2, 32, 24, gate=True, dtype=torch.float32, beta_low=1.5)]
    do = torch.randn(1, 100, 4, 24, device=DEVICE)
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    expected = backend_grads(inputs, do, "torch", cu)
    for project in (True, False):
        monkeypatch.setattr(local, "SUPER_DA_PROJECT", project)
        for name, a, e in zip(GRAD_NAMES, backend_grads(inputs, do, "triton", cu), expected):
            assert_close(name, a, e, 1e-5)
    assert took == [True, False]


@pytest.mark.parametrize("span", [2, 4], ids=["one-tile-a-superblock", "two-tiles-a-superblock"])
def test_superblock_tiles_of_their_own(monkeypatch, span):
    """The between-superblock kernels on 32-row tiles while the chunks have 16 positions (their tile is free of the
    chunk), one program a key tile (two programs a superblock at four chunks, each with its own rows of ``E``): every
    gradient against the PyTorch backend, dense and with GQA."""
    from attnkit.ops.path.triton import backward_super, prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    config = dict(tile=32, tiles_per_program=1, num_warps=1, num_stages=1)
    monkeypatch.setattr(backward_super, "launch_config", lambda key_dim, chunk, *_: config)
    inputs = [x.to(DEVICE) for x in make_inputs(2, 150, 4, 2, 16, 16, gate=True, dtype=torch.float32, beta_low=1.5)]
    do = torch.randn(2, 150, 4, 16, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton"), backend_grads(inputs, do, "torch")
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("chunk, rows", [(32, 16), (64, 16), (64, 32)], ids=["C32-SB16", "C64-SB16", "C64-SB32"])
def test_prepare_solve_by_blocks(chunk, rows):
    """The prepare kernel's UT solve by blocks of ``rows`` rows, one block after another and every diagonal block at
    once (``BATCHED``), gives the row-by-row solve's ``M``, carried keys and ``M W`` (and ``M`` is the PyTorch
    ``ut_transform``), over two sequences with a partial last chunk."""
    from attnkit.ops.common.triton_utils import block_dim
    from attnkit.ops.path.torch_impl import _chunk, ut_transform
    from attnkit.ops.path.triton.prepare import chunk_offsets_of, path_prepare_kernel

    _, k, _, w, beta, _ = (x.to(DEVICE) for x in make_inputs(1, 150, 2, 2, 24, 16, gate=True, dtype=torch.float32))
    cu = torch.tensor([0, 60, 150], device=DEVICE, dtype=torch.int32)
    offsets, chunks = chunk_offsets_of(cu, chunk)
    outs = []
    for sb, batched in ((chunk, False), (rows, False), (rows, True)):
        m = torch.zeros(chunks, 2, chunk, chunk, device=DEVICE)
        kt, mw = torch.zeros_like(k), torch.zeros_like(k)
        path_prepare_kernel[(-(-90 // chunk), 2 * 2)](  # the longest sequence's chunks, N * H
            k, w, beta, m, kt, mw, cu, offsets, 150, 0, H=2, K=24, BK=block_dim(24), BT=chunk, IS_VARLEN=True,
            PRECISION="ieee", WRITE_MW=True, SB=sb, BATCHED=batched, num_warps=1,
        )  # fmt: skip
        outs.append((m, kt, mw))
    for out in outs[1:]:
        for name, a, e in zip(("M", "k_carried", "MW"), out, outs[0]):
            assert_close(name, a, e, 1e-5)
    # The first sequence's M against the PyTorch UT transform.
    expected = ut_transform(_chunk(w[:, :60], chunk, torch.float32), _chunk(beta[:, :60], chunk, torch.float32))
    assert_close("M vs ut_transform", outs[1][0][: expected.shape[2]].transpose(0, 1)[None], expected, 1e-5)


@pytest.mark.parametrize("span", [1, 2, 1 << 30], ids=["span-1", "span-2", "no-superblocks"])
def test_many_packed_sequences(monkeypatch, span):
    """Nine packed sequences of every kind of length (one token, exactly a chunk, a chunk and one, several
    superblocks, an empty one): their local terms go as one chunk-aligned batch; every gradient against the
    PyTorch backend."""
    from attnkit.ops.path.triton import prepare

    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    offsets = [0, 1, 17, 33, 33, 50, 120, 121, 137, 160]
    inputs = [x.to(DEVICE) for x in make_inputs(1, 160, 4, 2, 16, 24, gate=True, dtype=torch.float32, beta_low=1.5)]
    cu = torch.tensor(offsets, device=DEVICE)
    do = torch.randn(1, 160, 4, 24, device=DEVICE)
    actual, expected = backend_grads(inputs, do, "triton", cu), backend_grads(inputs, do, "torch", cu)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-5)


@pytest.mark.parametrize("span", [1, 1 << 30], ids=["span-1", "no-superblocks"])
def test_gate_gradient_of_a_first_token_is_zero(monkeypatch, span):
    """A sequence's first gate shifts every cumulative gate of the sequence alike, so no logit moves and its
    gradient is exactly zero, whatever the rounding: the row and column sums of ``dS`` that make ``dg`` come from
    the same tiles and cancel. float16 inputs, whose rounded output makes ``Δ = dO · O`` miss a row's true
    ``Σ_j P dP``: summed from the columns alone, that error stays in every suffix sum (at T = 32k in bf16 it took
    ``dg`` to 1.3e-1 from the PyTorch backend)."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import prepare

    monkeypatch.setattr(parallel, "PAD_BELOW", 0)  # the kernels' own 16-bit path at K = 16
    monkeypatch.setattr(prepare, "superblock_chunks", lambda key_dim, chunk: span)
    offsets = [0, 40, 41, 130]
    q, k, v, w, beta, g = (x.to(DEVICE) for x in make_inputs(1, 130, 4, 2, 16, 16, gate=True, dtype=torch.float32))
    q, k, v = (x.half() for x in (q, k, v))
    do = torch.randn(1, 130, 4, 16, device=DEVICE).half()
    dg = backend_grads([q, k, v, w, beta, g], do, "triton", torch.tensor(offsets, device=DEVICE))[-1]
    first = dg[0, [0, 41]]  # the one-token sequence's only gate is its first too, but meets no other key
    scale = dg.square().mean().sqrt()
    assert first.abs().max() <= 1e-5 * scale, (first.abs().max() / scale).item()


def test_carry_precisions(monkeypatch):
    """The carries' dot precision on a GPU: bfloat16 inputs at K = 64 and 128 take ``CARRY_16BIT`` (three bf16
    passes, measured there), other 16-bit inputs 3xTF32 (three bf16 passes failed a float16 forward at K = 32 on the
    H200), float32 inputs 3xTF32 at padded K and V of at most 128 (``FLOAT32_PRECISIONS``; exact products at K = 128
    compiled for minutes) and exact above; the products one TF32 pass for 16-bit inputs. Under the interpreter
    everything is exact."""
    from attnkit.ops.path.triton import prepare

    assert prepare.precisions(torch.bfloat16, 64) == ("tf32", "ieee")  # the interpreter has no TF32
    assert prepare.precisions(torch.float32, 64) == ("ieee", "ieee")
    monkeypatch.setattr(prepare, "interpreting", lambda: False)
    assert prepare.CARRY_16BIT == "bf16x3"
    assert prepare.precisions(torch.bfloat16, 64) == prepare.precisions(torch.bfloat16, 100) == ("tf32", "bf16x3")
    assert prepare.precisions(torch.bfloat16, 32) == prepare.precisions(torch.bfloat16, 256) == ("tf32", "tf32x3")
    assert prepare.precisions(torch.float16, 64) == ("tf32", "tf32x3")
    assert prepare.FLOAT32_PRECISIONS == ("tf32x3", "tf32x3")
    assert prepare.precisions(torch.float32, 16) == prepare.precisions(torch.float32, 64) == ("tf32x3", "tf32x3")
    assert prepare.precisions(torch.float32, 65) == prepare.precisions(torch.float32, 128) == ("tf32x3", "tf32x3")
    tf32x3 = ("tf32x3", "tf32x3")
    assert prepare.precisions(torch.float32, 64, 64) == prepare.precisions(torch.float32, 64, 80) == tf32x3
    assert prepare.precisions(torch.float32, 129) == prepare.precisions(torch.float32, 256) == ("ieee", "ieee")
    assert prepare.precisions(torch.float32, 64, 256) == ("ieee", "ieee")  # value tiles of 256: exact


def test_local_adjoint_precisions(monkeypatch):
    """The backward's 16-bit settings on a GPU apply where they were measured (``prepare.measured_16bit``: bfloat16
    inputs at a padded K of 64 or 128): the chunk-local adjoint's gradient products on bf16 operands, the carries inside
    superblocks in one TF32 pass, the inner kernels' products on 16-bit operands; everything else keeps the attention
    products' one TF32 pass and the carries' own precision, float32 inputs ``FLOAT32_PRECISIONS`` (its two products
    for ``L⁻ᵀ dM`` too, not ``LOCAL_SOLVE``'s bf16x3). Under the interpreter everything is exact. (bf16 local products
    at K = 16 and 32 hit an illegal memory access on the H200.)"""
    from attnkit.ops.path.triton import backward, local, prepare

    assert local.local_precisions(torch.bfloat16, 64) == ("tf32", "tf32")
    assert local.local_solve(torch.float32, "ieee") == local.local_solve(torch.bfloat16, "tf32") == "ieee"
    assert prepare.inner_carry(torch.bfloat16, 64) == "ieee"
    assert not prepare.measured_16bit(torch.bfloat16, 64)
    monkeypatch.setattr(prepare, "interpreting", lambda: False)
    monkeypatch.setattr(local, "interpreting", lambda: False)
    measured = [prepare.measured_16bit(torch.bfloat16, k) for k in (16, 32, 48, 64, 128)]
    assert measured == [False, False, True, True, True]
    assert not prepare.measured_16bit(torch.float16, 64) and not prepare.measured_16bit(torch.float32, 64)
    assert local.LOCAL_GRADS_16BIT == "bf16" and backward.INNER_LOW_GRAD is None
    assert local.local_precisions(torch.bfloat16, 64) == local.local_precisions(torch.bfloat16, 48) == ("tf32", "bf16")
    assert local.local_precisions(torch.bfloat16, 128) == ("tf32", "bf16")
    assert local.local_precisions(torch.bfloat16, 32) == local.local_precisions(torch.bfloat16, 256) == ("tf32", "tf32")
    assert local.local_precisions(torch.float16, 64) == ("tf32", "tf32")
    assert local.local_precisions(torch.float32, 64) == ("tf32x3", "tf32x3")
    tf32x3 = ("tf32x3", "tf32x3")
    assert local.local_precisions(torch.float32, 128) == local.local_precisions(torch.float32, 64, 128) == tf32x3
    assert local.local_precisions(torch.float32, 256) == ("ieee", "ieee")
    assert local.local_solve(torch.float32, "tf32x3") == "tf32x3" and local.local_solve(torch.float32, "ieee") == "ieee"
    assert local.local_solve(torch.bfloat16, "tf32") == local.LOCAL_SOLVE == "bf16x3"
    monkeypatch.setattr(local, "LOCAL_GRADS_16BIT", None)
    assert local.local_precisions(torch.bfloat16, 64) == ("tf32", "tf32")
    assert prepare.INNER_CARRY_16BIT == "tf32"
    assert prepare.inner_carry(torch.bfloat16, 64) == "tf32"
    assert prepare.inner_carry(torch.bfloat16, 32) == prepare.inner_carry(torch.float16, 64) == "tf32x3"
    assert prepare.inner_carry(torch.bfloat16, 128) == "tf32"
    monkeypatch.setattr(prepare, "INNER_CARRY_16BIT", None)
    assert prepare.inner_carry(torch.bfloat16, 64) == prepare.inner_carry(torch.bfloat16, 128) == "bf16x3"
    assert prepare.inner_carry(torch.float32, 64) == prepare.inner_carry(torch.float32, 128) == "tf32x3"
    assert prepare.inner_carry(torch.float32, 256) == "ieee"


def test_small_head_dims_16bit_backward_zero_padded(monkeypatch):
    """16-bit inputs at a padded key dim below ``parallel.PAD_BELOW`` (16 and 32) take the backward with ``q, k, w``
    zero-padded to K = 64, the gradients cut back to K, in the inputs' dtypes; at K = 48 (padded to 64 inside the
    kernels) the kernels take them as they are."""
    from attnkit.ops.path import parallel
    from attnkit.ops.path.triton import local

    seen, local_bwd = [], local.local_bwd_fn
    monkeypatch.setattr(local, "local_bwd_fn", lambda q, *args: seen.append(q.shape[-1]) or local_bwd(q, *args))
    for K in (16, 32, 48):
        inputs = [x.to(DEVICE) for x in make_inputs(1, 40, 2, 1, K, 16, gate=True, dtype=torch.float32)]
        inputs[:3] = [x.to(torch.float16) for x in inputs[:3]]
        do = torch.randn(1, 40, 2, 16, device=DEVICE).to(torch.float16)
        actual = backend_grads(inputs, do, "triton")
        reference = [x.float() for x in inputs[:3]] + inputs[3:]
        expected = backend_grads(reference, do.float(), "torch")
        assert [a.dtype for a in actual] == [x.dtype for x in [inputs[2], *inputs]]
        assert [a.shape for a in actual[1:]] == [x.shape for x in inputs]
        for name, a, e in zip(GRAD_NAMES, actual, expected):
            assert_close(name, a.float(), e, 5e-3 if name == "o" else 1e-2)
    assert seen == [64, 64, 48] and parallel.PAD_BELOW == 64


@pytest.mark.parametrize("V", [16, 32, 40])
def test_small_head_dims_16bit_backward_values_unpadded(monkeypatch, V):
    """Where ``q, k, w`` are zero-padded (16-bit inputs at K = 16), ``v``, ``o`` and ``dO`` are not: the local adjoint
    gets ``v`` as it is (``local.value_block`` widens its block for 16-bit inputs); every gradient as the
    PyTorch backend's, in the inputs' dtypes and shapes."""
    from attnkit.ops.path.triton import local

    seen, local_bwd = [], local.local_bwd_fn

    def recorded(q, k, v, *args):
        seen.append((q.shape[-1], v.shape[-1]))
        return local_bwd(q, k, v, *args)

    monkeypatch.setattr(local, "local_bwd_fn", recorded)
    inputs = [x.to(DEVICE) for x in make_inputs(2, 37, 2, 1, 16, V, gate=True, dtype=torch.float32)]
    inputs[:3] = [x.to(torch.float16) for x in inputs[:3]]
    do = torch.randn(2, 37, 2, V, device=DEVICE).to(torch.float16)
    actual = backend_grads(inputs, do, "triton")
    expected = backend_grads([x.float() for x in inputs[:3]] + inputs[3:], do.float(), "torch")
    assert [a.shape for a in actual[1:]] == [x.shape for x in inputs]
    assert [a.dtype for a in actual] == [x.dtype for x in [inputs[2], *inputs]]
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a.float(), e, 5e-3 if name == "o" else 1e-2)
    assert seen == [(64, V)]


def check_bf16_against_torch(T, HQ, K, V, gate):
    """Two sequences of ``T`` positions, ``HQ`` query heads on two key heads: bf16 ``q, k, v, beta`` and float32
    ``w`` (and gates) through the Triton backend, the forward and every gradient against the PyTorch backend's on
    the same values in float32."""
    inputs = [
        None if x is None else x.to(DEVICE) for x in make_inputs(2, T, HQ, 2, K, V, gate=gate, dtype=torch.float32)
    ]
    inputs[:3] = [x.to(torch.bfloat16) for x in inputs[:3]]
    inputs[4] = inputs[4].to(torch.bfloat16)
    do = torch.randn(2, T, HQ, V, device=DEVICE).to(torch.bfloat16)
    actual = backend_grads(inputs, do, "triton")
    reference = [x.float() for x in inputs[:3]] + [inputs[3], inputs[4].float(), inputs[5]]
    expected = backend_grads(reference, do.float(), "torch")
    assert (actual[-1] is None) == (not gate)
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        if e is not None:
            assert_close(name, a.float(), e, 5e-3 if name == "o" else 1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need a GPU")
@pytest.mark.parametrize("K", [16, 32, 48, 64])
def test_bf16_small_head_dims_on_gpu(K):
    """bf16 inputs at small head dims, short and odd T, float32 ``w`` and bf16 ``beta`` (what a model under bf16
    autocast hands the op): forward and every gradient against the PyTorch backend. At K = 16 and 32 the bf16
    backward hit an illegal memory access on the H200 (ninth session), then gave non-finite dv and dq (tenth); the
    tenth session's float32 backward compiled for minutes at K = 32, and it now runs zero-padded to K = 64
    (``parallel.PAD_BELOW``)."""
    check_bf16_against_torch(77, 4, K, K, gate=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need a GPU")
@pytest.mark.parametrize("T, K, V, gate", [(24, 16, 16, False), (77, 32, 32, True), (64, 64, 16, False)])
def test_bf16_one_query_head_a_key_head_narrow_values_on_gpu(T, K, V, gate):
    """One query head a key head, bf16 ``q, k, v, beta`` and float32 ``w`` (a model's attention under bf16 autocast)
    at value dims below 64: the shapes whose chunk-local adjoint read shared memory out of bounds on the H200 with a
    16- or 32-column value block (``local.value_block``, twenty-third session); every gradient as the PyTorch
    backend's."""
    check_bf16_against_torch(T, 2, K, V, gate)


@pytest.mark.parametrize("G", [1, 2])
def test_local_adjoint_value_block_wider_than_the_values(monkeypatch, G):
    """The chunk-local adjoint launched with more value columns than ``v`` has (``local.value_block``'s 64 for 16-bit
    inputs, here forced at V = 16 on float32 ones): the extra columns are masked, every gradient as the PyTorch
    backend's; the launcher asked for V = 16's block once."""
    from attnkit.ops.path.triton import local

    assert local.value_block(16, torch.bfloat16) == 64 and local.value_block(32, torch.float16) == 64
    assert local.value_block(16, torch.float32) == 16 and local.value_block(96, torch.bfloat16) == 128
    widths = []
    monkeypatch.setattr(local, "value_block", lambda V, dtype: widths.append(V) or 64)
    inputs = [x.to(DEVICE) for x in make_inputs(2, 37, 2 * G, 2, 16, 16, gate=True, dtype=torch.float32)]
    do = torch.randn(2, 37, 2 * G, 16, device=DEVICE)
    actual = backend_grads(inputs, do, "triton")
    expected = backend_grads(inputs, do, "torch")
    for name, a, e in zip(GRAD_NAMES, actual, expected):
        assert_close(name, a, e, 1e-4)
    assert widths == [16]


@pytest.mark.parametrize("offsets", [None, [0, 40, 40, 150]], ids=["dense", "varlen"])
def test_query_terms_carry_in_float32_and_store_the_superblock_start_in_the_inputs_dtype(offsets):
    """The queries carried to their superblock's start (the sweep between superblocks reads them as 16-bit operands)
    come in ``q``'s dtype: a float16 run's are the float32 run's, rounded (exactly under the interpreter, whose dots
    are exact in both runs; on a GPU the float16 run's carries are 3xTF32, the float32 run's exact); the queries
    carried to their chunk's start stay float32."""
    from attnkit.ops.common.triton_utils import block_dim
    from attnkit.ops.path.triton import local, prepare

    q, k, _, w, beta, _ = (x.to(DEVICE) for x in make_inputs(1, 150, 4, 2, 16, 16, gate=True, dtype=torch.float16))
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE, dtype=torch.int32)
    chunk = 16
    outs = []
    for dtype in (torch.float16, torch.float32):
        qq, kk, ww, bb = q.to(dtype), k.to(dtype), w.to(dtype), beta.to(dtype)
        chunk_rows = prepare.chunk_offsets(cu, chunk)
        m = torch.zeros(40, 2, chunk, chunk, device=DEVICE)
        kt, mw = torch.zeros(kk.shape, device=DEVICE), torch.zeros(kk.shape, device=DEVICE)
        prepare.path_prepare_kernel[(-(-150 // chunk), (1 if cu is None else 3) * 2)](
            kk, ww, bb, m, kt, mw, cu, chunk_rows, 150, -(-150 // chunk), H=2, K=16, BK=block_dim(16), BT=chunk,
            IS_VARLEN=cu is not None, PRECISION="ieee", WRITE_MW=True, num_warps=1,
        )  # fmt: skip
        outs.append(local.query_terms_fn(qq, ww, mw, cu, chunk, 2))
    (x16, xh16), (x32, xh32) = outs
    assert x16.dtype == x32.dtype == xh32.dtype == torch.float32 and xh16.dtype == torch.float16
    assert_close("x", x16, x32, 1e-6 if DEVICE == "cpu" else 1e-5)
    assert_close("xh", xh16.float(), xh32, 1e-3)  # float16 rounding
    assert not torch.equal(xh32, xh32.to(torch.float16).float())  # the float32 run's are not float16 values
    if DEVICE == "cpu":
        assert torch.equal(xh16, xh32.to(torch.float16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots are wrong under the interpreter")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-HQ{}-H{}-K{}-V{}-gate{}".format(*c))
def test_forward_matches_torch_backend_bf16(case):
    """The small cases in bfloat16 on a GPU, where the carries' precision follows the head dim
    (:func:`prepare.precisions`); the interpreter's bf16 dots are wrong, so these run on a GPU only."""
    check(*case, torch.bfloat16)
