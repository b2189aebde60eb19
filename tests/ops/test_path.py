"""PaTH / PaTH-FoX: the chunked PyTorch backend against the definitional loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops import path_attention
from attnkit.ops.path import path_carry_keys, path_decode_step
from attnkit.ops.path.naive import path_naive
from attnkit.ops.path.torch_impl import chunk_path_fwd
from tests.helpers import assert_close, tol_for

NAMES = ("q", "k", "v", "w", "beta", "g")


def make_inputs(B, T, HQ, H, K, V, *, gate=True, dtype=torch.float64, beta_low=1.5):
    q = torch.randn(B, T, HQ, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    w = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    beta = beta_low + (2 - beta_low) * torch.rand(B, T, H, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HQ, dtype=dtype) + 2) if gate else None
    return q, k, v, w, beta, g


def with_grad(inputs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in inputs]


def grads(out, inputs, do):
    out.backward(do)
    return [None if x is None else x.grad for x in inputs]


CASES = [
    # B, T, HQ, H, K, V, gate
    (2, 1, 2, 2, 16, 16, False),
    (2, 2, 2, 2, 16, 8, True),
    (1, 63, 4, 2, 16, 32, True),
    (2, 100, 4, 4, 32, 16, False),
    (1, 100, 4, 1, 16, 16, True),
    (1, 130, 2, 2, 16, 24, True),
]


def case_id(c):
    return f"B{c[0]}-T{c[1]}-HQ{c[2]}-H{c[3]}-K{c[4]}-V{c[5]}-{'fox' if c[6] else 'path'}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_chunked_matches_naive(case, dtype):
    B, T, HQ, H, K, V, gate = case
    ref_inputs = with_grad(make_inputs(B, T, HQ, H, K, V, gate=gate))
    inputs = with_grad([None if x is None else x.detach().to(dtype) for x in ref_inputs])
    ref = path_naive(*ref_inputs)
    out = path_attention(*inputs, backend="torch")
    assert out.dtype == dtype
    assert_close("o", out, ref, tol_for(dtype))
    do = torch.randn_like(ref)
    ref_grads = grads(ref, ref_inputs, do)
    out_grads = grads(out, inputs, do.to(dtype))
    for name, a, b in zip(NAMES, out_grads, ref_grads):
        if b is not None:
            assert_close(f"d{name}", a, b, tol_for(dtype))


@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_small_chunks_match_naive(chunk_size):
    inputs = make_inputs(2, 37, 4, 2, 8, 8)
    ref = path_naive(*inputs)
    out = chunk_path_fwd(*inputs, scale=8**-0.5, chunk_size=chunk_size)
    assert_close("o", out, ref, 1e-10)


def test_beta_near_two_long_sequence():
    # eigenvalue 1 - beta close to -1 over many transitions: the products must stay bounded
    inputs = make_inputs(1, 400, 2, 2, 16, 16, gate=False, beta_low=1.99)
    ref = path_naive(*inputs)
    out32 = path_attention(*[None if x is None else x.float() for x in inputs], backend="torch")
    assert_close("o", out32, ref, 1e-5)


def test_cu_seqlens_equals_separate_sequences():
    lengths = [5, 0, 37, 1, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = with_grad(make_inputs(1, sum(lengths), 4, 2, 16, 8))
    out = path_attention(*inputs, cu_seqlens=cu)
    do = torch.randn_like(out)
    out_grads = grads(out, inputs, do)
    ref_inputs = with_grad([x.detach() for x in inputs])
    ref_parts = []
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if eos > bos:
            ref_parts.append(path_naive(*[x[:, bos:eos] for x in ref_inputs]))
    ref = torch.cat(ref_parts, dim=1)
    assert_close("o", out, ref, 1e-10)
    for name, a, b in zip(NAMES, out_grads, grads(ref, ref_inputs, do)):
        assert_close(f"d{name}", a, b, 1e-10)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
def test_gradcheck(gate):
    inputs = with_grad(make_inputs(1, 9, 2, 1, 4, 3, gate=gate))

    def fn(*xs):
        return chunk_path_fwd(*xs, scale=0.7, chunk_size=4)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
@pytest.mark.parametrize("prefill", [0, 1, 40])
def test_decoding_identity(gate, prefill):
    """Prefill (keys carried to the end) + rank-one cache updates + softmax decoding == full forward."""
    T = 75
    q, k, v, w, beta, g = make_inputs(2, T, 4, 2, 16, 8, gate=gate)
    full = path_attention(q, k, v, w, beta, g)
    k_cache = path_carry_keys(k[:, :prefill], w[:, :prefill], beta[:, :prefill])
    v_cache = v[:, :prefill]
    g_cache = None if g is None else g[:, :prefill].cumsum(1)
    outs = []
    for t in range(prefill, T):
        step = [x[:, t : t + 1] for x in (q, k, v, w, beta)]
        gt = None if g is None else g[:, t : t + 1]
        o, k_cache, v_cache, g_cache = path_decode_step(*step, k_cache, v_cache, gt, g_cache)
        outs.append(o)
    assert_close("decode", torch.cat(outs, dim=1), full[:, prefill:], 1e-10)
    assert_close("k_cache", k_cache, path_carry_keys(k, w, beta), 1e-10)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
def test_decoding_with_left_padded_cache(gate):
    """cache_mask keeps padding slots out: sequence 1 is the tail of a shorter prompt behind junk slots."""
    T, P, pad = 30, 12, 5
    q, k, v, w, beta, g = make_inputs(2, T, 4, 2, 16, 8, gate=gate)
    full = path_attention(q, k, v, w, beta, g)
    short = path_attention(*(None if x is None else x[1:, pad:] for x in (q, k, v, w, beta, g)))
    # row 0 holds its first P tokens; row 1 junk in pad slots, then its tokens pad..P-1 (a sequence from pad)
    row1 = path_carry_keys(k[1:, pad:P], w[1:, pad:P], beta[1:, pad:P])
    row1 = torch.cat([torch.randn(1, pad, 2, 16, dtype=k.dtype), row1], dim=1)
    k_cache = torch.cat([path_carry_keys(k[:1, :P], w[:1, :P], beta[:1, :P]), row1])
    v_cache = v[:, :P].clone()
    v_cache[1, :pad] = torch.randn(pad, 2, 8, dtype=v.dtype)
    g_cache = None
    if g is not None:
        g_cache = g[:, :P].clone()
        g_cache[0] = g[0, :P].cumsum(0)
        g_cache[1, :pad] = torch.randn(pad, 4, dtype=g.dtype)
        g_cache[1, pad:] = g[1, pad:P].cumsum(0)
    mask = torch.ones(2, P, dtype=torch.bool)
    mask[1, :pad] = False
    outs = []
    for t in range(P, T):
        mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
        step = [x[:, t : t + 1] for x in (q, k, v, w, beta)]
        gt = None if g is None else g[:, t : t + 1]
        o, k_cache, v_cache, g_cache = path_decode_step(*step, k_cache, v_cache, gt, g_cache, cache_mask=mask)
        outs.append(o)
    out = torch.cat(outs, dim=1)
    assert_close("row0", out[:1], full[:1, P:], 1e-10)
    assert_close("row1", out[1:], short[:, P - pad :], 1e-10)
    with pytest.raises(ValueError, match="^cache_mask"):  # the mask must also cover the new token
        path_decode_step(*step, k_cache, v_cache, gt, g_cache, cache_mask=mask)


def test_carry_keys_matches_definition_and_cu_seqlens():
    _, k, _, w, beta, _ = make_inputs(1, 90, 2, 2, 8, 8, gate=False)
    carried = path_carry_keys(k, w, beta)
    expected = k.clone()
    for j in range(90):
        x = k[:, j]
        for s in range(j + 1, 90):
            x = x - (beta[:, s] * (w[:, s] * x).sum(-1))[..., None] * w[:, s]
        expected[:, j] = x
    assert_close("carried", carried, expected, 1e-10)
    cu = torch.tensor([0, 30, 90])
    packed = path_carry_keys(k, w, beta, cu_seqlens=cu)
    parts = [path_carry_keys(k[:, a:b], w[:, a:b], beta[:, a:b]) for a, b in ((0, 30), (30, 90))]
    assert_close("packed", packed, torch.cat(parts, dim=1), 1e-12)


def test_low_precision_inputs_keep_dtype():
    q, k, v, w, beta, g = make_inputs(1, 50, 2, 2, 16, 16, dtype=torch.float32)
    ref = path_attention(q, k, v, w, beta, g)
    for dtype in (torch.float16, torch.bfloat16):
        out = path_attention(q.to(dtype), k.to(dtype), v.to(dtype), w, beta, g)
        assert out.dtype == dtype
        assert_close(str(dtype), out.float(), ref, 1e-2)


# --- bad input: one test per rule, each message names the argument -------------------------------


def good():
    return dict(zip(NAMES, make_inputs(1, 8, 4, 2, 8, 8, dtype=torch.float32)))


BAD = {
    "q-rank": (dict(q=torch.randn(1, 8, 4)), "^q"),
    "q-int": (dict(q=torch.ones(1, 8, 4, 8, dtype=torch.int64)), "^q"),
    "k-shape": (dict(k=torch.randn(1, 8, 2, 4)), "^k"),
    "k-dtype": (dict(k=torch.randn(1, 8, 2, 8, dtype=torch.float64)), "^k"),
    "v-shape": (dict(v=torch.randn(1, 7, 2, 8)), "^v"),
    "heads": (dict(k=torch.randn(1, 8, 3, 8), v=torch.randn(1, 8, 3, 8)), "^q"),
    "w-shape": (dict(w=torch.randn(1, 8, 2, 7)), "^w"),
    "beta-shape": (dict(beta=torch.rand(1, 8, 4)), "^beta"),
    "g-shape": (dict(g=torch.rand(1, 8, 2)), "^g"),
    "v-device": (dict(v=torch.randn(1, 8, 2, 8, device="meta")), "^v"),
    "w-device": (dict(w=torch.randn(1, 8, 2, 8, device="meta")), "^w"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_tensor_input(name):
    change, match = BAD[name]
    args = {**good(), **change}
    with pytest.raises(ValueError, match=match):
        path_attention(*(args[n] for n in NAMES))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(scale=float("nan")), "^scale"),
        (dict(scale=float("inf")), "^scale"),
        (dict(cu_seqlens=torch.tensor([0, 3, 2, 8])), "^cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0, 3, 7])), "^cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([0.0, 8.0])), "^cu_seqlens"),
        (dict(cu_seqlens=torch.tensor([[0, 8]])), "^cu_seqlens"),
        (dict(backend="cuda"), "^backend"),
    ],
    ids=["scale-nan", "scale-inf", "cu-non-monotone", "cu-end", "cu-dtype", "cu-rank", "backend"],
)
def test_bad_keyword(kwargs, match):
    with pytest.raises(ValueError, match=match):
        path_attention(*good().values(), **kwargs)


def test_cu_seqlens_needs_batch_one():
    args = [torch.cat([x, x]) for x in good().values()]
    with pytest.raises(ValueError, match="^cu_seqlens"):
        path_attention(*args, cu_seqlens=torch.tensor([0, 4, 8]))


@pytest.mark.parametrize("B, T", [(2, 0), (0, 20)], ids=["T0", "B0"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_empty_sequence_backward(backend, B, T):
    """T = 0 or B = 0: an empty output whose backward gives empty gradients, on both backends."""
    q, k, v, w = (torch.zeros(B, T, 2, 16, requires_grad=True) for _ in range(4))
    beta, g = (torch.zeros(B, T, 2, requires_grad=True) for _ in range(2))
    o = path_attention(q, k, v, w, beta, g, backend=backend)
    assert o.shape == (B, T, 2, 16)
    o.sum().backward()
    assert all(x.grad is not None and x.grad.numel() == 0 for x in (q, k, v, w, beta, g))
