"""Every mixer's model trains under bf16 and fp16 autocast: a finite loss and a finite gradient for every parameter.

Autocast hands the ops 16-bit projections and runs their matmuls in 16 bits; the solves, inverses and Cholesky
factorisations inside must still run in float32 (``torch.linalg`` has no 16-bit kernels for them).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit  # noqa: F401  (registers the model type)
from attnkit.models import MIXERS, AttnKitConfig, AttnKitForCausalLM

transformers = pytest.importorskip("transformers")

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cuda", "torch", id="cuda-torch", marks=CUDA),
    pytest.param("cuda", "auto", id="cuda-auto", marks=CUDA),
]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def autocast_or_skip(device: str, dtype: torch.dtype) -> torch.autocast:
    """``torch.autocast(device, dtype)``, skipping the test where this torch cannot autocast to ``dtype`` there
    (it would warn and run the model in float32, which tests nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device, dtype=dtype):
            supported = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == dtype
    if not supported:
        pytest.skip(f"this torch ({torch.__version__}) has no {dtype} autocast on {device}")
    return torch.autocast(device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device, backend", CASES)
@pytest.mark.parametrize("mixer", MIXERS)
def test_forward_backward_under_autocast(mixer, device, backend, dtype):
    torch.manual_seed(0)
    config = AttnKitConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=2,
        intermediate_size=48,
        mixer=mixer,
        backend=backend,
    )
    model = AttnKitForCausalLM(config).to(device).train()
    ids = torch.randint(0, 64, (2, 24), device=device)
    with autocast_or_skip(device, dtype):
        out = model(ids, labels=ids, use_cache=False)
    assert out.logits.dtype == dtype, "the model did not run under autocast"
    assert torch.isfinite(out.loss), f"loss {out.loss.item()}"
    out.loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name}: no gradient"
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"
