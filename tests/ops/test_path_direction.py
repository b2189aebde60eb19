"""PaTH's fused directions (``attnkit::path_direction``: causal depthwise convolution restarted per sequence, silu, L2
normalisation per head) against the formula in float64, forward and both gradients; and the layer with
``backend="triton"`` (which runs the fused op) against ``backend="torch"`` (the PyTorch glue).

On CPU the kernels run through Triton's interpreter (``conftest.py``) with 16-position blocks, so the short
sequences here cross blocks; every case is a few dozen tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.layers import PaTHAttention
from attnkit.ops.common.utils import segment_bounds
from attnkit.ops.path.triton import direction
from attnkit.ops.path.triton.direction import path_direction, path_direction_op
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(u: torch.Tensor, weight: torch.Tensor, heads: int, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """The formula, sequence by sequence (empty ones left out) through ``F.conv1d`` left-padded by ``W − 1``, in
    ``u``'s dtype."""
    B, T, C = u.shape
    W = weight.shape[1]
    bounds = [(0, T)] if cu_seqlens is None else segment_bounds(cu_seqlens, T)
    parts = [u[:, bos:eos].transpose(1, 2) for bos, eos in bounds if eos > bos]
    conv = torch.cat([F.conv1d(F.pad(x, (W - 1, 0)), weight[:, None], groups=C) for x in parts], 2).transpose(1, 2)
    return F.normalize(F.silu(conv).view(B, T, heads, C // heads), dim=-1)


def check(B, T, H, D, W, offsets=None, dtype=torch.float32, u_layout="contiguous", grads=True, tol=1e-5):
    C = H * D
    if u_layout == "transposed":  # [B, C, T] storage: u's channels are T apart
        u = torch.randn(B, C, T, device=DEVICE).transpose(1, 2)
    elif u_layout == "strided":  # every other channel of a wider tensor
        u = torch.randn(B, T, 2 * C, device=DEVICE)[..., ::2]
    else:
        u = torch.randn(B, T, C, device=DEVICE)
    u = u.to(dtype).requires_grad_()
    weight = torch.randn(C, W, device=DEVICE).requires_grad_()
    cu = None if offsets is None else torch.tensor(offsets, device=DEVICE)
    actual = path_direction(u, weight, H, cu)
    u64, w64 = (x.detach().double().requires_grad_() for x in (u, weight))
    expected = reference(u64, w64, H, cu)
    assert actual.dtype == torch.float32
    assert_close("w", actual, expected.float(), tol)
    if not grads:
        return
    dw = torch.randn_like(actual)
    du, dweight = torch.autograd.grad(actual, (u, weight), dw)
    du_ref, dweight_ref = torch.autograd.grad(expected, (u64, w64), dw.double())
    assert du.dtype == dtype and dweight.dtype == torch.float32
    assert_close("du", du, du_ref.to(dtype), tol)
    assert_close("dweight", dweight, dweight_ref.float(), tol)


# B, T, H, D, W
DENSE = [
    (2, 37, 2, 16, 3),  # partial last block
    (1, 20, 3, 48, 4),  # D not a power of two
    (2, 33, 1, 64, 1),  # no mixing of tokens
    (1, 5, 2, 16, 4),  # shorter than a block
]


@pytest.mark.parametrize("case", DENSE, ids=lambda c: "B{}-T{}-H{}-D{}-W{}".format(*c))
def test_dense(case):
    check(*case)


@pytest.mark.parametrize("D, W", [(16, 1), (16, 3), (48, 4)], ids=["D16-W1", "D16-W3", "D48-W4"])
def test_packed(D, W):
    """An empty sequence, sequences shorter than ``W``, and one that crosses blocks."""
    check(1, 40, 2, D, W, offsets=[0, 2, 2, 3, 21, 40])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_input(dtype):
    """16-bit ``u`` read in float32: the forward and ``dweight`` are float32-accurate on the rounded input, ``du``
    comes rounded to ``u``'s dtype."""
    check(1, 24, 2, 16, 4, offsets=[0, 3, 24], dtype=dtype, grads=False)
    check(2, 20, 1, 48, 3, dtype=dtype, tol=5e-3)


@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_non_contiguous_u(layout):
    check(2, 20, 2, 16, 3, u_layout=layout)
    check(1, 30, 2, 16, 4, offsets=[0, 7, 30], u_layout=layout)


def test_zero_direction_and_empty_input():
    """``silu(conv) = 0`` gives ``w = 0`` and the gradient ``dw / ε`` of ``F.normalize``; no token, no launch."""
    u = torch.zeros(1, 4, 16, device=DEVICE, requires_grad=True)
    weight = torch.ones(16, 2, device=DEVICE, requires_grad=True)
    w = path_direction(u, weight, 1)
    assert torch.equal(w, torch.zeros_like(w))
    (du,) = torch.autograd.grad(w[0, 0, 0, 0] * 1e-12, u)
    assert torch.allclose(du[0, 0, 0], torch.tensor(0.5, device=DEVICE))  # (dw / ε) · silu'(0) · weight = 0.5
    empty = torch.zeros(2, 0, 32, device=DEVICE, requires_grad=True)
    w = path_direction(empty, weight.detach().repeat(2, 1), 2)
    assert w.shape == (2, 0, 2, 16)
    assert torch.autograd.grad(w.sum(), empty)[0].shape == empty.shape


def test_opcheck():
    u = torch.randn(1, 10, 32, device=DEVICE, requires_grad=True)
    weight = torch.randn(32, 3, device=DEVICE, requires_grad=True)
    torch.library.opcheck(path_direction_op, (u, weight, torch.tensor([0, 4, 10], device=DEVICE), 2))
    torch.library.opcheck(path_direction_op, (u, weight, None, 2))


def test_validation():
    u, weight = torch.randn(1, 4, 32), torch.randn(32, 3)
    with pytest.raises(ValueError, match="heads"):
        path_direction(u, weight, 3)
    with pytest.raises(ValueError, match="u, weight"):
        path_direction(u, weight[:16], 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        path_direction(u.expand(2, -1, -1), weight, 2, torch.tensor([0, 4]))


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_layer_triton_matches_torch(monkeypatch, packed):
    """The layer's output and every parameter's gradient, fused directions and Triton attention against the PyTorch
    glue and backend (both float32)."""
    calls = []
    monkeypatch.setattr(direction, "path_direction", lambda *a: calls.append(1) or path_direction(*a))
    layers = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        layers[backend] = PaTHAttention(32, 2, head_dim=16, conv_size=3, use_forget_gate=True, backend=backend)
        layers[backend].to(DEVICE)
    x = torch.randn(1 if packed else 2, 23, 32, device=DEVICE)
    cu = torch.tensor([0, 2, 2, 17, 23], device=DEVICE) if packed else None
    outs = {backend: layer(x, cu_seqlens=cu)[0] for backend, layer in layers.items()}
    assert calls == [1]
    assert_close("o", outs["triton"], outs["torch"], 1e-5)
    do = torch.randn_like(outs["torch"])
    for out in outs.values():
        out.backward(do)
    for name, p in layers["torch"].named_parameters():
        assert_close(name, dict(layers["triton"].named_parameters())[name].grad, p.grad, 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need a GPU")
def test_real_size_bf16_on_gpu():
    """B = 4, T = 4096, H·D = 1024 (16 heads of 64) with bf16 ``u``, against the layer's PyTorch glue under the same
    rounding (float32 arithmetic on the bf16 input); ``du`` is rounded to bf16 by both."""
    layer = PaTHAttention(1024, 16, conv_size=4).cuda()
    u = torch.randn(4, 4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = layer.w_conv.weight
    results = {}
    for fused in (False, True):
        w = layer._conv_direction(u, None, fused=fused)
        dw = torch.randn(w.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        results[fused] = (w, *torch.autograd.grad(w, (u, weight), dw))
    for name, actual, expected in zip(("w", "du", "dweight"), results[True], results[False], strict=True):
        assert_close(name, actual, expected, 1e-5 if name != "du" else 5e-3)


def test_backward_tiles_on_a_gpu(monkeypatch):
    """The backward's tiles off the interpreter: about 512 floats a warp and 8 positions at least (8 on one warp at
    D = 64, the H100's fastest in ``benchmarks/results/direction_tune_session36_h100.json``), so its row reductions stay
    inside a warp up to D = 64."""
    monkeypatch.setattr(direction, "interpreting", lambda: False)
    assert [direction.backward_tiles(D) for D in (16, 32, 48, 64, 128, 256)] == [
        (32, 1), (16, 1), (8, 1), (8, 1), (8, 2), (8, 4),
    ]  # fmt: skip
