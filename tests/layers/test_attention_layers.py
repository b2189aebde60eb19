"""The softmax, PaTH and TAPA layers: packing, left padding and the decoding cache against full forwards."""

from __future__ import annotations

import pytest
import torch

from attnkit.layers import FoXAttention, NoPEAttention, PaTHAttention, RoPEAttention, TAPAAttention
from tests.helpers import assert_close

HIDDEN = 32
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}

LAYERS = {
    "rope-gqa": lambda: RoPEAttention(HIDDEN, 4, 2),
    "rope-yarn": lambda: RoPEAttention(HIDDEN, 2, head_dim=16, rope_scaling=YARN),
    "nope": lambda: NoPEAttention(HIDDEN, 2),
    "fox-gqa": lambda: FoXAttention(HIDDEN, 4, 2),
    "path-gqa": lambda: PaTHAttention(HIDDEN, 4, 2, w_rank=8),
    "path-fox": lambda: PaTHAttention(HIDDEN, 2, use_forget_gate=True, conv_size=4, beta_max=2 - 1e-3),
    "tapa-mqa": lambda: TAPAAttention(HIDDEN, 4, 1, theta=0.5, alpha=0.3),
}


def make(name):
    return LAYERS[name]().eval()


def left_padded(seqs):
    """Sequences ``[T_i, hidden]`` -> ``(x [B, T, hidden], attention_mask [B, T])`` padded on the left."""
    T = max(s.shape[0] for s in seqs)
    x = torch.randn(len(seqs), T, HIDDEN)  # junk in the padding: the mask alone must keep it out
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, T - s.shape[0] :] = s
        mask[i, T - s.shape[0] :] = 1
    return x, mask


@pytest.mark.parametrize("name", LAYERS)
def test_dense_batch_equals_packed(name):
    layer = make(name)
    x = torch.randn(3, 20, HIDDEN)
    dense, _ = layer(x)
    packed, _ = layer(x.reshape(1, 60, HIDDEN), cu_seqlens=torch.tensor([0, 20, 40, 60], dtype=torch.int32))
    assert_close("dense", dense, packed.view(3, 20, HIDDEN), 1e-5)
    # unequal lengths, one of them a single token
    seqs = [torch.randn(n, HIDDEN) for n in (5, 17, 1)]
    packed, _ = layer(torch.cat(seqs)[None], cu_seqlens=torch.tensor([0, 5, 22, 23]))
    alone = torch.cat([layer(s[None])[0][0] for s in seqs])
    assert_close("unequal", packed[0], alone, 1e-5)


@pytest.mark.parametrize("name", LAYERS)
def test_left_padding_equals_sequences_alone(name):
    layer = make(name)
    seqs = [torch.randn(n, HIDDEN) for n in (12, 7, 1)]
    x, mask = left_padded(seqs)
    out, _ = layer(x, attention_mask=mask)
    for i, s in enumerate(seqs):
        n = s.shape[0]
        assert_close(f"seq{i}", out[i, -n:], layer(s[None])[0][0], 1e-5)
        assert (out[i, :-n] == 0).all()


DECODE = {
    # name: (prompt lengths, tokens decoded after the prompt)
    "padded": ((9, 4, 0), 6),  # the last prompt is all padding
    "prompt1": ((1, 1), 8),
    "long": ((70, 66), 4),
}


@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("name", LAYERS)
def test_prefill_then_decode_equals_full_forward(name, case):
    layer = make(name)
    prompt_lengths, steps = DECODE[case]
    seqs = [torch.randn(n + steps, HIDDEN) for n in prompt_lengths]
    P = max(prompt_lengths)
    x, mask = left_padded([s[:n] for s, n in zip(seqs, prompt_lengths)])
    x = torch.cat([x, torch.stack([s[-steps:] for s in seqs])], dim=1)
    mask = torch.cat([mask, mask.new_ones(len(seqs), steps)], dim=1)
    full, _ = layer(x, attention_mask=mask)

    out, state = layer(x[:, :P], attention_mask=mask[:, :P], use_cache=True)
    outs = [out]
    for t in range(P, P + steps):
        out, state = layer(x[:, t : t + 1], attention_mask=mask[:, : t + 1], past_state=state, use_cache=True)
        outs.append(out)
    assert_close("decode", torch.cat(outs, dim=1)[:, P:], full[:, P:], 1e-4)
    assert_close("prefill", outs[0], full[:, :P], 1e-5)
    assert state["mask"].shape == (len(seqs), P + steps)
    assert state["seen"].tolist() == [n + steps for n in prompt_lengths]


@pytest.mark.parametrize("name", LAYERS)
def test_several_tokens_after_a_cache(name):
    """A multi-token call with a cache runs the steps one after the other."""
    layer = make(name)
    x = torch.randn(2, 10, HIDDEN)
    full, _ = layer(x)
    _, state = layer(x[:, :4], use_cache=True)
    rest, _ = layer(x[:, 4:], past_state=state)
    assert_close("rest", rest, full[:, 4:], 1e-4)


@pytest.mark.parametrize("name", LAYERS)
def test_gradients_reach_every_parameter(name):
    layer = make(name).train()
    x, mask = left_padded([torch.randn(n, HIDDEN) for n in (9, 5)])
    out, _ = layer(x, attention_mask=mask)
    out.pow(2).sum().backward()
    for pname, p in layer.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


BAD_CONSTRUCTORS = {
    "hidden-not-multiple": (lambda: RoPEAttention(30, 4), "^hidden_size"),
    "hidden-zero": (lambda: NoPEAttention(0, 2), "^hidden_size"),
    "heads-zero": (lambda: FoXAttention(32, 0), "^num_heads"),
    "kv-heads": (lambda: PaTHAttention(32, 4, 3), "^num_kv_heads"),
    "head-dim": (lambda: TAPAAttention(32, 4, head_dim=0), "^head_dim"),
    "rope-odd-head-dim": (lambda: RoPEAttention(30, 2), "^head_dim"),
    "rope-theta": (lambda: RoPEAttention(32, 4, rope_theta=0.5), "^rope_theta"),
    "rope-scaling-type": (lambda: RoPEAttention(32, 4, rope_scaling={"rope_type": "bogus"}), "^rope_scaling"),
    "rope-scaling-yarn": (lambda: RoPEAttention(32, 4, rope_scaling={"type": "yarn", "factor": 2}), "^rope_scaling"),
    "rope-scaling-list": (lambda: RoPEAttention(32, 4, rope_scaling=[2.0]), "^rope_scaling"),
    "backend": (lambda: FoXAttention(32, 4, backend="cuda"), "^backend"),
    "layer-idx": (lambda: NoPEAttention(32, 4, layer_idx=-1), "^layer_idx"),
    "beta-max-zero": (lambda: PaTHAttention(32, 4, beta_max=0.0), "^beta_max"),
    "beta-max-big": (lambda: PaTHAttention(32, 4, beta_max=2.5), "^beta_max"),
    "w-rank": (lambda: PaTHAttention(32, 4, w_rank=0), "^w_rank"),
    "conv-size": (lambda: PaTHAttention(32, 4, conv_size=0), "^conv_size"),
    "path-backend": (lambda: PaTHAttention(32, 4, backend="gpu"), "^backend"),
    "tapa-theta-empty-amp": (lambda: TAPAAttention(32, 4, theta=0.05), "^theta"),
    "tapa-theta-one": (lambda: TAPAAttention(32, 4, theta=1.0), "^theta"),
    "tapa-alpha": (lambda: TAPAAttention(32, 4, alpha=-1.0), "^alpha"),
}


@pytest.mark.parametrize("case", BAD_CONSTRUCTORS)
def test_bad_constructor_values(case):
    build, match = BAD_CONSTRUCTORS[case]
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("name", LAYERS)
def test_bad_inputs(name):
    layer = make(name)
    x = torch.randn(2, 6, HIDDEN)
    with pytest.raises(ValueError, match="^hidden_states"):
        layer(torch.randn(2, 6, HIDDEN + 1))
    with pytest.raises(ValueError, match="^hidden_states"):
        layer(x[0])
    with pytest.raises(ValueError, match="^attention_mask"):
        layer(x, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]] * 2))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 4, 3, 6]))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        layer(x[:1], cu_seqlens=torch.tensor([0, 4, 5]))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        layer(x, cu_seqlens=torch.tensor([0, 3, 6]))


@pytest.mark.parametrize("name", LAYERS)
def test_built_on_meta_device_then_loaded(name):
    """The way Hugging Face loads a checkpoint: build on the meta device, materialise, load the state dict.
    Nothing the layer computes may live outside the state dict (a non-persistent RoPE buffer would)."""
    layer = make(name)
    with torch.device("meta"):
        empty = LAYERS[name]()
    empty = empty.to_empty(device="cpu").eval()
    empty.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, HIDDEN)
    assert torch.equal(empty(x)[0], layer(x)[0])


@pytest.mark.parametrize("masked", [False, True], ids=["dense", "with-mask"])
@pytest.mark.parametrize("name", LAYERS)
def test_empty_sequence(name, masked):
    """T = 0: an empty output on the input's graph, whose backward gives an empty gradient (it raised a reshape
    error), with or without an (empty) attention mask."""
    layer = make(name)
    x = torch.randn(2, 0, HIDDEN, requires_grad=True)
    out, _ = layer(x, attention_mask=torch.ones(2, 0, dtype=torch.long) if masked else None)
    assert out.shape == (2, 0, HIDDEN)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("name", ["fox-gqa", "path-fox"])
def test_gates_reach_the_ops_in_float32_under_autocast(monkeypatch, name):
    """Under bf16 autocast the gates' projections still run in float32 (``F.linear`` alone would run in bf16, whatever
    its inputs' dtypes): ``beta`` and ``g`` reach the ops in float32, ``q, k, v`` in bf16."""
    import attnkit.layers.path as path_layer
    import attnkit.layers.softmax as softmax_layer

    module, op = (path_layer, "path_attention") if name.startswith("path") else (softmax_layer, "softmax_attention")
    seen, fn = [], getattr(module, op)

    def spy(*args, **kwargs):
        seen.append([None if x is None else x.dtype for x in args])
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, op, spy)
    layer = make(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(2, 9, HIDDEN))
    gates = seen[0][4:] if op == "path_attention" else seen[0][3:]  # (beta, g) or (g,)
    assert seen[0][:3] == [torch.bfloat16] * 3 and gates == [torch.float32] * len(gates), seen


@pytest.mark.parametrize("name", ["path-gqa", "path-fox"])
def test_path_low_rank_projection_stacked_with_the_gates(monkeypatch, name):
    """PaTH's ``w_down`` runs in the gates' float32 product (one ``linear_fp32`` call on ``w_down``, ``beta_proj``
    and, for PaTH-FoX, ``g_proj``) in the prefill and the decoding step alike, under bf16 autocast; and a layer whose
    weights are bf16 runs without autocast (``r`` back in the input's dtype before ``w_up``), forward and backward."""
    import attnkit.layers.path as path_layer

    calls, fn = [], path_layer.linear_fp32

    def spy(x, *layers):
        outs = fn(x, *layers)
        calls.append((layers, [o.dtype for o in outs]))
        return outs

    monkeypatch.setattr(path_layer, "linear_fp32", spy)
    layer = make(name)
    expected = (layer.w_down, layer.beta_proj) + ((layer.g_proj,) if name == "path-fox" else ())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, state = layer(torch.randn(2, 9, HIDDEN), use_cache=True)
        layer(torch.randn(2, 1, HIDDEN), past_state=state, use_cache=True)
    assert len(calls) == 2
    for layers, dtypes in calls:
        assert layers == expected and dtypes == [torch.float32] * len(expected)
    half = make(name).to(torch.bfloat16).train()
    x = torch.randn(2, 9, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    out, _ = half(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad is not None and half.w_down.weight.grad is not None


@pytest.mark.parametrize("biases", [(True, True), (False, True), (False, False)], ids=["both", "one", "none"])
def test_stacked_gate_projections_equal_one_at_a_time(biases):
    """``linear_fp32`` with several layers (PaTH-FoX's ``beta`` and ``g`` projections in one product) gives each
    layer's own float32 output under bf16 autocast, and the same gradients of the input and of every parameter."""
    from attnkit.layers.base import linear_fp32

    torch.manual_seed(0)
    layers = [torch.nn.Linear(HIDDEN, n, bias=b) for n, b in zip((3, 5), biases)]
    x = torch.randn(2, 7, HIDDEN, requires_grad=True)
    weights = torch.randn(2, 7, 8)
    results = []
    for stacked in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = linear_fp32(x, *layers) if stacked else tuple(linear_fp32(x, layer) for layer in layers)
        assert [o.dtype for o in outs] == [torch.float32] * 2 and [o.shape[-1] for o in outs] == [3, 5]
        x.grad = None
        for layer in layers:
            layer.zero_grad()
        (torch.cat(outs, -1) * weights).sum().backward()
        params = [p.grad.clone() for layer in layers for p in layer.parameters()]
        results.append([*outs, x.grad.clone(), *params])
    for one, stacked in zip(*results):
        torch.testing.assert_close(stacked, one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["fox-gqa", "path-fox"])
def test_cumulative_gates_for_the_cache_only_when_it_is_asked_for(monkeypatch, name):
    """Training (``use_cache=False``) skips the cache's cumulative gates, a scan a layer (the FoX model's training
    step fell from 48.0 to 41.2 ms at ``B = 4, T = 4096`` on an H100 without it); prefill with a cache builds them
    once."""
    import attnkit.layers.path as path_layer
    import attnkit.layers.softmax as softmax_layer

    module = path_layer if name.startswith("path") else softmax_layer
    calls, fn = [], module.segment_cumsum

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, "segment_cumsum", spy)
    layer, x = make(name), torch.randn(2, 9, HIDDEN)
    layer(x)
    assert calls == []
    _, state = layer(x, use_cache=True)
    assert len(calls) == 1 and state["g"].shape == calls[0]
