"""The recurrent layers (VLA, linear attention, DeltaNet): packing, left padding, the decoding cache,
gradients and validation, all through the ``TokenMixer`` contract."""

from __future__ import annotations

import pytest
import torch

from attnkit.layers import DeltaNetAttention, LinearAttention, VLAAttention
from tests.helpers import assert_close

HIDDEN = 48
LAYERS = {
    "vla": lambda: VLAAttention(HIDDEN, 3, lam0=0.2),
    "linear-gqa": lambda: LinearAttention(HIDDEN, 4, num_kv_heads=2),
    "deltanet": lambda: DeltaNetAttention(HIDDEN, 2),
    "deltanet-negeig": lambda: DeltaNetAttention(HIDDEN, 3, head_dim=8, allow_neg_eigval=True),
}
layers = pytest.mark.parametrize("make_layer", list(LAYERS.values()), ids=list(LAYERS))


def left_padded(lengths: list[int], hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, L, hidden]`` (zeros where padded) and its ``attention_mask [B, L]`` for these lengths."""
    L = max(lengths)
    mask = torch.tensor([[0] * (L - n) + [1] * n for n in lengths])
    return torch.randn(len(lengths), L, hidden) * mask[..., None], mask


@layers
def test_dense_batch_equals_packed(make_layer):
    layer = make_layer()
    x = torch.randn(3, 20, HIDDEN)
    o_dense, _ = layer(x)
    cu_seqlens = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    o_packed, _ = layer(x.reshape(1, 60, HIDDEN), cu_seqlens=cu_seqlens)
    assert_close("o", o_packed, o_dense.reshape(1, 60, HIDDEN), 1e-5)


@layers
def test_packed_unequal_lengths_equal_each_alone(make_layer):
    layer = make_layer()
    lengths = [5, 70, 1, 17]
    x = torch.randn(1, sum(lengths), HIDDEN)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o_packed, _ = layer(x, cu_seqlens=cu_seqlens)
    for bos, eos in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        o_alone, _ = layer(x[:, bos:eos])
        assert_close(f"o[{bos}:{eos}]", o_packed[:, bos:eos], o_alone, 1e-5)


@layers
def test_left_padding_equals_each_alone(make_layer):
    layer = make_layer()
    lengths = [7, 20, 1]
    x, mask = left_padded(lengths)
    o, _ = layer(x, attention_mask=mask)
    for b, n in enumerate(lengths):
        o_alone, _ = layer(x[b : b + 1, -n:])
        assert_close(f"o[{b}]", o[b : b + 1, -n:], o_alone, 1e-5)
        assert torch.equal(o[b, :-n], torch.zeros_like(o[b, :-n])), "padded outputs must be zero"


DECODE_CASES = {
    "padded-prompt": ([6, 9, 2], 7),
    "prompt-1": ([1, 1], 9),
    "prompt-crosses-chunk": ([75, 60], 60),
}


@pytest.mark.parametrize("lengths, new", list(DECODE_CASES.values()), ids=list(DECODE_CASES))
@layers
def test_decode_equals_full_forward(make_layer, lengths, new):
    """Prefill a left-padded prompt, then feed one token at a time: equal to one forward over everything."""
    layer = make_layer()
    prompt, mask = left_padded(lengths)
    B, P = mask.shape
    x = torch.cat([prompt, torch.randn(B, new, HIDDEN)], 1)
    full_mask = torch.cat([mask, mask.new_ones(B, new)], 1)
    o_full, _ = layer(x, attention_mask=full_mask)

    o, state = layer(prompt, attention_mask=mask, use_cache=True)
    outputs = [o]
    for t in range(P, P + new):
        o, state = layer(x[:, t : t + 1], attention_mask=full_mask[:, : t + 1], past_state=state, use_cache=True)
        outputs.append(o)
    o_dec = torch.cat(outputs, 1)
    assert_close("o", o_dec, o_full, 1e-4)
    assert_close("o[new]", o_dec[:, P:], o_full[:, P:], 1e-4)
    assert torch.equal(state["seen"], torch.tensor(lengths) + new)
    assert state["mask"].shape == (B, P + new)
    for name, value in state.items():
        assert value.shape[0] == B, f"state[{name!r}]: batch must come first"
        if value.is_floating_point():
            assert value.dtype == torch.float32, f"state[{name!r}]: recurrent state is float32"


@layers
def test_gradients_reach_every_parameter(make_layer):
    """Through the prefill and through a decode step."""
    layer = make_layer()
    x, mask = left_padded([9, 70])
    o, state = layer(x, attention_mask=mask, use_cache=True)
    o_step, _ = layer(torch.randn(2, 1, HIDDEN), past_state=state)
    torch.manual_seed(1)
    loss = (o * torch.randn_like(o)).sum() + (o_step * torch.randn_like(o_step)).sum()
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name}: all-zero gradient"


BAD_CONSTRUCTORS = [
    ("vla-lam0", VLAAttention, dict(lam0=0.0), "lam0"),
    ("vla-eps", VLAAttention, dict(eps=-1e-4), "eps"),
    ("vla-kv-heads", VLAAttention, dict(num_kv_heads=2), "num_kv_heads"),
    ("vla-backend", VLAAttention, dict(backend="cuda"), "backend"),
    ("linear-hidden", LinearAttention, dict(hidden_size=30), "hidden_size"),
    ("linear-kv-heads", LinearAttention, dict(num_kv_heads=3), "num_kv_heads"),
    ("linear-heads", LinearAttention, dict(num_heads=0), "num_heads"),
    ("linear-head-dim", LinearAttention, dict(head_dim=0), "head_dim"),
    ("linear-eps", LinearAttention, dict(eps=float("nan")), "eps"),
    ("linear-layer-idx", LinearAttention, dict(layer_idx=-1), "layer_idx"),
    ("deltanet-kv-heads", DeltaNetAttention, dict(num_kv_heads=1), "num_kv_heads"),
    ("deltanet-neg-eigval", DeltaNetAttention, dict(allow_neg_eigval="yes"), "allow_neg_eigval"),
    ("deltanet-hidden", DeltaNetAttention, dict(hidden_size=32.0), "hidden_size"),
]


@pytest.mark.parametrize("cls, kwargs, name", [c[1:] for c in BAD_CONSTRUCTORS], ids=[c[0] for c in BAD_CONSTRUCTORS])
def test_bad_constructor_values(cls, kwargs, name):
    kwargs = dict(hidden_size=HIDDEN, num_heads=4) | kwargs
    with pytest.raises(ValueError, match=f"^{name}:"):
        cls(**kwargs)


@layers
def test_bad_inputs(make_layer):
    layer = make_layer()
    with pytest.raises(ValueError, match="^hidden_states:"):
        layer(torch.randn(2, 5, HIDDEN + 1))
    with pytest.raises(ValueError, match="^hidden_states:"):
        layer(torch.randn(5, HIDDEN))
    with pytest.raises(ValueError, match="^attention_mask:"):
        layer(torch.randn(2, 5, HIDDEN), attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        layer(torch.randn(2, 5, HIDDEN), cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="^cu_seqlens:"):
        layer(torch.randn(1, 5, HIDDEN), cu_seqlens=torch.tensor([0, 3, 2, 5]))
    _, state = layer(torch.randn(2, 5, HIDDEN), use_cache=True)
    with pytest.raises(ValueError, match="^hidden_states:"):
        layer(torch.randn(2, 1, HIDDEN - 1), past_state=state)
    with pytest.raises(ValueError, match="^past_state:"):
        layer(torch.randn(3, 1, HIDDEN), past_state=state)
    with pytest.raises(ValueError, match="^past_state:"):
        layer(torch.randn(2, 1, HIDDEN), past_state={k: v for k, v in state.items() if k != "S"})
