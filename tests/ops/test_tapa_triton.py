"""TAPA's Triton kernels against the PyTorch backend, forward and every gradient.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``) at tiny
shapes in float32 and float16 (the interpreter's bfloat16 ``tl.dot`` is wrong); on a GPU the same tests run
at real sizes in bfloat16 as well.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attnkit.ops.common.validation import data_checked
from attnkit.ops.tapa import tapa_attention
from attnkit.ops.tapa.parallel import tapa_bwd_op, tapa_fwd_op
from attnkit.ops.tapa.triton.backward import tapa_bwd_fn
from attnkit.ops.tapa.triton.forward import tapa_fwd_fn
from tests.helpers import assert_close

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="real sizes need a GPU; the interpreter runs the small cases")

# Triton vs the PyTorch backend on the same inputs. float32: the kernels' float32 dots are IEEE (no tf32), so
# only summation order and the cosine separate them. Half inputs: the SPEC §8 bars.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 1e-2), torch.bfloat16: (5e-3, 1e-2)}


def make(B, T, HQ, H, D, V, dtype, device=DEVICE):
    q = torch.randn(B, T, HQ, D, device=device).to(dtype)
    k = torch.randn(B, T, H, D, device=device).to(dtype)
    v = torch.randn(B, T, H, V, device=device).to(dtype)
    do = torch.randn(B, T, HQ, V, device=device).to(dtype)
    return q, k, v, do


def outputs(q, k, v, do, backend, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = tapa_attention(q, k, v, backend=backend, **kwargs)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def check(actual, expected, dtype):
    tol_o, tol_grad = TOL[dtype]
    for name, a, e, tol in zip(("o", "dq", "dk", "dv"), actual, expected, (tol_o, tol_grad, tol_grad, tol_grad)):
        assert a.dtype == e.dtype == dtype, name
        assert_close(name, a, e, tol)


# B, T, HQ, H, D, V, theta, alpha
CASES = [
    (2, 2, 2, 2, 16, 16, 0.5, 0.1),
    (2, 37, 4, 2, 32, 32, 0.5, 0.1),
    (1, 50, 4, 1, 32, 16, 0.5, 0.1),  # MQA, V != D
    (1, 45, 2, 1, 12, 8, 0.25, 0.5),  # dA = 3, dP = 9: masked channel blocks
    (1, 40, 2, 2, 32, 32, 0.5, 0.0),  # 0^0 = 0 on the diagonal only
    (1, 33, 2, 1, 64, 64, 0.75, 0.5),
]


def case_id(case):
    B, T, HQ, H, D, V, theta, alpha = case
    return f"B{B}-T{T}-HQ{HQ}-H{H}-D{D}-V{V}-theta{theta}-alpha{alpha}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_torch_backend(case, dtype):
    B, T, HQ, H, D, V, theta, alpha = case
    q, k, v, do = make(B, T, HQ, H, D, V, dtype)
    kwargs = dict(theta=theta, alpha=alpha)
    check(outputs(q, k, v, do, "triton", **kwargs), outputs(q, k, v, do, "torch", **kwargs), dtype)


@pytest.mark.parametrize(
    "offsets",
    [[0, 5, 37, 100], [0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token"],
)
def test_varlen_matches_torch_backend(offsets):
    q, k, v, do = make(1, offsets[-1], 4, 2, 32, 16, torch.float32)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    kwargs = dict(alpha=0.5, cu_seqlens=cu_seqlens)
    check(outputs(q, k, v, do, "triton", **kwargs), outputs(q, k, v, do, "torch", **kwargs), torch.float32)


def test_packed_sequences_read_nothing_on_the_host(monkeypatch):
    """The kernels find their sequence on the device (``triton_seq.launch_grid``): a packed forward and backward
    never read ``cu_seqlens`` back (a synchronisation on CUDA; it was one per launch), nor does the op when its
    caller checked them and ``T`` bounds the distances for ``alpha``."""
    q, k, v, do = make(1, 60, 4, 2, 32, 16, torch.float32)
    cu = torch.tensor([0, 7, 7, 60], dtype=torch.int32, device=DEVICE)
    expected = outputs(q, k, v, do, "torch", alpha=0.5, cu_seqlens=cu)

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a device tensor")

    for name in ("item", "tolist", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    o, lse = tapa_fwd_fn(q, k, v, 16, 0.5, cu)
    grads = tapa_bwd_fn(q, k, v, o, lse, do, 16, 0.5, cu)
    with data_checked():  # as a layer calls the op, having checked cu_seqlens itself
        public = outputs(q, k, v, do, "triton", alpha=0.5, cu_seqlens=cu)
    monkeypatch.undo()
    check((o, *grads), expected, torch.float32)
    check(public, expected, torch.float32)


# (BM, BN, num_warps, num_stages) of the GPU: several key blocks per query block cross the diagonal, and the
# atomic dQ path of the backward.
GPU_CONFIGS = {
    "gpu-blocks": ((128, 64, 8, 2), {"dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 2), "atomic_dq": False}),
    "atomic-dq": ((64, 32, 4, 2), {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2), "atomic_dq": True}),
}


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
@pytest.mark.parametrize("cu_seqlens", [None, [0, 70, 200, 203]], ids=["dense", "varlen"])
def test_block_configs(name, cu_seqlens):
    fwd_config, bwd_config = GPU_CONFIGS[name]
    T = 203
    q, k, v, do = make(1, T, 4, 2, 32, 32, torch.float32)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    o, lse = tapa_fwd_fn(q, k, v, 16, 0.3, cu, config=fwd_config)
    grads = tapa_bwd_fn(q, k, v, o, lse, do, 16, 0.3, cu, config=bwd_config)
    expected = outputs(q, k, v, do, "torch", alpha=0.3, cu_seqlens=cu)
    check((o, *grads), expected, torch.float32)


def test_large_phases_stay_accurate():
    """alpha = 0.5 at T = 400 gives d^alpha up to 20 and phases of ~100 rad (more than alpha = 0.1 at T = 64k):
    the reduction to [-1/2, 1/2] cycles keeps float32 kernels within float32 rounding of the float64 backend."""
    q, k, v, do = make(1, 400, 2, 1, 16, 16, torch.float32)
    actual = outputs(q, k, v, do, "triton", alpha=0.5)
    expected = outputs(*(x.double() for x in (q, k, v, do)), "torch", alpha=0.5)
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected):
        assert_close(name, a, e, 1e-4)


def test_opcheck():
    q, k, v, do = make(1, 19, 2, 1, 16, 16, torch.float32)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(tapa_fwd_op, (q, k, v, None, 8, 0.1))
    o, lse = tapa_fwd_op(q, k, v, None, 8, 0.1)
    assert not lse.requires_grad
    inputs = (do, *(x.detach() for x in (q, k, v, o)), lse, None, 8, 0.1)
    torch.library.opcheck(tapa_bwd_op, inputs)


def test_compiles_without_graph_breaks():
    q, k, v, do = make(1, 21, 2, 1, 16, 16, torch.float32)

    def f(q, k, v):
        return tapa_attention(q, k, v, alpha=0.2, backend="triton") * 2

    results = []
    for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
        x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = fn(*x)
        results.append((o, *torch.autograd.grad(o, x, do)))
    check(*results, torch.float32)


def test_auto_picks_triton_on_cuda_only(monkeypatch):
    calls = []
    import attnkit.ops.tapa.parallel as parallel

    monkeypatch.setattr(parallel, "tapa_triton", lambda *args: calls.append(args) or args[0])
    q, k, v, _ = make(1, 4, 1, 1, 8, 8, torch.float32)
    tapa_attention(q, k, v)
    assert len(calls) == (1 if CUDA else 0)
    tapa_attention(q.double(), k.double(), v.double())  # float64 stays on the PyTorch backend
    assert len(calls) == (1 if CUDA else 0)


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda q, k, v: (q.double(), k.double(), v.double()), "float64"),
        (lambda q, k, v: (q.new_zeros(1, 4, 1, 300), k.new_zeros(1, 4, 1, 300), v), "head dims"),
    ],
    ids=["float64", "head-dim-300"],
)
def test_bad_input_names_backend(make_bad, match):
    q, k, v, _ = make(1, 4, 1, 1, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=f"backend: .*{match}"):
        tapa_attention(*make_bad(q, k, v), backend="triton")


def test_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, _ = make(1, 4, 1, 1, 8, 8, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="backend: .*CUDA"):
        tapa_attention(q, k, v, backend="triton")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, T, HQ, H, D", [(4, 4096, 8, 8, 128), (2, 8192, 16, 4, 64), (1, 65536, 2, 2, 128)], ids=str)
def test_real_sizes_on_gpu(B, T, HQ, H, D, dtype):
    q, k, v, do = make(B, T, HQ, H, D, D, dtype)
    check(outputs(q, k, v, do, "triton"), outputs(q, k, v, do, "torch"), dtype)


@needs_cuda
def test_real_sizes_varlen_on_gpu():
    cu = torch.tensor([0, 1000, 1001, 5000, 12288], device="cuda")
    q, k, v, do = make(1, 12288, 8, 2, 128, 128, torch.bfloat16)
    kwargs = dict(cu_seqlens=cu)
    check(outputs(q, k, v, do, "triton", **kwargs), outputs(q, k, v, do, "torch", **kwargs), torch.bfloat16)


def test_imports_without_triton():
    """Triton is a Linux-only dependency: the package and its PyTorch backends must import without it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, attnkit, attnkit.ops, attnkit.layers\n"
        "from attnkit.ops import tapa_attention\n"
        "q = torch.randn(1, 5, 2, 8)\n"
        "assert tapa_attention(q, q, q).shape == (1, 5, 2, 8)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_opcheck_with_strided_inputs():
    """Fakes must report the strides the kernels produce (contiguous), also for strided inputs."""
    q, k, v, do = make(1, 19, 2, 1, 16, 16, torch.float32)
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not q.is_contiguous()
    o, lse = tapa_fwd_op(q, k, v, None, 8, 0.1)
    torch.library.opcheck(tapa_bwd_op, (do, q, k, v, o, lse, None, 8, 0.1))
