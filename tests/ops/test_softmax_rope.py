"""Baselines (SPEC §5): softmax / FoX attention against their loops, RoPE helpers against transformers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnkit.ops.baselines.rope import apply_rope, rope_cos_sin, rope_inv_freq
from attnkit.ops.baselines.softmax import softmax_attention, softmax_naive
from tests.helpers import assert_close, tol_for


def make_inputs(B, T, HQ, H, K, V, dtype=torch.float64):
    """Drawn in float32 so that a float32 run and the float64 reference see exactly the same inputs."""
    q, k, v = torch.randn(B, T, HQ, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, HQ) + 3)
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype)


def run(fn, inputs, do, dtype):
    inputs = [x.detach().to(dtype).requires_grad_() for x in inputs]
    o = fn(*inputs)
    return (o, *torch.autograd.grad(o, inputs, do.to(o.dtype)))


# ------------------------------------------------------------------------------------------------ softmax

# B, T, HQ, H, K, V
SHAPES = [(2, 1, 4, 2, 16, 16), (2, 63, 4, 2, 32, 32), (1, 100, 4, 1, 16, 24), (2, 37, 2, 2, 8, 8)]


@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-T{t}-HQ{hq}-H{h}-K{k}-V{v}" for b, t, hq, h, k, v in SHAPES])
def test_softmax_matches_naive(shape, dtype, gated):
    B, T, HQ, H, K, V = shape
    q, k, v, g = make_inputs(*shape)
    do = torch.randn(B, T, HQ, V, dtype=torch.float64)
    inputs = (q, k, v, g) if gated else (q, k, v)
    expected = run(softmax_naive, inputs, do, torch.float64)
    actual = run(softmax_attention, inputs, do, dtype)
    for name, a, e in zip(("o", "dq", "dk", "dv", "dg"), actual, expected):
        assert a.dtype == dtype
        assert_close(name, a, e, tol_for(dtype))


def test_softmax_scale():
    q, k, v, g = make_inputs(1, 20, 2, 1, 8, 8)
    assert_close("o", softmax_attention(q, k, v, g, scale=0.3), softmax_naive(q, k, v, g, scale=0.3), 1e-12)


def test_fox_gate_is_not_scaled():
    """``scale`` multiplies ``qᵀk`` only: scaling q by c and dividing scale by c leaves FoX unchanged."""
    q, k, v, g = make_inputs(1, 20, 2, 1, 8, 8)
    expected = softmax_attention(q, k, v, g)
    assert_close("o", softmax_attention(q * 4, k, v, g, scale=0.25 / math.sqrt(8)), expected, 1e-12)


@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
@pytest.mark.parametrize("offsets", [[0, 5, 37, 100], [0, 5, 5, 37, 100]], ids=["ragged", "empty-segment"])
def test_softmax_varlen(offsets, gated):
    T = offsets[-1]
    q, k, v, g = make_inputs(1, T, 4, 2, 16, 8)
    do = torch.randn(1, T, 4, 8, dtype=torch.float64)
    inputs = (q, k, v, g) if gated else (q, k, v)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int64)

    def per_segment(*xs):
        # Each segment restarts: its gates accumulate from 0.
        bounds = zip(offsets[:-1], offsets[1:])
        return torch.cat([softmax_naive(*(x[:, s:e] for x in xs)) for s, e in bounds], dim=1)

    expected = run(per_segment, inputs, do, torch.float64)
    actual = run(lambda *xs: softmax_attention(*xs, cu_seqlens=cu_seqlens), inputs, do, torch.float64)
    for name, a, e in zip(("o", "dq", "dk", "dv", "dg"), actual, expected):
        assert_close(name, a, e, 1e-10)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 2, 2, 6]], ids=["dense", "varlen"])
@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
def test_softmax_gradcheck(gated, cu_seqlens):
    B = 2 if cu_seqlens is None else 1
    q, k, v, g = (x.requires_grad_() for x in make_inputs(B, 6, 4, 2, 4, 3))
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    inputs = (q, k, v, g) if gated else (q, k, v)
    assert torch.autograd.gradcheck(lambda *xs: softmax_attention(*xs, cu_seqlens=cu), inputs)


def test_softmax_empty_sequence():
    q, k, v, g = make_inputs(1, 0, 2, 1, 8, 6)
    assert softmax_attention(q, k, v, g).shape == (1, 0, 2, 6)
    assert softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 0])).shape == (1, 0, 2, 6)


def test_softmax_empty_sequence_backward():
    """T = 0: the empty output stays on the inputs' graph (it was detached), so a backward gives empty gradients."""
    leaves = [x.requires_grad_() for x in make_inputs(2, 0, 2, 1, 8, 6)]
    softmax_attention(*leaves).sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fox_half_precision_long_gate(dtype):
    """The gate is accumulated in float32: at T = 512 its cumulative sum is far beyond bf16 resolution."""
    q, k, v, g = make_inputs(1, 512, 2, 2, 16, 16, dtype=torch.float32)
    g = g - 1
    o = softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype))
    expected = softmax_naive(*(x.to(dtype).double() for x in (q, k, v, g)))
    assert o.dtype == dtype
    assert_close("o", o, expected, 1e-2)


BAD_INPUTS = {
    "q-rank": ("q", dict(q=torch.zeros(2, 8, 4))),
    "k-shape": ("k", dict(k=torch.zeros(2, 7, 2, 4))),
    "v-shape": ("v", dict(v=torch.zeros(2, 8, 3, 4))),
    "heads-not-multiple": ("q", dict(q=torch.zeros(2, 8, 3, 4))),
    "g-shape": ("g", dict(g=torch.zeros(2, 8, 2))),
    "g-rank": ("g", dict(g=torch.zeros(2, 8))),
    "g-int": ("g", dict(g=torch.zeros(2, 8, 4, dtype=torch.int64))),
    "scale-negative": ("scale", dict(scale=-1.0)),
    "scale-nan": ("scale", dict(scale=float("nan"))),
    "cu_seqlens-batch": ("cu_seqlens", dict(cu_seqlens=torch.tensor([0, 8]))),
    "cu_seqlens-non-monotone": (
        "cu_seqlens",
        dict(
            q=torch.zeros(1, 8, 4, 4),
            k=torch.zeros(1, 8, 2, 4),
            v=torch.zeros(1, 8, 2, 4),
            cu_seqlens=torch.tensor([0, 6, 3, 8]),
        ),
    ),
    "cu_seqlens-float": (
        "cu_seqlens",
        dict(
            q=torch.zeros(1, 8, 4, 4),
            k=torch.zeros(1, 8, 2, 4),
            v=torch.zeros(1, 8, 2, 4),
            cu_seqlens=torch.tensor([0.0, 8.0]),
        ),
    ),
}


@pytest.mark.parametrize("name, change", BAD_INPUTS.values(), ids=list(BAD_INPUTS))
def test_softmax_bad_input_raises_value_error(name, change):
    args = dict(q=torch.zeros(2, 8, 4, 4), k=torch.zeros(2, 8, 2, 4), v=torch.zeros(2, 8, 2, 4), g=None)
    args.update(change)
    with pytest.raises(ValueError, match=f"^{name}"):
        softmax_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), **args)


# ------------------------------------------------------------------------------------------------ RoPE


def hf_config(dim, rope_parameters, max_position_embeddings=4096):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=4 * dim,
        num_attention_heads=4,
        head_dim=dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )


def hf_inv_freq(dim, rope_parameters, max_position_embeddings=4096, seq_len=None):
    config = hf_config(dim, rope_parameters, max_position_embeddings)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu", seq_len=seq_len)


SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "linear-llama3-base": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-betas": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-deepseek-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "yarn-no-truncate": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "attention_factor": 1.5,
    },
}


@pytest.mark.parametrize("dim", [32, 64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=list(SCALINGS))
def test_inv_freq_matches_transformers(scaling, dim):
    rope_parameters = {"rope_theta": 10000.0, **scaling}
    expected, expected_factor = hf_inv_freq(dim, rope_parameters)
    inv_freq, attention_factor = rope_inv_freq(dim, 10000.0, scaling)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (dim // 2,)
    assert_close("inv_freq", inv_freq, expected, 1e-6)
    assert attention_factor == pytest.approx(expected_factor, rel=1e-12)


def test_default_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = hf_config(64, {"rope_type": "default", "rope_theta": 10000.0})
    expected, expected_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    inv_freq, attention_factor = rope_inv_freq(64)
    assert_close("inv_freq", inv_freq, expected, 1e-6)
    assert attention_factor == expected_factor == 1.0


@pytest.mark.parametrize("seq_len", [None, 1024, 1536, 2048, 4000], ids=lambda s: f"L{s}")
def test_dynamic_matches_transformers(seq_len):
    """transformers reads the trained length from ``max_position_embeddings``; ours from the dict."""
    expected, _ = hf_inv_freq(64, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 1024, seq_len)
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 1024}
    inv_freq, attention_factor = rope_inv_freq(64, scaling=scaling, seq_len=seq_len)
    assert_close("inv_freq", inv_freq, expected, 1e-6)
    assert attention_factor == 1.0


def test_static_ntk_is_dynamic_at_its_length():
    """Static NTK-aware ``base·f^(dim/(dim−2))`` is transformers' dynamic NTK at ``L = M·(2f − 1)/f``."""
    dim, factor, trained = 64, 2.0, 1024
    expected, _ = hf_inv_freq(
        dim, {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": factor}, trained, seq_len=1536
    )
    inv_freq, _ = rope_inv_freq(dim, scaling={"rope_type": "ntk", "factor": factor})
    assert_close("inv_freq", inv_freq, expected, 1e-6)
    closed_form = (10000.0 * factor ** (dim / (dim - 2))) ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert_close("inv_freq", inv_freq, closed_form, 1e-7)


def test_linear_is_position_interpolation():
    """PI: rotating position p with ``inv_freq / f`` is rotating position ``p / f`` unscaled."""
    inv_freq, _ = rope_inv_freq(32, scaling={"type": "linear", "factor": 4.0})
    plain, _ = rope_inv_freq(32)
    positions = torch.arange(0, 4096, 4)
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos_ref, sin_ref = rope_cos_sin(positions // 4, plain)
    assert_close("cos", cos, cos_ref, 1e-5)
    assert_close("sin", sin, sin_ref, 1e-5)


@pytest.mark.parametrize("scaling", [None, SCALINGS["yarn"]], ids=["default", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_apply_rope_matches_transformers(scaling, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    B, T, H, D = 2, 50, 3, 32
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, **(scaling or {})}
    rotary = LlamaRotaryEmbedding(hf_config(D, rope_parameters))
    q, k = torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, H, D, dtype=dtype)
    position_ids = torch.arange(T).repeat(B, 1) + torch.tensor([[0], [17]])
    cos_ref, sin_ref = rotary(q, position_ids)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos_ref, sin_ref)

    cos, sin = rope_cos_sin(position_ids, *rope_inv_freq(D, scaling=scaling), dtype=dtype)
    assert_close("cos", cos, cos_ref, 1e-6)
    assert_close("sin", sin, sin_ref, 1e-6)
    assert torch.equal(apply_rope(q, cos_ref, sin_ref), q_ref.transpose(1, 2))
    assert torch.equal(apply_rope(k, cos_ref, sin_ref), k_ref.transpose(1, 2))


def test_rope_scores_depend_on_relative_position_only():
    D = 16
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    inv_freq, _ = rope_inv_freq(D)

    def score(m, n):
        cos, sin = rope_cos_sin(torch.tensor([m, n]), inv_freq, dtype=torch.float64)
        return (apply_rope(q, cos[:1], sin[:1]) * apply_rope(k, cos[1:], sin[1:])).sum().item()

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-5)
    # A rotation keeps the norm (up to the float32 angles behind cos and sin).
    cos, sin = rope_cos_sin(torch.tensor([5]), inv_freq, dtype=torch.float64)
    assert_close("norm", torch.linalg.vector_norm(apply_rope(q, cos, sin)), torch.linalg.vector_norm(q), 1e-6)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("dim", dict(dim=7)),
        ("dim", dict(dim=0)),
        ("base", dict(dim=8, base=-1.0)),
        ("scaling", dict(dim=8, scaling={"rope_type": "longrope", "factor": 2.0})),
        ("scaling", dict(dim=8, scaling={"rope_type": "linear"})),
        ("scaling", dict(dim=8, scaling={"rope_type": "linear", "factor": -2.0})),
        ("scaling", dict(dim=8, scaling={"rope_type": "yarn", "factor": 2.0})),
        ("scaling", dict(dim=8, scaling={"rope_type": "dynamic", "factor": 2.0})),
        ("scaling", dict(dim=8, scaling=[("rope_type", "linear")])),
    ],
    ids=[
        "dim-odd",
        "dim-zero",
        "base-negative",
        "type-unknown",
        "factor-missing",
        "factor-negative",
        "yarn-no-original-length",
        "dynamic-no-trained-length",
        "not-a-dict",
    ],
)
def test_rope_bad_input_raises_value_error(name, kwargs):
    with pytest.raises(ValueError, match=f"^{name}"):
        rope_inv_freq(**kwargs)


def test_ops_work_without_transformers():
    """transformers is an optional extra: with it made unimportable, these ops still import and run."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import torch\n"
        "from attnkit.ops.baselines.rope import rope_inv_freq\n"
        "from attnkit.ops.baselines.softmax import softmax_attention\n"
        "from attnkit.ops.tapa import tapa_attention\n"
        "x = torch.randn(1, 4, 2, 8)\n"
        "tapa_attention(x, x, x); softmax_attention(x, x, x); rope_inv_freq(8)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
