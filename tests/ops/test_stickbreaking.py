"""Stick-breaking attention (arXiv 2410.17980): the blockwise PyTorch backend against the definitional loops, its
hand-written backward, packing, decoding, and the bound on what it allocates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from attnkit.ops import stickbreaking_attention
from attnkit.ops.stickbreaking import stickbreaking_decode_step
from attnkit.ops.stickbreaking.naive import stickbreaking_naive
from tests.helpers import assert_close, tol_for


def make_inputs(B, T, HQ, H, K, V, dtype=torch.float64, spread=1.0):
    """Drawn in float32 so that a float32 run and the float64 reference see exactly the same inputs."""
    q, k, v = torch.randn(B, T, HQ, K) * spread, torch.randn(B, T, H, K) * spread, torch.randn(B, T, H, V)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run(fn, inputs, do, dtype, **kwargs):
    """``(o, dq, dk, dv)`` of ``fn`` in ``dtype``; a gradient the output does not depend on is zero."""
    inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    o = fn(*inputs, **kwargs)
    if not o.requires_grad:  # the loops build no graph when no query sees a key (T = 1, strictly causal)
        return (o, *(torch.zeros_like(x) for x in inputs))
    return (o, *torch.autograd.grad(o, inputs, do.to(o.dtype), allow_unused=True, materialize_grads=True))


# B, T, HQ, H, K, V, block size: odd lengths, blocks that do not divide T, one block, blocks of one position
SHAPES = [
    (2, 1, 2, 2, 8, 8, 4),
    (2, 37, 4, 2, 16, 16, 8),
    (1, 64, 4, 1, 8, 12, 16),
    (2, 50, 2, 2, 16, 8, 64),
    (1, 23, 3, 3, 4, 4, 1),
]
SHAPE_IDS = [f"B{b}-T{t}-HQ{hq}-H{h}-K{k}-V{v}-BS{bs}" for b, t, hq, h, k, v, bs in SHAPES]


@pytest.mark.parametrize("attend_current", [False, True], ids=["strict", "current"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_matches_naive_forward_and_backward(shape, dtype, attend_current):
    *dims, block_size = shape
    B, T, HQ, H, K, V = dims
    inputs = make_inputs(*dims)
    do = torch.randn(B, T, HQ, V, dtype=torch.float64)
    expected = run(stickbreaking_naive, inputs, do, torch.float64, attend_current=attend_current)
    actual = run(stickbreaking_attention, inputs, do, dtype, attend_current=attend_current, block_size=block_size)
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
        assert a.dtype == dtype, name
        assert_close(name, a, e, tol_for(dtype))


@pytest.mark.parametrize("attend_current", [False, True], ids=["strict", "current"])
def test_gradcheck(attend_current):
    """The hand-written blockwise backward against finite differences, GQA and three blocks."""
    q, k, v = make_inputs(1, 7, 4, 2, 3, 2)
    inputs = tuple(x.requires_grad_() for x in (q, k, v))
    fn = lambda q, k, v: stickbreaking_attention(q, k, v, attend_current=attend_current, block_size=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


def test_large_logits_stay_finite_and_accurate():
    """Logits of order ±50: the log-space products neither overflow nor lose the float64 answer in float32."""
    inputs = make_inputs(1, 200, 2, 1, 16, 16, spread=3.0)
    do = torch.randn(1, 200, 2, 16, dtype=torch.float64)
    expected = run(stickbreaking_attention, inputs, do, torch.float64, block_size=32)
    assert_close("o-fp64", expected[0], stickbreaking_naive(*inputs), 1e-10)
    actual = run(stickbreaking_attention, inputs, do, torch.float32, block_size=32)
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
        assert_close(name, a, e, 1e-5 if name in ("o", "dv") else 1e-4)


@pytest.mark.parametrize("attend_current", [False, True], ids=["strict", "current"])
def test_constant_values_read_the_broken_stick(attend_current):
    """With ``v = 1`` the output is the stick broken off, ``1 − Π_j (1 − beta_ij)``, from a dense formula."""
    q, k, _ = make_inputs(1, 30, 2, 2, 8, 1)
    v = torch.ones(1, 30, 2, 1, dtype=torch.float64)
    o = stickbreaking_attention(q, k, v, attend_current=attend_current, block_size=7)[..., 0]
    z = torch.einsum("bihk,bjhk->bhij", q, k) * 8**-0.5
    visible = torch.ones(30, 30, dtype=torch.bool).tril(0 if attend_current else -1)
    remainder = (F.logsigmoid(-z) * visible).sum(-1).exp()  # [B, H, T]
    assert_close("broken", o, (1 - remainder).transpose(1, 2), 1e-12)
    if not attend_current:
        assert (o[:, 0] == 0).all()  # the first token sees no key


def test_recency():
    """Two keys that match the query equally: the nearer one takes its share first, the farther one the rest."""
    k = torch.zeros(1, 3, 1, 2, dtype=torch.float64)
    k[0, 0, 0, 0] = k[0, 1, 0, 0] = 10.0
    q = torch.zeros(1, 3, 1, 2, dtype=torch.float64)
    q[0, 2, 0, 0] = 1.0
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]], dtype=torch.float64).view(1, 3, 1, 2)
    o = stickbreaking_attention(q, k, v, scale=1.0)
    beta = torch.sigmoid(torch.tensor(10.0, dtype=torch.float64))
    assert torch.allclose(o[0, 2, 0], torch.stack([beta * (1 - beta), beta]), atol=1e-15)


def test_scale():
    q, k, v = make_inputs(2, 20, 2, 1, 8, 8)
    actual = stickbreaking_attention(q, k, v, scale=0.3, block_size=6)
    assert_close("o", actual, stickbreaking_naive(q, k, v, scale=0.3), 1e-12)


def test_block_size_does_not_change_the_result():
    q, k, v = make_inputs(1, 45, 2, 2, 8, 8)
    reference = stickbreaking_attention(q, k, v, block_size=45)
    for block_size in (1, 4, 16, 64):
        assert_close(f"BS{block_size}", stickbreaking_attention(q, k, v, block_size=block_size), reference, 1e-13)


def test_packed_sequences_restart():
    """``cu_seqlens``: every sequence alone, an empty and a one-token sequence among them; gradients too."""
    lengths = [5, 0, 17, 1, 9]
    T = sum(lengths)
    q, k, v = (x.requires_grad_() for x in make_inputs(1, T, 4, 2, 8, 8))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = stickbreaking_attention(q, k, v, cu_seqlens=cu, block_size=4)
    do = torch.randn_like(packed)
    grads = torch.autograd.grad(packed, (q, k, v), do)
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if eos == bos:
            continue
        sl = slice(bos, eos)
        alone = stickbreaking_naive(q[:, sl], k[:, sl], v[:, sl])
        assert_close(f"o[{bos}:{eos}]", packed[:, sl], alone, 1e-12)
        if alone.requires_grad:
            expected = torch.autograd.grad(alone, (q, k, v), do[:, sl])
            for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
                assert_close(f"{name}[{bos}:{eos}]", g[:, sl], e[:, sl], 1e-12)


@pytest.mark.parametrize("B, T", [(2, 0), (0, 5)], ids=["T0", "B0"])
def test_empty_inputs(B, T):
    q, k, v = (x.requires_grad_() for x in make_inputs(B, T, 4, 2, 8, 6))
    o = stickbreaking_attention(q, k, v)
    assert o.shape == (B, T, 4, 6) and o.dtype == v.dtype
    o.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_half_precision_inputs_and_autocast():
    """bfloat16 inputs compute in float32 inside and return bfloat16; autocast does not reach the blocks."""
    inputs = make_inputs(1, 40, 2, 1, 16, 16, dtype=torch.float32)
    expected = stickbreaking_attention(*inputs)
    o = stickbreaking_attention(*(x.bfloat16() for x in inputs))
    assert o.dtype == torch.bfloat16
    assert_close("bf16", o, expected, 2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = stickbreaking_attention(*inputs)
    assert o.dtype == torch.float32
    assert_close("autocast", o, expected, 1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any ATen operator returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), (str(func), tuple(t.shape))
        return out


def test_no_tensor_grows_like_t_squared():
    """Forward and backward: no operator returns more than an input's worth of elements, and what autograd saves
    doubles with ``T`` (it would quadruple if the weights were saved). A dense ``[B, HQ, T, T]`` tensor would be
    16× the inputs here."""
    B, HQ, H, D, BS = 1, 2, 1, 8, 32
    saved = {}
    for T in (256, 512):
        q, k, v = (x.float().requires_grad_() for x in make_inputs(B, T, HQ, H, D, D))
        saved[T] = 0

        def pack(t, T=T):
            saved[T] += t.numel() * t.element_size()
            return t

        largest = LargestTensor()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), largest:
            o = stickbreaking_attention(q, k, v, block_size=BS)
            o.sum().backward()
        assert largest.numel <= B * T * HQ * D, largest.shape
        assert largest.numel < B * HQ * T * T / 16
    assert saved[512] <= 2 * saved[256]


@pytest.mark.parametrize("attend_current", [False, True], ids=["strict", "current"])
def test_decode_steps_match_full_forward(attend_current):
    """Every position decoded against a left-padded cache equals the full forward (GQA)."""
    lengths = [11, 4]
    L = max(lengths)
    q, k, v = make_inputs(2, L, 4, 2, 8, 8)
    mask = torch.zeros(2, L, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, L - n :] = True
    full = [stickbreaking_attention(x[:, L - n :], y[:, L - n :], z[:, L - n :], attend_current=attend_current)
            for x, y, z, n in zip(q.split(1), k.split(1), v.split(1), lengths)]  # fmt: skip
    for t in range(L):
        o = stickbreaking_decode_step(
            q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], mask[:, : t + 1], attend_current=attend_current
        )
        for b, n in enumerate(lengths):
            if t >= L - n:
                assert_close(f"b{b}t{t}", o[b, 0], full[b][0, t - (L - n)], 1e-12)


def test_decode_without_mask_means_all_real():
    q, k, v = make_inputs(1, 9, 2, 1, 8, 8)
    expected = stickbreaking_attention(q, k, v)[:, -1:]
    assert_close("o", stickbreaking_decode_step(q[:, -1:], k, v, None), expected, 1e-12)


BAD = {
    "q-rank": (dict(q=torch.randn(8, 2, 4)), {}, "^q"),
    "heads": (dict(q=torch.randn(1, 8, 3, 4)), {}, "^q"),
    "k-shape": (dict(k=torch.randn(1, 7, 2, 4)), {}, "^k"),
    "v-dtype": (dict(v=torch.randn(1, 8, 2, 4, dtype=torch.float64)), {}, "^v"),
    "scale": ({}, dict(scale=-1.0), "^scale"),
    "attend-current": ({}, dict(attend_current=1), "^attend_current"),
    "block-size": ({}, dict(block_size=0), "^block_size"),
    "block-size-float": ({}, dict(block_size=8.0), "^block_size"),
    "cu-seqlens-batch": (
        dict(q=torch.randn(2, 8, 4, 4), k=torch.randn(2, 8, 2, 4), v=torch.randn(2, 8, 2, 4)),
        dict(cu_seqlens=torch.tensor([0, 8])),
        "^cu_seqlens",
    ),  # fmt: skip
    "cu-seqlens-order": ({}, dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "^cu_seqlens"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises(case):
    overrides, kwargs, match = BAD[case]
    inputs = dict(q=torch.randn(1, 8, 4, 4), k=torch.randn(1, 8, 2, 4), v=torch.randn(1, 8, 2, 4))
    inputs.update(overrides)
    with pytest.raises(ValueError, match=match):
        stickbreaking_attention(inputs["q"], inputs["k"], inputs["v"], **kwargs)


def test_decode_bad_input_raises():
    q, k, v = torch.randn(2, 1, 4, 4), torch.randn(2, 5, 2, 4), torch.randn(2, 5, 2, 4)
    with pytest.raises(ValueError, match="^q"):
        stickbreaking_decode_step(torch.randn(2, 2, 4, 4), k, v, None)
    with pytest.raises(ValueError, match="^cache_mask"):
        stickbreaking_decode_step(q, k, v, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="^scale"):
        stickbreaking_decode_step(q, k, v, None, scale=0.0)
    with pytest.raises(ValueError, match="^attend_current"):
        stickbreaking_decode_step(q, k, v, None, attend_current="yes")
