"""Gradient checkpointing through transformers' ``gradient_checkpointing_enable()`` (issue 19)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from attnkit.models import modeling
from tests.helpers import assert_close, tol_for
from tests.models.test_models import tiny_model

VOCAB = 61

# Checkpointing replays the same float32 operations in the backward. On the CPU the loss and gradients come out
# equal bit for bit, except with use_reentrant=True for FoX: the reentrant checkpoint runs the first forward without
# gradients, where SDPA with FoX's additive mask picks another CPU kernel (relative RMS differences of about 5e-7).
# The bar is float32 rounding: a relative RMS error of at most 1e-5 (the float32 bar of tests.helpers.tol_for) for
# the loss and for every gradient tensor.
TOL = tol_for(torch.float32)


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def enable(model: torch.nn.Module, reentrant: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("mixer", ["path", "path_fox", "tapa", "vla", "rope", "deltanet", "linear", "fox"])
def test_gradients_unchanged(mixer, reentrant):
    """Loss and every parameter gradient with checkpointing equal those without, on a left-padded batch."""
    model = tiny_model(mixer).train()
    ids = torch.randint(1, VOCAB, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ref_loss, ref_grads = loss_and_grads(model, ids, mask)

    enable(model, reentrant)
    assert model.is_activation_checkpointing
    blocks = model.model.layers
    assert all(isinstance(b, GradientCheckpointingLayer) and b.gradient_checkpointing for b in blocks)
    calls = []
    for block in blocks:  # the checkpoint function runs once per block in the forward
        inner = block._gradient_checkpointing_func
        block._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    loss, grads = loss_and_grads(model, ids, mask)
    assert len(calls) == len(blocks)
    assert_close("loss", loss, ref_loss, TOL)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert_close(name, g, ref_grads[name], TOL)


def test_activation_checkpointing_enable_and_disable():
    """transformers 5's own names for the same switch."""
    model = tiny_model("path").train()
    model.activation_checkpointing_enable()
    assert all(b.gradient_checkpointing for b in model.model.layers)
    model.activation_checkpointing_disable()
    assert not any(b.gradient_checkpointing for b in model.model.layers)


def test_training_with_cache_turns_it_off():
    """In training, ``use_cache=True`` under checkpointing is turned off with transformers' warning (no cache is
    returned); without gradients, or in eval mode, the cache works as usual."""
    model = tiny_model("path_fox").train()
    enable(model, reentrant=False)
    ids = torch.randint(1, VOCAB, (2, 7))
    logger = logging.get_logger(modeling.__name__)
    logger.warning_once.cache_clear()
    with CaptureLogger(logger) as captured:
        out = model(ids, use_cache=True)
    assert "`use_cache=True` is incompatible with gradient checkpointing" in captured.out
    assert out.cache is None
    with torch.no_grad():
        assert model(ids, use_cache=True).cache.get_seq_length() == 7
    model.eval()
    ids = torch.randint(1, VOCAB, (2, 5))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(
            model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs)
        )
