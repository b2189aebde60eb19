"""The models' inputs: empty sequences, rows that are all padding, and bad ids, labels and shift_labels (issue 18)."""

from __future__ import annotations

import pytest
import torch

from attnkit.models import MIXERS, AttnKitCache, AttnKitModel
from attnkit.models.modeling import check_input_ids
from tests.helpers import rel_rms
from tests.models.test_models import tiny_config, tiny_model

VOCAB = 61  # tiny_config's vocabulary


def backward_grads(model: torch.nn.Module, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after ``out.backward()``; each must exist, be finite and match its parameter."""
    model.zero_grad(set_to_none=True)
    out.backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        assert p.grad.shape == p.shape and torch.isfinite(p.grad).all(), f"{name}: bad gradient"
        grads[name] = p.grad
    return grads


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_empty_sequence(mixer, use_cache, masked):
    """T = 0: empty logits, a zero loss and zero gradients for every parameter (a reshape error and a NaN loss
    before), with or without an (empty) attention mask and the cache."""
    model = tiny_model(mixer).train()
    ids = torch.zeros(2, 0, dtype=torch.long)
    mask = torch.zeros(2, 0, dtype=torch.long) if masked else None
    out = model(ids, attention_mask=mask, labels=ids, use_cache=use_cache)
    assert out.logits.shape == (2, 0, VOCAB)
    assert out.loss.item() == 0.0
    if use_cache:
        assert isinstance(out.cache, AttnKitCache) and out.cache.get_seq_length() == 0
    grads = backward_grads(model, out.loss + out.logits.sum())
    assert all(not g.any() for g in grads.values())


@pytest.mark.parametrize("mixer", MIXERS)
def test_empty_inputs_embeds_stay_on_the_graph(mixer):
    model = AttnKitModel(tiny_config(mixer)).train()
    embeds = torch.randn(3, 0, 32, requires_grad=True)
    hidden = model(inputs_embeds=embeds, use_cache=False).last_hidden_state
    assert hidden.shape == (3, 0, 32)
    hidden.sum().backward()
    assert embeds.grad is not None and embeds.grad.shape == embeds.shape


@pytest.mark.parametrize("mixer", MIXERS)
def test_empty_step_keeps_the_cache(mixer):
    """A call with no new token returns the cache as it was: decoding after it equals decoding without it."""
    model = tiny_model(mixer)
    ids = torch.randint(1, VOCAB, (2, 6))
    with torch.no_grad():
        cache = model(ids[:, :5], use_cache=True).cache
        expected = model(ids[:, 5:], cache=cache, use_cache=True).logits
        cache = model(ids[:, :5], use_cache=True).cache
        empty = model(ids[:, :0], cache=cache, use_cache=True)
        assert empty.logits.shape == (2, 0, VOCAB) and empty.cache is cache and cache.get_seq_length() == 5
        actual = model(ids[:, 5:], cache=cache, use_cache=True).logits
    assert torch.equal(actual, expected)


def padded_batch(lengths: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``ids``, ``mask`` and next-token ``labels`` (-100 on padding) for rows of ``lengths``."""
    ids = torch.randint(1, VOCAB, (len(lengths), T))
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "cache"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_row_of_padding(mixer, use_cache):
    """A row that is all padding gives finite logits, leaves the other rows as they are alone, and gives finite
    gradients; with the cache, decoding after it equals the full forward."""
    model = tiny_model(mixer)
    ids, mask, labels = padded_batch([0, 5], 7)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=use_cache)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    with torch.no_grad():
        alone = model(ids[1:, 2:], use_cache=False).logits
    assert rel_rms(out.logits[1, 2:], alone[0]) <= 1e-5
    backward_grads(model, out.loss + out.logits.sum())
    if not use_cache:
        return
    new = torch.randint(1, VOCAB, (2, 3))
    full_ids, full_mask = torch.cat([ids, new], 1), torch.cat([mask, torch.ones_like(new)], 1)
    with torch.no_grad():
        full = model(full_ids, attention_mask=full_mask, use_cache=False).logits[:, 7:]
        cache, steps = out.cache, []
        for t in range(3):
            step = model(new[:, t : t + 1], attention_mask=full_mask[:, : 8 + t], cache=cache, use_cache=True)
            cache = step.cache
            steps.append(step.logits)
    assert rel_rms(torch.cat(steps, 1), full) <= 1e-4


PATH_EMPTY_CACHE = pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="attnkit/layers/path.py prefill: the conv tail's u.reshape(B * T, -1) fails on zero real tokens",
)


@pytest.mark.parametrize(
    "mixer,use_cache",
    [
        pytest.param(m, c, marks=PATH_EMPTY_CACHE if c and m.startswith("path") else (), id=f"{m}-cache{int(c)}")
        for m in MIXERS
        for c in (False, True)
    ],
)
def test_every_row_padding(mixer, use_cache):
    """No real token at all: finite logits, a zero loss (nothing scored) and finite gradients."""
    model = tiny_model(mixer)
    ids, mask, labels = padded_batch([0, 0], 4)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=use_cache)
    assert torch.isfinite(out.logits).all() and out.loss.item() == 0.0
    backward_grads(model, out.loss + out.logits.sum())


@pytest.mark.parametrize("mixer", MIXERS)
def test_nothing_scored_gives_zero_loss(mixer):
    """Every target ignored: the loss is 0 on the graph (NaN before), with ``labels`` and with ``shift_labels``."""
    model = tiny_model(mixer)
    ids = torch.randint(1, VOCAB, (2, 5))
    ignored = torch.full_like(ids, -100)
    for targets in (dict(labels=ignored), dict(shift_labels=ignored)):
        out = model(ids, use_cache=False, **targets)
        assert out.loss.item() == 0.0
        backward_grads(model, out.loss)


@pytest.mark.parametrize("bad", [VOCAB, -1, 10**6], ids=["vocab", "negative", "huge"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_input_ids_outside_the_vocabulary(mixer, bad):
    """An IndexError from the embedding before."""
    model = tiny_model(mixer)
    ids = torch.randint(1, VOCAB, (2, 5))
    ids[1, 3] = bad
    with pytest.raises(ValueError, match=r"^input_ids: expected ids in \[0, vocab_size=61\)"):
        model(ids)
    with pytest.raises(ValueError, match="^input_ids"):
        model.model(ids)


@pytest.mark.parametrize(
    "ids", [torch.ones(2, 5), torch.ones(2, 5, dtype=torch.bool), torch.ones(10, dtype=torch.long)],
    ids=["float", "bool", "1d"],
)  # fmt: skip
def test_input_ids_of_the_wrong_kind(ids):
    with pytest.raises(ValueError, match="^input_ids"):
        tiny_model("rope")(ids)


def test_input_ids_check_off_the_cpu_is_asynchronous(monkeypatch):
    """Where a ValueError would need a host synchronisation (off the CPU, or while compiling), the range check is
    ``torch._assert_async``, which raises on the CPU at once and carries the same message."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    check_input_ids(torch.tensor([[0, 60]]), VOCAB)
    with pytest.raises(RuntimeError, match=r"input_ids: expected ids in \[0, vocab_size=61\)"):
        check_input_ids(torch.tensor([[0, 61]]), VOCAB)


@pytest.mark.parametrize("name", ["labels", "shift_labels"])
@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize(
    "shape", [(2, 6), (2, 4), (2,), (1, 5), (2, 5, 1)], ids=["longer", "shorter", "1d", "batch", "3d"]
)
def test_targets_of_the_wrong_shape(mixer, name, shape):
    """A shape error from the loss that did not name ``labels`` before, or a silent broadcast."""
    model = tiny_model(mixer)
    ids = torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=rf"^{name}: expected shape \[2, 5\]"):
        model(ids, **{name: torch.zeros(shape, dtype=torch.long)})


@pytest.mark.parametrize("name", ["labels", "shift_labels"])
def test_targets_of_the_wrong_kind(name):
    model = tiny_model("tapa")
    ids = torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(ValueError, match=f"^{name}: expected an integer dtype"):
        model(ids, **{name: torch.zeros(2, 5)})
    with pytest.raises(ValueError, match=f"^{name}: expected a"):
        model(ids, **{name: [[1] * 5] * 2})


def test_loss_needs_every_position():
    model = tiny_model("vla")
    ids = torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="^logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=1)
