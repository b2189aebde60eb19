"""What the Triton launchers share: where a kernel may run, and block sizes."""

from __future__ import annotations

import functools
import os

import torch

LOG2E = 1.4426950408889634  # log2(e): the kernels' softmax runs on exp2, with the logit scale folded into it


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels then run on CPU tensors through Triton's interpreter (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA ``device`` (what a launch has to fill); 0 elsewhere (the
    interpreter)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def kernel_device(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors of ``device``: CUDA, or CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def float32_dots(dtype: torch.dtype) -> str:
    """``tl.dot``'s precision for operands of ``dtype`` that must keep float32's accuracy: exact (``ieee``) under the
    interpreter, which has no TF32, and three TF32 passes on the tensor cores; 16-bit operands take the tensor cores'
    own products (``tf32``), exact for them."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if interpreting() else "tf32x3"


def block_dim(n: int, minimum: int = 16) -> int:
    """The power-of-two block that covers ``n`` channels; ``tl.dot`` needs at least 16 along its inner dim."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())
