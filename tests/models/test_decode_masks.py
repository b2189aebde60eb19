"""Decoding checks its masks once a model call, not once a layer: each check of a mask's values reads the device
(a synchronisation on CUDA), and a generated token would otherwise pay one per layer and op. Bad masks are still
refused, by the model and by a layer or op called directly."""

from __future__ import annotations

import pytest
import torch

from attnkit.layers import RoPEAttention
from attnkit.models import MIXERS
from attnkit.ops.baselines.softmax import softmax_attention, softmax_decode_step
from attnkit.ops.common import validation
from tests.models.test_models import tiny_model

VOCAB = 61


@pytest.fixture
def mask_reads(monkeypatch):
    """The number of device reads of index inputs' values: the model's and layers' mask and ``cu_seqlens`` checks
    and the ops' real-slot and ``cu_seqlens`` checks."""
    reads = {"n": 0}
    real = validation.checks_data

    def counting() -> bool:
        answer = real()
        reads["n"] += answer
        return answer

    import attnkit.layers.base as base

    monkeypatch.setattr(validation, "checks_data", counting)
    monkeypatch.setattr(base, "checks_data", counting)
    return reads


@pytest.mark.parametrize("mixer", MIXERS)
def test_a_decode_step_reads_its_mask_once(mixer, mask_reads):
    model = tiny_model(mixer, num_hidden_layers=3)
    ids = torch.randint(1, VOCAB, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cache = model(ids, attention_mask=mask, use_cache=True).cache
    mask_reads["n"] = 0
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        out = model(ids[:, -1:], attention_mask=step_mask, cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()
    assert mask_reads["n"] == 1


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], "only left padding"),
        ([[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], "must not be padding"),
    ],
    ids=["padding-inside", "new-token-padding"],
)
def test_a_bad_decode_mask_is_refused(mask, message):
    model = tiny_model("rope")
    ids = torch.randint(1, VOCAB, (2, 5))
    cache = model(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]), use_cache=True).cache
    with pytest.raises(ValueError, match=f"attention_mask: .*{message}"):
        model(ids[:, -1:], attention_mask=torch.tensor(mask), cache=cache, use_cache=True)
    layer = RoPEAttention(32, 4)
    x = torch.randn(2, 5, 32)
    _, state = layer(x, attention_mask=torch.ones(2, 5), use_cache=True)
    with pytest.raises(ValueError, match=f"attention_mask: .*{message}"):
        layer(x[:, -1:], attention_mask=torch.tensor(mask), past_state=state, use_cache=True)
    with pytest.raises(ValueError, match=r"attention_mask: expected shape \[2, past \+ 1\]"):
        layer(x[:, -1:], attention_mask=torch.ones(3, 6), past_state=state, use_cache=True)


def test_an_op_called_directly_still_checks_its_slots():
    q, k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8)
    mask = torch.tensor([[True, True, True, True], [False, False, False, False]])
    with pytest.raises(ValueError, match="cache_mask: 1 row"):
        softmax_decode_step(q, k, v, mask)
    with validation.data_checked():  # the caller vouches: nothing is read
        softmax_decode_step(q, k, v, mask)
    with pytest.raises(ValueError, match="cache_mask: 1 row"):
        softmax_decode_step(q, k, v, mask)


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("packed", [False, True], ids=["left-padded", "packed"])
def test_a_forward_reads_its_index_inputs_once(mixer, packed, mask_reads):
    """Training on a padded or packed batch: the mask or ``cu_seqlens`` is checked once a model call, not by every
    layer and op (each check is a synchronisation on CUDA)."""
    model = tiny_model(mixer, num_hidden_layers=3).train()
    if packed:
        ids, kwargs = torch.randint(1, VOCAB, (1, 9)), dict(cu_seqlens=torch.tensor([0, 4, 4, 9]))
    else:
        ids, kwargs = torch.randint(1, VOCAB, (2, 5)), dict(attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1] * 5]))
    out = model(ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert mask_reads["n"] == 1


@pytest.mark.parametrize(
    "cu, message", [([0, 4, 8], "end at T=9"), ([0, 5, 4, 9], "non-decreasing"), ([1, 4, 9], "start at 0")]
)
def test_bad_cu_seqlens_are_refused_once_checked(cu, message):
    model = tiny_model("rope")
    with pytest.raises(ValueError, match=f"cu_seqlens: .*{message}"):
        model(torch.randint(1, VOCAB, (1, 9)), cu_seqlens=torch.tensor(cu))
    q = k = v = torch.randn(1, 9, 2, 8)
    with pytest.raises(ValueError, match=f"cu_seqlens: .*{message}"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor(cu))


def test_data_checked_keeps_a_compiled_graph_whole():
    """Under ``torch.compile`` the context is a no-op (nothing is read there anyway): a ContextVar set inside it
    broke the graph once a layer."""

    def fn(x):
        with validation.data_checked():
            return x * 2

    x = torch.randn(3)
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), x * 2)
