"""The stick-breaking layer: the contract every attention layer meets (the generic tests of
``test_attention_layers``, run on these layers), and what is particular to stick-breaking."""

from __future__ import annotations

import pytest
import torch

from attnkit.layers import StickBreakingAttention
from attnkit.models import AttnKitConfig, AttnKitForCausalLM
from tests.helpers import assert_close
from tests.layers import test_attention_layers as generic

HIDDEN = generic.HIDDEN
LAYERS = {
    "sb-gqa": lambda: StickBreakingAttention(HIDDEN, 4, 2),
    "sb-current": lambda: StickBreakingAttention(HIDDEN, 2, attend_current=True, block_size=5),
}


@pytest.fixture(autouse=True)
def stickbreaking_layers(monkeypatch):
    """The generic tests build their layers from ``generic.LAYERS`` by name."""
    monkeypatch.setattr(generic, "LAYERS", {**generic.LAYERS, **LAYERS})


GENERIC = [
    generic.test_dense_batch_equals_packed,
    generic.test_left_padding_equals_sequences_alone,
    generic.test_several_tokens_after_a_cache,
    generic.test_gradients_reach_every_parameter,
    generic.test_bad_inputs,
    generic.test_built_on_meta_device_then_loaded,
]


@pytest.mark.parametrize("test", GENERIC, ids=[t.__name__.removeprefix("test_") for t in GENERIC])
@pytest.mark.parametrize("name", LAYERS)
def test_generic_contract(name, test):
    test(name)


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "with-mask"])
@pytest.mark.parametrize("name", LAYERS)
def test_empty_sequence(name, masked):
    generic.test_empty_sequence(name, masked)


@pytest.mark.parametrize("case", generic.DECODE)
@pytest.mark.parametrize("name", LAYERS)
def test_prefill_then_decode_equals_full_forward(name, case):
    generic.test_prefill_then_decode_equals_full_forward(name, case)


def test_strict_layer_first_token_reads_nothing():
    """Without ``attend_current`` the first token of each sequence sees no key, so the mixer outputs exactly 0
    there; with it, the token reads its own value."""
    x = torch.randn(2, 5, HIDDEN)
    torch.manual_seed(0)
    strict = StickBreakingAttention(HIDDEN, 2)
    torch.manual_seed(0)
    current = StickBreakingAttention(HIDDEN, 2, attend_current=True)
    out, _ = strict(x)
    assert (out[:, 0] == 0).all() and (out[:, 1:] != 0).any()
    assert (current(x)[0][:, 0] != 0).all()


def test_bad_constructor_values():
    with pytest.raises(ValueError, match="^attend_current"):
        StickBreakingAttention(HIDDEN, 2, attend_current="yes")
    with pytest.raises(ValueError, match="^block_size"):
        StickBreakingAttention(HIDDEN, 2, block_size=0)
    with pytest.raises(ValueError, match="^num_kv_heads"):
        StickBreakingAttention(HIDDEN, 4, 3)


def test_model_trains_and_generates():
    """A two-layer model of the mixer: a few optimiser steps lower the loss on a fixed batch, and greedy generation
    with the cache equals generation without it (``mixer_kwargs`` reach the layer)."""
    torch.manual_seed(0)
    config = AttnKitConfig(
        vocab_size=29, hidden_size=32, num_hidden_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
        mixer="stickbreaking", mixer_kwargs={"stickbreaking": {"attend_current": True}}, backend="torch",
    )  # fmt: skip
    model = AttnKitForCausalLM(config)
    assert all(block.attn.attend_current for block in model.model.layers)
    ids = torch.randint(0, 29, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
    model.eval()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids[:2, :5], use_cache=True, **kwargs)
        recomputed = model.generate(ids[:2, :5], use_cache=False, **kwargs)
        assert torch.equal(cached, recomputed)
        logits = model(cached, use_cache=False).logits
    assert_close("greedy", logits[:, 4:-1].argmax(-1).double(), cached[:, 5:].double(), 0.0)
