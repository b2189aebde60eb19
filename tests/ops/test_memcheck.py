"""The kernels address only their arguments' memory (``tests/memcheck.py``), under the interpreter: PaTH, VLA,
DeltaNet, TAPA, FoX and linear attention forward and backward at odd lengths, GQA, packed sequences with empty ones
and K ≠ V, and PaTH with the GPU's chunks, precisions and 16-bit buffers too (the configuration a GPU launches,
emulated here: the interpreter's bf16 products are wrong, but their addresses are the GPU's)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnkit.ops import delta_rule
from attnkit.ops.path import path_attention
from attnkit.ops.vla import vla_attention
from tests import memcheck
from tests.ops.test_path import make_inputs as path_inputs
from tests.ops.test_vla import make_inputs as vla_inputs
from tests.ops.test_vla import make_state

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter check (a GPU has compute-sanitizer)"),
    pytest.mark.skipif(not memcheck.available(), reason="this Triton's interpreter lacks the hooks the check patches"),
]


def backward(out, inputs):
    """Every gradient of ``out``'s tensors under random cotangents (what the backward kernels launch for)."""
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
    loss = sum((o.float() * torch.randn(o.shape)).sum() for o in outs)
    return torch.autograd.grad(loss, [x for x in inputs if x is not None and x.requires_grad])


def test_check_catches_an_address_outside_the_arguments():
    import triton
    import triton.language as tl

    @triton.jit
    def shifted_copy(x, y, shift, n):
        o = tl.arange(0, 16)
        tl.store(y + o, tl.load(x + o + shift, mask=o < n, other=0.0), mask=o < 16)

    @triton.jit
    def shifted_add(y, shift, n):
        o = tl.arange(0, 8)
        tl.atomic_add(y + o + shift, 1.0, mask=o < n)

    x, y = torch.arange(8.0), torch.zeros(16)
    with memcheck.interpreter_memcheck() as launched:
        shifted_copy[(1,)](x, y, 0, 8)  # masked past x's end: in bounds
        with pytest.raises(Exception, match="create_masked_load of 4 of 8 elements outside"):
            shifted_copy[(1,)](x, y, 4, 8)
        with pytest.raises(Exception, match="create_masked_load"):
            shifted_copy[(1,)](x[2:], y, 0, 8)  # a view: its storage's end is x's
        shifted_copy[(1,)](x[:4], y, 0, 8)  # past the view, inside its storage: not this check's to see
        shifted_add[(1,)](y, 8, 8)
        with pytest.raises(Exception, match="create_atomic_rmw of 2 of 8 elements outside"):
            shifted_add[(1,)](y, 10, 8)
    assert launched == ["shifted_copy"] * 4 + ["shifted_add"] * 2
    assert torch.equal(y[:8], x) and torch.equal(y[8:], torch.ones(8))


PATH_CASES = {  # B, T, HQ, H, K, V, gate, dtype, cu_seqlens
    "odd-gqa-fox": (2, 37, 4, 2, 16, 16, True, torch.float32, None),
    "superblocks-k24-v40": (1, 70, 2, 1, 24, 40, True, torch.float32, None),
    "packed-empty": (1, 80, 4, 2, 16, 16, True, torch.float32, [0, 0, 5, 5, 40, 80]),
    "fp16-padded": (2, 37, 2, 2, 16, 16, False, torch.float16, None),
    "k256": (1, 20, 2, 2, 256, 32, False, torch.float32, None),
}


@pytest.mark.parametrize("case", PATH_CASES.values(), ids=PATH_CASES.keys())
def test_path_kernels_stay_inside_their_arguments(case):
    B, T, HQ, H, K, V, gate, dtype, offsets = case
    inputs = list(path_inputs(B, T, HQ, H, K, V, gate=gate, dtype=torch.float32))
    inputs[:3] = [x.to(dtype) for x in inputs[:3]]
    inputs = [None if x is None else x.requires_grad_() for x in inputs]
    cu = None if offsets is None else torch.tensor(offsets)
    with memcheck.interpreter_memcheck() as launched:
        backward(path_attention(*inputs, cu_seqlens=cu, backend="triton"), inputs)
    assert "path_local_bwd_kernel" in launched and "path_fwd_kernel" in launched, launched


@pytest.fixture
def gpu_configuration(monkeypatch):
    """The launches a GPU makes: 64-position chunks, 512-position superblocks, the 16-bit settings where measured
    (bf16 at a padded K of 64), TF32 and bf16x3 precisions (which the interpreter takes as exact)."""
    import triton.runtime.interpreter as interpreter

    from attnkit.ops.path.triton import backward, backward_super, forward, local, prepare

    for module in (prepare, backward, backward_super, forward, local):
        monkeypatch.setattr(module, "interpreting", lambda: False)
    monkeypatch.setattr(prepare, "launch_config", lambda: dict(num_warps=1, num_stages=1))
    builder = interpreter.interpreter_builder
    precisions = (*builder.options.allowed_dot_input_precisions, "bf16x3", "bf16x6")
    monkeypatch.setattr(
        builder, "options", dataclasses.replace(builder.options, allowed_dot_input_precisions=precisions)
    )


@pytest.mark.parametrize("T, HQ, gate", [(24, 2, False), (77, 4, True)], ids=["autocast-model", "small-head-dims-test"])
def test_path_kernels_stay_inside_their_arguments_as_a_gpu_launches_them(gpu_configuration, monkeypatch, T, HQ, gate):
    """The shapes of the D = 16 model under bf16 autocast (an illegal memory access in the local adjoint on the GPU,
    twenty-first session) and of ``test_bf16_small_head_dims_on_gpu[16]``: bf16 ``q, k, v`` (padded to K = 64) and
    ``beta``, float32 ``w``, as the GPU launches them. In bounds here: the GPU's fault is not the kernels' indexing."""
    from attnkit.ops.path.triton import local

    inputs = list(path_inputs(2, T, HQ, 2, 16, 16, gate=gate, dtype=torch.float32))
    inputs[:3] = [x.to(torch.bfloat16) for x in inputs[:3]]
    inputs[4] = inputs[4].to(torch.bfloat16)  # beta as both came to the op: bf16 under autocast, until this session
    inputs = [None if x is None else x.requires_grad_() for x in inputs]
    seen, local_bwd = [], local.local_bwd_fn

    def spy(*args):
        seen.append((args[0].shape[-1], args[-3]))  # the padded K and the chunk (then offsets and dv_out)
        return local_bwd(*args)

    monkeypatch.setattr(local, "local_bwd_fn", spy)
    with memcheck.interpreter_memcheck():
        backward(path_attention(*inputs, backend="triton"), inputs)
    assert seen == [(64, 64)]


@pytest.mark.parametrize("offsets", [None, [0, 0, 13, 13, 61]], ids=["odd", "packed-empty"])
def test_vla_and_deltanet_kernels_stay_inside_their_arguments(offsets):
    B, T, H, K, V = (2, 37, 2, 16, 24) if offsets is None else (1, 61, 2, 16, 24)
    N = B if offsets is None else len(offsets) - 1
    cu = None if offsets is None else torch.tensor(offsets)
    q, k, v, u = (x.float().requires_grad_() for x in vla_inputs(B, T, H, K, V))
    state = [s.float().requires_grad_() for s in make_state(N, H, K, V, 0.1)]
    with memcheck.interpreter_memcheck() as launched:
        out = vla_attention(q, k, v, u, initial_state=state, output_final_state=True, cu_seqlens=cu, backend="triton")
        backward((out[0], *out[1]), [q, k, v, u, *state])
        beta = (0.5 + torch.rand(B, T, H)).requires_grad_()
        s0 = torch.randn(N, H, V, K).requires_grad_()
        kn = torch.nn.functional.normalize(k.detach(), dim=-1).requires_grad_()
        out = delta_rule(q, kn, v, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu, backend="triton")
        backward(out, [q, kn, v, beta, s0])
    assert len(set(launched)) >= 6, launched


@pytest.mark.parametrize("offsets", [None, [0, 0, 13, 13, 61]], ids=["odd-gqa", "packed-empty"])
def test_tapa_fox_and_linear_kernels_stay_inside_their_arguments(offsets):
    from attnkit.ops import linear_attention, softmax_attention, tapa_attention

    B, T = (2, 37) if offsets is None else (1, 61)
    cu = None if offsets is None else torch.tensor(offsets)
    q, k, v = (torch.randn(B, T, h, 32).requires_grad_() for h in (4, 2, 2))
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, 4) + 2).requires_grad_()
    with memcheck.interpreter_memcheck() as launched:
        backward(tapa_attention(q, k, v, cu_seqlens=cu, backend="triton"), [q, k, v])
        backward(softmax_attention(q, k, v, g, cu_seqlens=cu, backend="triton"), [q, k, v, g])
        kv = [x.detach()[:, :, :2].abs().requires_grad_() for x in (q, k)] + [v]
        out, _ = linear_attention(*kv, cu_seqlens=cu, backend="triton")
        backward(out, kv)
    assert any("tapa" in n for n in launched) and any("fox" in n for n in launched), launched
    assert any("linear" in n for n in launched), launched
