"""The FlexAttention form of TAPA (``benchmarks/flex_tapa.py``) against the PyTorch backend, eagerly on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from attnkit.ops import tapa_attention
from benchmarks.flex_tapa import tapa_flex
from tests.helpers import assert_close


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    """Let FlexAttention differentiate on CPU.

    It refuses inputs that require grad on CPU because Inductor's CPU kernel has no backward; the eager form it
    runs here (dense scores, autograd through ``score_mod``) computes the same gradients as the CUDA kernel.
    """
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    # Eager FlexAttention still traces through Dynamo; a fresh cache per case keeps a changed alpha a constant
    # (a recompile would make it a symbolic float, which FlexAttention cannot trace).
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# B, T, H, D, theta, alpha
CASES = [
    (1, 37, 2, 16, 0.5, 0.1),
    (2, 20, 2, 12, 0.25, 0.5),  # dA = 3, dP = 9
    (1, 30, 1, 8, 0.5, 0.0),  # 0^0 = 0 on the diagonal
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-T{}-H{}-D{}-theta{}-alpha{}".format(*c))
def test_output_and_gradients_match_torch_backend(case, cpu_flex_backward):
    B, T, H, D, theta, alpha = case
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    do = torch.randn(B, T, H, D)
    results = []
    for fn in (tapa_flex, lambda q, k, v, theta, alpha: tapa_attention(q, k, v, theta=theta, alpha=alpha)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o = fn(*leaves, theta, alpha)
        results.append((o, *torch.autograd.grad(o, leaves, do)))
    for name, actual, expected in zip(("o", "dq", "dk", "dv"), *results):
        assert_close(name, actual, expected, 1e-5)


def test_forward_runs_on_cpu_without_patches():
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    assert_close("o", tapa_flex(q, k, v), tapa_attention(q, k, v), 1e-5)
