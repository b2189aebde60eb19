"""FoX (``softmax_attention`` with a log forget gate): the blockwise PyTorch backend against the definitional loop in
float64, and the Triton kernels against the PyTorch backend, forward and every gradient.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by ``conftest.py``) at tiny shapes
in float32 and float16 (the interpreter's bfloat16 ``tl.dot`` is wrong); on a GPU the same tests run at real sizes
in bfloat16 as well.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import attnkit.ops.baselines.fox.torch_impl as torch_impl
import attnkit.ops.baselines.softmax as softmax
from attnkit.ops.baselines.softmax import softmax_attention, softmax_naive
from tests.helpers import OPERATOR_COUNT_IDS, OPERATOR_COUNT_SHAPES, assert_close, count_aten_ops

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="real sizes need a GPU; the interpreter runs the small cases")
NAMES = ("o", "dq", "dk", "dv", "dg")
# Triton vs the PyTorch backend on the same inputs. float32: the kernels' float32 dots are IEEE (no tf32), so only
# summation order separates them. Half inputs: the SPEC §8 bars.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-3, 1e-2), torch.bfloat16: (5e-3, 1e-2)}


def make(B, T, HQ, H, K, V, dtype=torch.float32, device=DEVICE):
    """Drawn in float32 and cast, so that runs in different dtypes see the same values."""
    q, k, v = torch.randn(B, T, HQ, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HQ) + 2)
    do = torch.randn(B, T, HQ, V)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, do)]


def grads(fn, inputs, do):
    """``(o, d<input>...)`` of ``fn`` on fresh leaves of ``inputs``."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = fn(*leaves)
    return (o, *torch.autograd.grad(o, leaves, do.to(o.dtype)))


def reference(*inputs, cu_seqlens=None):
    """The definitional loop, segment by segment (gates restart in each)."""
    if cu_seqlens is None:
        return softmax_naive(*inputs)
    bounds = cu_seqlens.tolist()
    return torch.cat([softmax_naive(*(x[:, a:b] for x in inputs)) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)


def check(actual, expected, dtype, names=NAMES):
    tol_o, tol_grad = TOL[dtype]
    for name, a, e in zip(names, actual, expected):
        assert a.dtype == e.dtype == dtype, name
        assert_close(name, a, e, tol_o if name == "o" else tol_grad)


# B, T, HQ, H, K, V
TORCH_CASES = [(2, 1, 2, 2, 8, 8), (2, 37, 4, 2, 16, 8), (1, 50, 4, 1, 8, 16), (1, 33, 3, 3, 12, 12)]


@needs_cuda
def test_gate_gradient_of_bf16_inputs():
    """The kernels' ``dg`` of bf16 inputs within the bar (1e-2) of float64 autograd on the same rounded values.
    ``delta`` comes from the bf16 output, so a row of the kernels' ``dS`` sums to its rounding error, not to zero;
    with the column sums alone that error went into every suffix sum of ``dg`` (3.1e-2 on an H200 at D = 128,
    T = 2048). Both sums from the same ``dS`` cancel it. (The PyTorch backend keeps its output in float32.)"""
    torch.manual_seed(0)
    q, k, v, g, do = make(2, 2048, 8, 8, 128, 128, dtype=torch.bfloat16)
    actual = grads(partial(softmax_attention, backend="triton"), (q, k, v, g), do)
    expected = grads(softmax_naive, [x.double() for x in (q, k, v, g)], do.double())
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(name, a.double(), e, 5e-3 if name == "o" else 1e-2)


@pytest.mark.parametrize("block", [8, 128], ids=["tiles-8", "tiles-default"])
@pytest.mark.parametrize(
    "case", TORCH_CASES, ids=[f"B{b}-T{t}-HQ{hq}-H{h}-K{k}-V{v}" for b, t, hq, h, k, v in TORCH_CASES]
)
def test_torch_backend_matches_definition(monkeypatch, case, block):
    """float64: the blockwise backend (several query and key tiles at ``block`` 8) against autograd through the
    definitional loop, every gradient; the gate's gradient comes from the column sums of dS alone."""
    monkeypatch.setattr(torch_impl, "BLOCK_T", block)
    q, k, v, g, do = make(*case, dtype=torch.float64, device="cpu")
    actual = grads(partial(softmax_attention, backend="torch"), (q, k, v, g), do)
    expected = grads(softmax_naive, (q, k, v, g), do)
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(name, a, e, 1e-12)


@pytest.mark.parametrize(
    "offsets", [[0, 5, 37, 100], [0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token"],
)  # fmt: skip
def test_torch_backend_varlen_matches_definition(monkeypatch, offsets):
    monkeypatch.setattr(torch_impl, "BLOCK_T", 16)
    q, k, v, g, do = make(1, offsets[-1], 4, 2, 8, 8, dtype=torch.float64, device="cpu")
    cu = torch.tensor(offsets)
    actual = grads(partial(softmax_attention, cu_seqlens=cu, backend="torch"), (q, k, v, g), do)
    expected = grads(partial(reference, cu_seqlens=cu), (q, k, v, g), do)
    for name, a, e in zip(NAMES, actual, expected):
        assert_close(name, a, e, 1e-12)


def largest_allocation(fn) -> int:
    """The most bytes one ATen operator allocated while ``fn`` ran, from ``torch.profiler`` on the CPU: every depth,
    inside the kernels' custom operators too (a ``TorchDispatchMode`` would see only the custom operators)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    leaves = [e for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children]
    return max(e.cpu_memory_usage for e in leaves)


@pytest.mark.parametrize("offsets", [None, [0, 50, 128]], ids=["dense", "packed"])
@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(CUDA, reason="the interpreter's CPU case"))]
)
def test_no_backend_builds_a_t_by_t_tensor(monkeypatch, backend, offsets):
    """With tiles of 16 at T = 128, no operator of the forward or the backward allocates more than the inputs'
    ``[T, HQ, D]``: a ``[HQ, T, T]`` logit or bias tensor would be 8 times larger. The kernels' launchers are held to
    it too (their tiles live in registers; they allocate outputs, ``lse`` and ``delta``)."""
    monkeypatch.setattr(torch_impl, "BLOCK_T", 16)
    B, T, HQ, H, D = 1, 128, 2, 1, 16
    q, k, v, g, do = make(B, T, HQ, H, D, D, device="cpu")
    leaves = [x.requires_grad_() for x in (q, k, v, g)]
    cu = None if offsets is None else torch.tensor(offsets)
    largest = largest_allocation(lambda: softmax_attention(*leaves, cu_seqlens=cu, backend=backend).backward(do))
    assert largest <= B * T * HQ * D * q.element_size(), largest
    assert largest_allocation(lambda: q.new_zeros(B, HQ, T, T)) >= 8 * B * T * HQ * D * q.element_size()


def test_torch_backend_ignores_autocast(monkeypatch):
    """Under bfloat16 autocast the PyTorch backend still computes its tiles in float32: the same output and
    gradients as without autocast."""
    monkeypatch.setattr(torch_impl, "BLOCK_T", 16)
    q, k, v, g, do = make(1, 70, 4, 2, 16, 16, device="cpu")
    fn = partial(softmax_attention, backend="torch")
    expected = grads(fn, (q, k, v, g), do)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        actual = grads(fn, (q, k, v, g), do)
    for name, a, e in zip(NAMES, actual, expected):
        assert a.dtype == torch.float32, name
        assert_close(name, a, e, 1e-5)


# B, T, HQ, H, K, V
CASES = [
    (2, 2, 2, 2, 16, 16),
    (2, 37, 4, 2, 32, 32),  # GQA, odd length
    (1, 50, 4, 1, 32, 16),  # MQA, V != K
    (1, 45, 2, 1, 24, 40),  # head dims not powers of two: masked channel blocks
    (1, 33, 2, 2, 64, 64),
    (1, 20, 1, 1, 128, 128),
    (1, 18, 1, 1, 256, 256),
]


def case_id(case):
    return "B{}-T{}-HQ{}-H{}-K{}-V{}".format(*case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_triton_matches_torch_backend(case, dtype):
    q, k, v, g, do = make(*case, dtype=dtype)
    fn = partial(softmax_attention, backend="triton")
    check(grads(fn, (q, k, v, g), do), grads(partial(softmax_attention, backend="torch"), (q, k, v, g), do), dtype)


def test_triton_without_gate_matches_sdpa():
    """Without ``g`` the kernels compute plain causal softmax attention (the PyTorch backend's SDPA)."""
    q, k, v, _, do = make(2, 41, 4, 2, 32, 24)
    fn = partial(softmax_attention, backend="triton")
    check(grads(fn, (q, k, v), do), grads(partial(softmax_attention, backend="torch"), (q, k, v), do), torch.float32)


@pytest.mark.parametrize(
    "offsets", [[0, 5, 37, 100], [0, 5, 5, 37, 100], [0, 0, 100], [0, 1, 100], [0, 100, 100]],
    ids=["ragged", "empty-segment", "leading-empty", "one-token", "trailing-empty"],
)  # fmt: skip
@pytest.mark.parametrize("gated", [True, False], ids=["fox", "softmax"])
def test_triton_varlen_matches_torch_backend(offsets, gated):
    q, k, v, g, do = make(1, offsets[-1], 4, 2, 32, 16)
    cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    inputs = (q, k, v, g) if gated else (q, k, v)
    actual = grads(partial(softmax_attention, cu_seqlens=cu, backend="triton"), inputs, do)
    check(actual, grads(partial(softmax_attention, cu_seqlens=cu, backend="torch"), inputs, do), torch.float32)


# (BM, BN, num_warps, num_stages) of the GPU (fwd_config and bwd_config at D <= 64 and above), and 64 x 32 blocks:
# several key blocks per query block cross the diagonal, and several query blocks per key block.
GPU_CONFIGS = {
    "gpu-d64": ((128, 64, 8, 2), {"dkdv": (32, 128, 8, 2), "dq": (128, 64, 8, 2)}),
    "gpu-d128-d256": ((32, 32, 4, 2), {"dkdv": (32, 32, 8, 2), "dq": (128, 32, 8, 2)}),
    "query-blocks-longer": ((64, 32, 4, 2), {"dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 2)}),
}


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
@pytest.mark.parametrize("cu_seqlens", [None, [0, 70, 70, 200, 203]], ids=["dense", "varlen"])
def test_triton_block_configs(name, cu_seqlens):
    from attnkit.ops.baselines.fox.triton.backward import fox_bwd_fn
    from attnkit.ops.baselines.fox.triton.forward import fox_fwd_fn

    fwd_config, bwd_config = GPU_CONFIGS[name]
    q, k, v, g, do = make(1, 203, 4, 2, 32, 32)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    o, lse = fox_fwd_fn(q, k, v, g, cu, 0.3, config=fwd_config)
    actual = (o, *fox_bwd_fn(do, q, k, v, g, o, lse, cu, 0.3, config=bwd_config))
    expected = grads(partial(softmax_attention, scale=0.3, cu_seqlens=cu, backend="torch"), (q, k, v, g), do)
    check(actual, expected, torch.float32)


def test_triton_reads_strided_inputs():
    """``[B, H, T, D]`` tensors viewed as ``[B, T, H, D]`` (and a gate viewed the same way) give the results of
    their contiguous copies: the kernels read through the strides."""
    q, k, v, g, do = make(2, 29, 4, 2, 16, 16)
    strided = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    strided.append(g.transpose(1, 2).contiguous().transpose(1, 2))
    assert not any(x.is_contiguous() for x in strided)
    do_strided = do.transpose(1, 2).contiguous().transpose(1, 2)
    fn = partial(softmax_attention, backend="triton")
    check(grads(fn, strided, do_strided), grads(fn, (q, k, v, g), do), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B, T", [(0, 5), (2, 0)], ids=["B0", "T0"])
def test_empty_inputs(backend, B, T):
    q, k, v, g, do = make(B, T, 2, 1, 16, 16)
    o, *gs = grads(partial(softmax_attention, backend=backend), (q, k, v, g), do)
    assert o.shape == (B, T, 2, 16)
    assert [x.shape for x in gs] == [x.shape for x in (q, k, v, g)]


def test_opcheck():
    from attnkit.ops.baselines.fox.parallel import fox_bwd_op, fox_fwd_op

    q, k, v, g, do = make(1, 19, 4, 2, 16, 16)
    cu = torch.tensor([0, 7, 7, 19], device=DEVICE)
    for gate, cu_seqlens in ((g, None), (None, None), (g, cu)):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)] + [
            None if gate is None else gate.detach().requires_grad_()
        ]
        torch.library.opcheck(fox_fwd_op, (*leaves, cu_seqlens, 0.25))
        o, lse = fox_fwd_op(*leaves, cu_seqlens, 0.25)
        assert not lse.requires_grad
        torch.library.opcheck(fox_bwd_op, (do, q, k, v, gate, o.detach(), lse, cu_seqlens, 0.25))


def test_compiles_without_graph_breaks():
    q, k, v, g, do = make(1, 21, 2, 1, 16, 16)

    def f(q, k, v, g):
        return softmax_attention(q, k, v, g, backend="triton") * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    check(grads(compiled, (q, k, v, g), do), grads(f, (q, k, v, g), do), torch.float32)


@pytest.mark.parametrize("shapes", OPERATOR_COUNT_SHAPES, ids=OPERATOR_COUNT_IDS)
def test_operator_count(shapes):
    """One forward+backward dispatches at most 40 PyTorch operators outside the Triton kernels (leaf ATen operators
    that do work, :func:`tests.helpers.count_aten_ops`), and the same number whatever the batch, the length or the
    packed sequences: nothing loops over heads, sequences or blocks in Python, and nothing reads a length."""
    totals = []
    for B, T, offsets in shapes:
        q, k, v, g, do = make(B, T, 4, 2, 16, 16)
        leaves = [x.requires_grad_() for x in (q, k, v, g)]
        cu = None if offsets is None else torch.tensor(offsets)
        step = partial(softmax_attention, *leaves, cu_seqlens=cu, backend="triton")
        counts = count_aten_ops(lambda step=step, do=do: step().backward(do))
        totals.append(sum(counts.values()))
        assert totals[-1] <= 40, counts
    assert len(set(totals)) == 1, totals


def test_auto_takes_the_kernels_on_cuda_only(monkeypatch):
    """``AUTO_TRITON`` is on: "auto" takes the kernels for CUDA tensors (not float64) with a gate, SDPA without one,
    the PyTorch backend on CPU; with it off, never the kernels."""
    import attnkit.ops.baselines.fox.parallel as parallel

    assert softmax.AUTO_TRITON
    calls = []
    monkeypatch.setattr(parallel, "fox_fwd_op", lambda *args: calls.append(args) or (args[0], None))
    q, k, v, g, _ = make(1, 4, 1, 1, 16, 16)
    softmax_attention(q, k, v, g)
    softmax_attention(q.double(), k.double(), v.double(), g.double())  # float64 stays on the PyTorch backend
    softmax_attention(q, k, v)  # without a gate, SDPA's
    softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 1, 4], device=q.device))
    assert len(calls) == (1 if CUDA else 0)
    monkeypatch.setattr(softmax, "AUTO_TRITON", False)
    softmax_attention(q, k, v, g)
    assert len(calls) == (1 if CUDA else 0)


@pytest.mark.parametrize(
    "make_bad, match",
    [
        (lambda q, k, v, g: (q.double(), k.double(), v.double(), g), "float64"),
        (lambda q, k, v, g: (q.new_zeros(1, 4, 1, 300), k.new_zeros(1, 4, 1, 300), v, g), "head dims"),
    ],
    ids=["float64", "head-dim-300"],
)
def test_bad_input_names_backend(make_bad, match):
    q, k, v, g, _ = make(1, 4, 1, 1, 16, 16)
    with pytest.raises(ValueError, match=f"backend: .*{match}"):
        softmax_attention(*make_bad(q, k, v, g), backend="triton")
    with pytest.raises(ValueError, match="^backend"):
        softmax_attention(q, k, v, g, backend="flash")


def test_float32_precision_is_exact_under_the_interpreter_and_the_setting_on_a_gpu(monkeypatch):
    """Float32 dots take ``FLOAT32_PRECISION`` on a GPU, except at a padded head dim of 128 (its tiles would not fit
    shared memory); the interpreter has no TF32, so it stays exact there."""
    from attnkit.ops.baselines.fox.triton import forward

    monkeypatch.setattr(forward, "FLOAT32_PRECISION", "tf32x3")
    monkeypatch.setattr(forward, "interpreting", lambda: True)
    assert forward.precision(torch.float32, 64) == "ieee"
    monkeypatch.setattr(forward, "interpreting", lambda: False)
    assert [forward.precision(torch.float32, w) for w in (16, 64, 128, 256)] == ["tf32x3"] * 2 + ["ieee", "tf32x3"]
    assert forward.precision(torch.bfloat16, 64) == forward.precision(torch.float16, 128) == "tf32"


def test_cpu_triton_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, g, _ = make(1, 4, 1, 1, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="backend: .*CUDA"):
        softmax_attention(q, k, v, g, backend="triton")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, T, HQ, H, D", [(4, 4096, 8, 8, 128), (2, 8192, 16, 4, 64), (1, 16384, 2, 2, 256)], ids=str)
def test_real_sizes_on_gpu(B, T, HQ, H, D, dtype):
    q, k, v, g, do = make(B, T, HQ, H, D, D, dtype)
    fn = partial(softmax_attention, backend="triton")
    check(grads(fn, (q, k, v, g), do), grads(partial(softmax_attention, backend="torch"), (q, k, v, g), do), dtype)


@needs_cuda
def test_real_sizes_varlen_on_gpu():
    cu = torch.tensor([0, 1000, 1001, 1001, 5000, 12288], device="cuda")
    q, k, v, g, do = make(1, 12288, 8, 2, 128, 128, torch.bfloat16)
    actual = grads(partial(softmax_attention, cu_seqlens=cu, backend="triton"), (q, k, v, g), do)
    check(actual, grads(partial(softmax_attention, cu_seqlens=cu, backend="torch"), (q, k, v, g), do), torch.bfloat16)


def test_benchmark_entry_runs_on_cpu(tmp_path, monkeypatch):
    """``benchmarks/ops.py --ops fox`` on tiny shapes, held to the reference with every gradient, ``g`` included.

    The harness runs in bfloat16, whose ``tl.dot`` the interpreter gets wrong: the PyTorch backend stands in for the
    kernels here (the float32 / float16 tests above hold the kernels to it)."""
    import json

    from benchmarks import ops

    monkeypatch.setitem(ops.REGISTRY["fox"].impls, "fox_triton", ops.Impl(ops._fox("torch")))
    argv = ["--device", "cpu", "--ops", "fox", "--tokens", "32", "--seq-lens", "32", "--head-dims", "64"]
    argv += ["--impls", "sdpa", "fox_triton", "--max-ms", "1e5", "--out", str(tmp_path), "--name", "smoke_fox"]
    assert ops.main(argv) == 0
    rows = {(r["impl"], r["mode"]): r for r in json.loads((tmp_path / "smoke_fox.json").read_text())["rows"]}
    assert set(rows) == {(i, m) for i in ("sdpa", "fox_triton") for m in ("fwd", "fwdbwd")}
    assert all(r["error"] is None and r["ms"] > 0 for r in rows.values())
    errors = rows[("fox_triton", "fwdbwd")]["errors"]
    assert set(errors) == {"o", "dq", "dk", "dv", "dg"} and max(errors.values()) < 1e-2, errors
