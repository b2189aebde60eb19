"""The TAPA layer's ``phase`` option (issue 20): the linear phase through packing, left padding and the decoding
cache, and as a model option (``mixer_kwargs={"tapa": {"phase": "linear"}}``)."""

from __future__ import annotations

import pytest
import torch

from attnkit.layers import TAPAAttention
from attnkit.models import AttnKitConfig, AttnKitForCausalLM
from tests.helpers import assert_close, rel_rms

HIDDEN = 32


def make(phase="linear"):
    torch.manual_seed(0)
    return TAPAAttention(HIDDEN, 4, 2, theta=0.5, alpha=0.3, phase=phase).eval()


def test_packed_equals_sequences_alone():
    layer = make()
    seqs = [torch.randn(n, HIDDEN) for n in (5, 17, 1)]
    packed, _ = layer(torch.cat(seqs)[None], cu_seqlens=torch.tensor([0, 5, 22, 23]))
    alone = torch.cat([layer(s[None])[0][0] for s in seqs])
    assert_close("packed", packed[0], alone, 1e-5)


def test_prefill_then_decode_equals_full_forward():
    """Left-padded prompts, then one token a step through the cache (the decode step's linear phase)."""
    layer = make()
    prompts, steps = (9, 4, 1), 6
    T = max(prompts) + steps
    x = torch.randn(len(prompts), T, HIDDEN)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, n in enumerate(prompts):
        mask[i, max(prompts) - n :] = 1
    full, _ = layer(x, attention_mask=mask)
    P = max(prompts)
    out, state = layer(x[:, :P], attention_mask=mask[:, :P], use_cache=True)
    outs = [out]
    for t in range(P, T):
        out, state = layer(x[:, t : t + 1], attention_mask=mask[:, : t + 1], past_state=state, use_cache=True)
        outs.append(out)
    assert_close("prefill", outs[0], full[:, :P], 1e-5)
    assert_close("decode", torch.cat(outs[1:], dim=1), full[:, P:], 1e-4)


def test_linear_differs_from_quadratic_with_the_same_weights():
    x = torch.randn(2, 30, HIDDEN)
    linear, quadratic = make("linear"), make("quadratic")
    quadratic.load_state_dict(linear.state_dict())
    assert rel_rms(linear(x)[0], quadratic(x)[0]) > 0.05


def test_gradients_reach_every_parameter():
    layer = make().train()
    layer(torch.randn(2, 12, HIDDEN))[0].pow(2).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bad_phase_is_a_value_error():
    with pytest.raises(ValueError, match="^phase: expected one of"):
        TAPAAttention(HIDDEN, 4, phase="cubic")


def test_model_option():
    """``phase`` is a ``mixer_kwargs`` option of ``"tapa"``; its value is the layer's to check."""
    small = dict(vocab_size=16, hidden_size=16, num_hidden_layers=2, num_heads=2, mixer="tapa")
    config = AttnKitConfig(**small, mixer_kwargs={"tapa": {"phase": "linear"}})
    model = AttnKitForCausalLM(config)
    assert [layer.attn.phase for layer in model.model.layers] == ["linear", "linear"]
    logits = model(torch.randint(0, 16, (2, 9))).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="^phase:"):
        AttnKitForCausalLM(AttnKitConfig(**small, mixer_kwargs={"tapa": {"phase": "cubic"}}))
