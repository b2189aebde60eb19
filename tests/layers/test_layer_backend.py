"""Every mixer's layer hands its ``backend`` to its op: a layer built with ``backend="torch"`` must not run the kernels
that ``"auto"`` would pick on CUDA, and ``"triton"`` must reach them (the softmax, linear, DeltaNet and
stick-breaking layers once dropped it, so that their ops always saw ``"auto"``)."""

from __future__ import annotations

import importlib

import pytest
import torch

from attnkit import layers
from attnkit.layers import LinearAttention, StickBreakingAttention
from attnkit.models.configuration import MIXER_LAYERS, MIXERS
from attnkit.ops.common.utils import rel_rms

# mixer -> (the layer's module, the op its prefill calls)
OPS = {
    "path": ("path", "path_attention"),
    "path_fox": ("path", "path_attention"),
    "tapa": ("tapa", "tapa_attention"),
    "vla": ("vla", "vla_attention"),
    "rope": ("softmax", "softmax_attention"),
    "nope": ("softmax", "softmax_attention"),
    "fox": ("softmax", "softmax_attention"),
    "linear": ("linear", "linear_attention"),
    "deltanet": ("linear", "delta_rule"),
    "stickbreaking": ("stickbreaking", "stickbreaking_attention"),
}


def test_every_mixer_is_listed():
    assert set(OPS) == set(MIXERS)


@pytest.mark.parametrize("mixer", MIXERS)
def test_layer_passes_its_backend_to_the_op(monkeypatch, mixer):
    module_name, op_name = OPS[mixer]
    module = importlib.import_module(f"attnkit.layers.{module_name}")
    op = getattr(module, op_name)
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return op(*args, **kwargs)

    monkeypatch.setattr(module, op_name, spy)
    cls_name, fixed, _ = MIXER_LAYERS[mixer]
    layer = getattr(layers, cls_name)(32, 2, **fixed, backend="torch")
    layer(torch.randn(2, 5, 32))
    assert seen == ["torch"]


def test_layers_without_kernels_refuse_triton():
    layer = StickBreakingAttention(32, 2, backend="triton")
    with pytest.raises(NotImplementedError, match="Triton backend is not implemented"):
        layer(torch.randn(1, 3, 32))


def test_linear_layer_reaches_its_kernels():
    """``backend="triton"`` runs linear attention's kernels (under the interpreter on CPU): the PyTorch backend's
    output with the same weights."""
    torch.manual_seed(0)
    layer = LinearAttention(32, 2, backend="triton")
    reference = LinearAttention(32, 2, backend="torch")
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(1, 5, 32)
    assert rel_rms(layer(x)[0], reference(x)[0]) < 1e-5


def test_vla_layer_fuses_its_directions_where_the_op_runs_kernels(monkeypatch):
    """``backend="triton"``: the VLA layer's ``u`` comes from the fused normalisation (``attnkit::vla_unit_keys``
    with a floor and a scale, called once on ``u``'s projection) and the layer gives the PyTorch backend's output and
    gradients with the same weights; ``backend="torch"`` never calls it."""
    import attnkit.ops.vla.parallel as vla_parallel
    from attnkit.layers import VLAAttention

    calls, op = [], vla_parallel.vla_unit_keys_op

    def spy(x, *args):
        calls.append(args)
        return op(x, *args)

    monkeypatch.setattr(vla_parallel, "vla_unit_keys_op", spy)
    torch.manual_seed(0)
    layer = VLAAttention(32, 2, backend="triton")
    reference = VLAAttention(32, 2, backend="torch")
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(1, 9, 32)
    outs = []
    for module in (layer, reference):
        calls.clear()
        out = module(x)[0]
        out.square().sum().backward()
        outs.append((out, module.u_proj.weight.grad, module.q_proj.weight.grad))
        assert calls == ([(1e-12, 16**-0.5), ()] if module is layer else [])  # u's, then k's inside the op
    for actual, expected in zip(*outs):
        assert rel_rms(actual, expected) < 1e-5


def test_vla_layer_fused_directions_on_an_empty_batch():
    """``backend="triton"`` with no tokens: the fused ``u`` launches nothing (no empty grid), the output is empty on
    the input's graph and its backward gives an empty gradient."""
    from attnkit.layers import VLAAttention

    x = torch.randn(2, 0, 32, requires_grad=True)
    out, _ = VLAAttention(32, 2, backend="triton")(x)
    out.sum().backward()
    assert out.shape == (2, 0, 32) and x.grad is not None and x.grad.shape == x.shape


def spy_on(monkeypatch, module, name: str) -> list:
    """Records the arguments of each call of ``module.name`` (which the VLA layer looks up at call time)."""
    calls, fn = [], getattr(module, name)

    def spy(*args):
        calls.append(args)
        return fn(*args)

    monkeypatch.setattr(module, name, spy)
    return calls


def vla_pair():
    """A VLA layer on ``backend="triton"`` and one on ``"torch"`` with the same weights, ``o_norm``'s away from
    their initial ones and 1e-3 as its eps (so that a wrong weight, bias or eps shows)."""
    from attnkit.layers import VLAAttention

    torch.manual_seed(0)
    layer = VLAAttention(32, 2, backend="triton")
    layer.o_norm.eps = 1e-3
    with torch.no_grad():
        layer.o_norm.weight.normal_(1.0, 0.5)
        layer.o_norm.bias.normal_()
    reference = VLAAttention(32, 2, backend="torch")
    reference.o_norm.eps = 1e-3
    reference.load_state_dict(layer.state_dict())
    return layer, reference


def test_vla_layer_fuses_its_norm_and_feature_map_where_the_op_runs_kernels(monkeypatch):
    """``backend="triton"``: the VLA layer's prefill runs ``o_norm`` as ``attnkit::layer_norm`` with its own
    weight, bias and eps, writing ``o``'s dtype outside autocast, and ``elu + 1`` as ``attnkit::elu_plus_one`` on
    ``q`` and ``k`` at once, and gives the PyTorch backend's output and the gradients of ``o_norm``, ``o_proj`` and
    the projections with the same weights; the decoding step and ``backend="torch"`` keep PyTorch's."""
    from attnkit.ops.common import feature_map, layer_norm

    norms = spy_on(monkeypatch, layer_norm, "layer_norm")
    maps = spy_on(monkeypatch, feature_map, "elu_plus_one")
    x = torch.randn(2, 9, 32)
    outs = []
    for module in vla_pair():
        norms.clear()
        maps.clear()
        out, state = module(x, use_cache=True)
        out.square().sum().backward()
        norm, fused = module.o_norm, module.backend == "triton"
        seen = [(w is norm.weight, b is norm.bias, eps, dtype) for _, w, b, eps, dtype in norms]
        assert seen == ([(True, True, 1e-3, torch.float32)] if fused else [])
        assert [tuple(q.shape) + tuple(k.shape) for q, k in maps] == ([(2, 9, 2, 16) * 2] if fused else [])
        norms.clear()
        maps.clear()
        step = module(x[:, :1], past_state=state)[0]
        assert norms == maps == []
        grads = [p.grad for p in (norm.weight, norm.bias, module.o_proj.weight, module.q_proj.weight)]
        outs.append((out, step, *grads, module.k_proj.weight.grad, module.v_proj.weight.grad))
    for actual, expected in zip(*outs):
        assert rel_rms(actual, expected) < 1e-5


def test_vla_layer_output_norm_under_autocast(monkeypatch):
    """Under CPU bf16 autocast the fused LayerNorm writes bf16, the dtype ``o_proj`` computes in, and the output and
    the gradients of ``o``, ``o_norm`` and ``o_proj`` are PyTorch's within bf16's rounding (CPU autocast runs
    PyTorch's LayerNorm in bf16; CUDA's in float32, then ``o_proj`` casts to bf16: one rounding of the same float32
    values either way, which the fused kernel makes once). The whole layer, attention kernels included, stays within
    bf16's error of the PyTorch backend."""
    from attnkit.ops.common import layer_norm

    calls = spy_on(monkeypatch, layer_norm, "layer_norm")
    layer, reference = vla_pair()
    o = (1 + torch.randn(2, 40, 2, 16)).bfloat16()
    g = torch.randn(2, 40, 32).bfloat16()
    results = []
    for fused in (True, False):
        o_in = o.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer._out(o_in, fused)
        params = (layer.o_norm.weight, layer.o_norm.bias, layer.o_proj.weight)
        results.append((out, *torch.autograd.grad(out, (o_in, *params), g)))
    assert [dtype for *_, dtype in calls] == [torch.bfloat16]
    for actual, expected in zip(*results):
        assert actual.dtype == expected.dtype and rel_rms(actual, expected) < 2e-2
    x = torch.randn(2, 24, 32)
    outs = []
    for module in (layer, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)[0]
        out.backward(g[:, :24])
        outs.append((out, module.o_norm.weight.grad, module.o_norm.bias.grad, module.q_proj.weight.grad))
    assert outs[0][0].dtype == torch.bfloat16
    for actual, expected in zip(*outs):
        assert rel_rms(actual, expected) < 5e-2


def test_vla_layer_wider_than_the_fused_layer_norm_takes_pytorchs(monkeypatch):
    """Rows wider than ``attnkit::layer_norm`` holds (``MAX_N``, narrowed here to 16) take ``o_norm`` itself: the
    fused op is not called and the output is the PyTorch backend's with the same weights."""
    import attnkit.ops.common.layer_norm as ln
    from attnkit.layers import VLAAttention

    calls = []
    monkeypatch.setattr(ln, "MAX_N", 16)
    monkeypatch.setattr(ln, "layer_norm", lambda *a: calls.append(a))
    torch.manual_seed(0)
    layer = VLAAttention(32, 2, backend="triton")
    reference = VLAAttention(32, 2, backend="torch")
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(1, 9, 32)
    assert rel_rms(layer(x)[0], reference(x)[0]) < 1e-5 and not calls
