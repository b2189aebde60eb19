"""The one dispatch rule of the ops (``resolve_backend``): devices, dtypes and the kernels' head-dim limit."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.common.validation import resolve_backend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
# A device the kernels run on here: CUDA, or CPU under the interpreter (conftest.py sets it without a GPU).
KERNEL_DEVICE = CUDA if torch.cuda.is_available() else CPU


def test_auto_takes_the_kernels_only_where_they_apply():
    dims = dict(head_dims=(64, 128), max_head_dim=128)
    assert resolve_backend("auto", "op", CUDA, has_triton=True, dtype=torch.bfloat16, **dims) == "triton"
    assert resolve_backend("auto", "op", CPU, has_triton=True, dtype=torch.bfloat16, **dims) == "torch"
    assert resolve_backend("auto", "op", CUDA, has_triton=True, dtype=torch.float64, **dims) == "torch"
    assert resolve_backend("auto", "op", CUDA, has_triton=True, auto_triton=False, dtype=torch.float32) == "torch"
    wide = dict(head_dims=(64, 256), max_head_dim=128)
    assert resolve_backend("auto", "op", CUDA, has_triton=True, dtype=torch.bfloat16, **wide) == "torch"


def test_triton_names_what_it_refuses():
    dims = dict(head_dims=(64, 128), max_head_dim=128)
    assert resolve_backend("triton", "op", KERNEL_DEVICE, has_triton=True, dtype=torch.float32, **dims) == "triton"
    wide = dict(head_dims=(64, 256), max_head_dim=128)
    with pytest.raises(ValueError, match=r"^backend: op's Triton kernels take head dims up to 128, got \[64, 256\]"):
        resolve_backend("triton", "op", KERNEL_DEVICE, has_triton=True, dtype=torch.float32, **wide)
    with pytest.raises(ValueError, match="^backend: op's Triton kernels take float16"):
        resolve_backend("triton", "op", KERNEL_DEVICE, has_triton=True, dtype=torch.float64, **dims)
    with pytest.raises(NotImplementedError, match="not implemented"):
        resolve_backend("triton", "op", KERNEL_DEVICE)
