"""A training step's forward and backward as CUDA graphs (``TrainConfig.cuda_graph``).

The small models of the reproduction cells launch some 500 kernels a step, and on one CPU thread a step costs the
launches (about 11 ms on an H100 for 2.3-3.6 ms of GPU work, twenty-fifth session), not the GPU's work. Captured once
with :func:`torch.cuda.make_graphed_callables`, the model's forward and the summed token loss (and their backward) are
replayed as two graph launches; the loss's scale, the gradient clip and the AdamW step stay eager, a few ``foreach``
kernels. The graphs replay the same kernels on the same parameters (the optimizer updates them in place), so the run
computes what an eager run computes, to rounding: a replay's gradients are an eager step's to rounding, not bit for bit
(``tests/train/test_cuda_graph.py``, ``benchmarks/graph_noise.py``). It only needs the step's shapes to stay fixed, as a
task's batches do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..tasks import IGNORE_INDEX


def token_loss_sum(forward: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed loss of the scored tokens of a batch ``x, y [b, T]`` (float32) under the model ``forward``: the
    trainer's loss, eager or in a graph."""
    logits = forward(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class _LossSum(torch.nn.Module):
    """``model``'s summed token loss of a batch ``x, y [b, T]`` (float32), the step's part a graph holds."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(self.model, x, y)


def graphed_loss_sum(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: torch.autocast
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``model``'s summed token loss ``(x, y) -> loss`` captured on the sample batch ``x, y`` (on the GPU) in CUDA
    graphs, forward and backward: calling it copies a batch of the same shape into the graph's inputs and replays
    the forward; ``loss.backward()`` replays the backward, which adds the parameters' gradients to their ``.grad``.

    Capture runs three eager warm-up steps first (``make_graphed_callables``; they compile and autotune the Triton
    kernels, and leave ``.grad`` untouched), under ``autocast``, which must have its cache off. The gradients a
    replay returns share the graph's buffers, so at most one replay's gradients may be accumulated into ``.grad``
    before the optimizer reads them (the caller's ``grad_accum`` is 1: see ``TrainConfig.cuda_graph``)."""
    if x.device.type != "cuda":
        raise ValueError(f"cuda_graph: the batch is on {x.device}; CUDA graphs need the model on a GPU")
    wrapper = _LossSum(model).train(model.training)
    with autocast:
        graphed = torch.cuda.make_graphed_callables(wrapper, (x, y), allow_unused_input=True)
    shapes = (x.shape, y.shape)

    def loss_sum(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        # the graph copies a batch into its inputs, which would broadcast a smaller one silently
        if (xb.shape, yb.shape) != shapes:
            raise ValueError(
                f"cuda_graph: a batch of shape {list(xb.shape)} (labels {list(yb.shape)}), but the graph was "
                f"captured at {list(shapes[0])}: the task's batches change shape; train without cuda_graph"
            )
        return graphed(xb, yb)

    return loss_sum
