"""VLA: the chunked PyTorch backend against the definitional loop, the SPEC §4 properties, validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.baselines.linear import linear_attention
from attnkit.ops.vla import vla_attention
from attnkit.ops.vla.naive import vla_gates_naive, vla_naive
from attnkit.ops.vla.torch_impl import vla_chunk, vla_chunk_gates
from tests.helpers import assert_close, tol_for


def make_inputs(B, T, H, K, V, dtype=torch.float64, requires_grad=False):
    """Inputs as the VLA layer passes them: elu+1 features, ``u`` unit-normalised and divided by sqrt(K)."""
    q = F.elu(torch.randn(B, T, H, K, dtype=torch.float64)) + 1
    k = F.elu(torch.randn(B, T, H, K, dtype=torch.float64)) + 1
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    u = F.normalize(torch.randn(B, T, H, K, dtype=torch.float64), dim=-1) / K**0.5
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v, u))


def make_state(N, H, K, V, lam0, dtype=torch.float64, requires_grad=False):
    """A reachable state: ``A`` the inverse penalty after 3K random directions, ``n`` positive."""
    S = 0.5 * torch.randn(N, H, V, K, dtype=torch.float64)
    X = torch.randn(N, H, 3 * K, K, dtype=torch.float64) / K
    A = torch.linalg.inv(lam0 * torch.eye(K, dtype=torch.float64) + X.transpose(-1, -2) @ X)
    n = 5 * torch.rand(N, H, K, dtype=torch.float64)
    return tuple(x.to(dtype).requires_grad_(requires_grad) for x in (S, A, n))


def leaf_copy(xs, dtype):
    return tuple(x.detach().to(dtype).requires_grad_() for x in xs)


def check_against_naive(
    B, T, H, K, V, dtype, lam0=0.1, with_state=False, normalize_output=True, chunk_size=None, normalize_write=True
):
    """Output, final state and gradients of every input in ``dtype`` vs the float64 loop, same inputs."""
    inputs = make_inputs(B, T, H, K, V)
    state = make_state(B, H, K, V, lam0) if with_state else ()
    kwargs = dict(lam0=lam0, eps=1e-4, normalize_output=normalize_output, normalize_write=normalize_write)

    ref_in, ref_state = leaf_copy(inputs, torch.float64), leaf_copy(state, torch.float64)
    o_ref, final_ref = vla_naive(*ref_in, **kwargs, initial_state=ref_state or None, output_final_state=True)
    tst_in, tst_state = leaf_copy(inputs, dtype), leaf_copy(state, dtype)
    if chunk_size is None:
        o, final = vla_attention(
            *tst_in, **kwargs, initial_state=tst_state or None, output_final_state=True, backend="torch"
        )
    else:
        o, final = vla_chunk(*tst_in, **kwargs, initial_state=tst_state or None, chunk_size=chunk_size)

    tol = tol_for(dtype)
    assert o.dtype == dtype and all(s.dtype == dtype for s in final)
    assert_close("o", o, o_ref, tol)
    for name, x, x_ref in zip(("S", "A", "n"), final, final_ref, strict=True):
        assert_close(name, x, x_ref, tol)

    # One random cotangent per output, shared by both runs.
    cotangents = [torch.randn_like(x_ref) for x_ref in (o_ref, *final_ref)]
    for outs in ((o_ref, *final_ref), (o, *final)):
        loss = sum((x * g.to(x.dtype)).sum() for x, g in zip(outs, cotangents, strict=True))
        loss.backward()
    names = ("dq", "dk", "dv", "du", "dS0", "dA0", "dn0")
    for name, x, x_ref in zip(names, tst_in + tst_state, ref_in + ref_state, strict=False):
        assert_close(name, x.grad, x_ref.grad, tol)


SHAPES = [(2, 1, 2, 16, 32), (2, 2, 2, 16, 32), (2, 63, 4, 16, 32), (1, 100, 2, 32, 16), (1, 300, 2, 16, 24)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("B, T, H, K, V", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}" for b, t, h, k, v in SHAPES])
def test_matches_naive(B, T, H, K, V, dtype):
    check_against_naive(B, T, H, K, V, dtype, with_state=T in (2, 100))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("lam0", [0.01, 0.1, 10.0], ids=lambda x: f"lam{x}")
def test_matches_naive_lam0(lam0, dtype):
    check_against_naive(2, 100, 2, 16, 32, dtype, lam0=lam0, with_state=True)


@pytest.mark.parametrize("chunk_size", [4, 16, 32])
def test_chunk_sizes(chunk_size):
    check_against_naive(1, 63, 2, 8, 12, torch.float64, with_state=True, chunk_size=chunk_size)


def test_unnormalized_output():
    check_against_naive(2, 70, 2, 16, 8, torch.float64, normalize_output=False, with_state=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("normalize_output", [True, False], ids=["norm", "nonorm"])
def test_unnormalized_write_matches_naive(dtype, normalize_output):
    """The no-normalisation ablation (``normalize_write=False``: the memory writes along ``a_t = A_t k̂_t``) against
    the loop, across chunks and with an initial state, every gradient included."""
    kwargs = dict(normalize_output=normalize_output, normalize_write=False)
    check_against_naive(2, 70, 2, 16, 8, dtype, with_state=True, **kwargs)
    check_against_naive(1, 63, 2, 8, 12, dtype, normalize_write=False, chunk_size=16)


def test_unnormalized_write_directions():
    """Without the normalisation the write direction is ``A_t k̂_t`` itself: parallel to the unit one, of norm up to
    ``1 / lam0``, and the state it writes is not the normalised state."""
    lam0 = 0.1
    q, k, v, u = make_inputs(1, 40, 2, 16, 8)
    _, unit, _ = vla_gates_naive(k, u, lam0)
    _, raw, _ = vla_gates_naive(k, u, lam0, normalize_write=False)
    norms = raw.norm(dim=-1)
    assert_close("direction", raw / norms[..., None], unit, 1e-12)
    assert (norms <= 1 / lam0 + 1e-9).all() and norms.min() > 1.5, norms.min()
    S_unit = vla_attention(q, k, v, u, lam0=lam0, output_final_state=True)[1][0]
    S_raw = vla_attention(q, k, v, u, lam0=lam0, normalize_write=False, output_final_state=True)[1][0]
    assert (S_raw - S_unit).norm() > 0.1 * S_unit.norm()


def test_normalize_write_reaches_the_layer_from_the_model_config():
    """``mixer_kwargs={"vla": {"normalize_write": False}}``: the config accepts it and every layer runs the ablation;
    the model then differs from the default one with the same weights."""
    from attnkit.models import AttnKitConfig, AttnKitForCausalLM

    sizes = dict(vocab_size=29, hidden_size=32, num_hidden_layers=2, num_heads=2, intermediate_size=48, mixer="vla")
    torch.manual_seed(0)
    ablation = AttnKitForCausalLM(AttnKitConfig(**sizes, mixer_kwargs={"vla": {"normalize_write": False}}))
    default = AttnKitForCausalLM(AttnKitConfig(**sizes))
    default.load_state_dict(ablation.state_dict())
    assert all(not block.attn.normalize_write for block in ablation.model.layers)
    assert all(block.attn.normalize_write for block in default.model.layers)
    ids = torch.randint(0, 29, (2, 12))
    with torch.no_grad():
        assert not torch.allclose(ablation(ids).logits, default(ids).logits)


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_varlen_matches_separate_sequences(dtype, with_state):
    H, K, V, lam0 = 2, 16, 8, 0.1
    bounds = [0, 5, 5, 37, 100]
    cu_seqlens = torch.tensor(bounds, dtype=dtype)
    N = len(bounds) - 1
    q, k, v, u = make_inputs(1, bounds[-1], H, K, V, requires_grad=True)
    state = make_state(N, H, K, V, lam0, requires_grad=True) if with_state else None
    o, final = vla_attention(q, k, v, u, lam0=lam0, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.shape == v.shape and final[0].shape == (N, H, V, K) and final[1].shape == (N, H, K, K)
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg = tuple(x[:, bos:eos] for x in (q, k, v, u))
        seg_state = None if state is None else tuple(s[i : i + 1] for s in state)
        o_ref, final_ref = vla_naive(*seg, lam0, 1e-4, True, seg_state, True)
        if eos > bos:
            assert_close(f"o[{i}]", o[:, bos:eos], o_ref, 1e-10)
        for name, x, x_ref in zip(("S", "A", "n"), final, final_ref, strict=True):
            assert_close(f"{name}[{i}]", x[i : i + 1], x_ref, 1e-10)
    # The empty segment hands its initial state through unchanged.
    expected_A = state[1][1] if with_state else torch.eye(K, dtype=torch.float64) / lam0
    torch.testing.assert_close(final[1][1], expected_A.expand(H, K, K))
    (o.sum() + sum(s.sum() for s in final)).backward()
    leaves = (q, k, v, u) + (state or ())
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


def test_initial_state_chaining():
    q, k, v, u = make_inputs(2, 150, 2, 16, 8)
    o, final = vla_attention(q, k, v, u, lam0=0.05, output_final_state=True)
    split = 37
    o1, mid = vla_attention(*(x[:, :split] for x in (q, k, v, u)), lam0=0.05, output_final_state=True)
    o2, end = vla_attention(
        *(x[:, split:] for x in (q, k, v, u)), lam0=0.05, initial_state=mid, output_final_state=True
    )
    assert_close("o", torch.cat([o1, o2], 1), o, 1e-10)
    for name, x, x_ref in zip(("S", "A", "n"), end, final, strict=True):
        assert_close(name, x, x_ref, 1e-10)


def test_gradcheck():
    B, T, H, K, V, lam0 = 1, 6, 2, 3, 2, 0.5
    inputs = make_inputs(B, T, H, K, V, requires_grad=True)
    state = make_state(B, H, K, V, lam0, requires_grad=True)

    def fn(q, k, v, u, S, A, n):
        o, final = vla_attention(q, k, v, u, lam0=lam0, initial_state=(S, A, n), output_final_state=True)
        return (o, *final)

    def fn_small_chunks(q, k, v, u, S, A, n):
        o, final = vla_chunk(q, k, v, u, lam0, 1e-4, True, (S, A, n), chunk_size=4)
        return (o, *final)

    assert torch.autograd.gradcheck(fn, inputs + state)
    assert torch.autograd.gradcheck(fn_small_chunks, inputs + state)


def test_half_precision_dtypes():
    q, k, v, u = make_inputs(1, 40, 2, 16, 16, dtype=torch.bfloat16)
    o, (S, A, n) = vla_attention(q, k, v, u.float(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == A.dtype == n.dtype == torch.float32
    o_ref, _ = vla_naive(*(x.double() for x in (q, k, v, u)))
    assert_close("o", o, o_ref, 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gates_ignore_autocast(dtype):
    """The gates run in their inputs' float32 under autocast, to the bit: built from 16-bit products, the matrices
    they factor need not be positive definite (with these un-normalised ``u``, a head's ``I + U A0 Uᵀ`` of a
    64-token chunk is not in bf16)."""
    torch.manual_seed(0)
    k_hat = F.normalize(torch.randn(1, 4, 128, 8), dim=-1)
    u = torch.randn(1, 4, 128, 8)
    expected = vla_chunk_gates(k_hat, u, 0.1, None, 64)
    with torch.autocast("cpu", dtype=dtype):
        actual = vla_chunk_gates(k_hat, u, 0.1, None, 64)
    for name, x, y in zip(("alpha", "A_end"), actual, expected, strict=True):
        assert x.dtype == torch.float32 and torch.equal(x, y), name


def test_empty_sequence():
    q, k, v, u = make_inputs(2, 0, 2, 4, 3)
    o, (S, A, n) = vla_attention(q, k, v, u, lam0=0.5, output_final_state=True)
    assert o.shape == (2, 0, 2, 3)
    torch.testing.assert_close(A, torch.eye(4, dtype=torch.float64).expand(2, 2, 4, 4) / 0.5)
    assert (S == 0).all() and (n == 0).all()
    # on the inputs' graph: a backward through the empty output gives empty gradients
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, u)]
    vla_attention(*leaves)[0].sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


def test_no_state_without_output_final_state():
    o, state = vla_attention(*make_inputs(1, 10, 1, 4, 4))
    assert state is None and o.shape == (1, 10, 1, 4)


# SPEC §4 properties.


@pytest.mark.parametrize("lam0", [0.01, 10.0], ids=lambda x: f"lam{x}")
def test_transition_spectral_radius_is_one(lam0):
    B, T, H, K = 2, 80, 2, 8
    _, k, _, u = make_inputs(B, T, H, K, 4)
    k_hat, alpha, _ = vla_gates_naive(k, u, lam0)
    eye = torch.eye(K, dtype=torch.float64)
    eig = torch.linalg.eigvals(eye - k_hat[..., :, None] * alpha[..., None, :]).abs()
    torch.testing.assert_close(eig.max(-1).values, torch.ones(B, T, H, dtype=torch.float64))
    # The one non-unit eigenvalue, 1 - α̂ᵀk̂, lies in [0, 1) since 0 < k̂ᵀA k̂ <= ‖A k̂‖.
    gain = (alpha * k_hat).sum(-1)
    assert (gain > 0).all() and (gain <= 1 + 1e-12).all()

    # The chunk form of the gates gives the same α̂.
    alpha_chunk, _ = vla_chunk_gates(k_hat.transpose(1, 2), u.transpose(1, 2), lam0, None, chunk_size=16)
    assert_close("alpha", alpha_chunk.transpose(1, 2), alpha, 1e-10)


def test_state_bounded_while_linear_attention_grows():
    B, H, K, V, pieces, length = 1, 2, 16, 16, 10, 1000
    vla_state = lin_state = None
    vla_norms, lin_norms = [], []
    for _ in range(pieces):
        q, k, _, u = make_inputs(B, length, H, K, V, dtype=torch.float32)
        v = torch.rand(B, length, H, V)  # bounded values with a non-zero mean, as real activations have
        _, vla_state = vla_attention(q, k, v, u, initial_state=vla_state, output_final_state=True)
        _, lin_state = linear_attention(q, k, v, initial_state=lin_state, output_final_state=True)
        vla_norms.append(vla_state[0].norm(dim=(-2, -1)).max().item())
        lin_norms.append(lin_state[0].norm(dim=(-2, -1)).min().item())
    assert max(vla_norms) < 100, vla_norms
    assert vla_norms[-1] < 2 * vla_norms[0], vla_norms
    assert lin_norms[-1] > 5 * lin_norms[0], lin_norms


# Validation: one test per rule, each naming the argument.


def good(**overrides):
    q, k, v, u = make_inputs(1, 8, 2, 4, 3, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, u=u)
    args.update(overrides)
    return args


def call(args, **kwargs):
    return vla_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("u"), **args, **kwargs)


def state_for(N=1, H=2, K=4, V=3):
    return make_state(N, H, K, V, 0.1, dtype=torch.float32)


BAD_INPUTS = {
    "q-rank": (dict(q=torch.rand(1, 8, 2)), {}, "^q"),
    "q-not-tensor": (dict(q=[1.0]), {}, "^q"),
    "q-int-dtype": (dict(q=torch.ones(1, 8, 2, 4, dtype=torch.int64)), {}, "^q"),
    "k-shape": (dict(k=torch.rand(1, 8, 2, 5)), {}, "^k"),
    "v-shape": (dict(v=torch.rand(1, 7, 2, 3)), {}, "^v"),
    "v-dtype": (dict(v=torch.rand(1, 8, 2, 3, dtype=torch.float64)), {}, "^v"),
    "k-device": (dict(k=torch.rand(1, 8, 2, 4, device="meta")), {}, "^k"),
    "gqa-heads": (dict(q=torch.rand(1, 8, 4, 4)), {}, "^q"),
    "u-shape": (dict(u=torch.rand(1, 8, 2, 5)), {}, "^u"),
    "u-rank": (dict(u=torch.rand(1, 8, 2)), {}, "^u"),
    "u-device": (dict(u=torch.rand(1, 8, 2, 4, device="meta")), {}, "^u"),
    "lam0-zero": ({}, dict(lam0=0.0), "^lam0"),
    "lam0-negative": ({}, dict(lam0=-1.0), "^lam0"),
    "lam0-nan": ({}, dict(lam0=float("nan")), "^lam0"),
    "lam0-inf": ({}, dict(lam0=float("inf")), "^lam0"),
    "lam0-tensor": ({}, dict(lam0=torch.tensor(0.1)), "^lam0"),
    "eps-zero": ({}, dict(eps=0.0), "^eps"),
    "eps-nan": ({}, dict(eps=float("nan")), "^eps"),
    "cu_seqlens-batch": (
        dict(
            q=torch.rand(2, 8, 2, 4),
            k=torch.rand(2, 8, 2, 4),
            v=torch.rand(2, 8, 2, 3),
            u=torch.rand(2, 8, 2, 4),
        ),
        dict(cu_seqlens=torch.tensor([0, 8])),
        "^cu_seqlens",
    ),
    "cu_seqlens-non-monotone": ({}, dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "^cu_seqlens"),
    "cu_seqlens-dtype": ({}, dict(cu_seqlens=torch.tensor([0.0, 8.0])), "^cu_seqlens"),
    "cu_seqlens-end": ({}, dict(cu_seqlens=torch.tensor([0, 7])), "^cu_seqlens"),
    "cu_seqlens-rank": ({}, dict(cu_seqlens=torch.tensor([[0, 8]])), "^cu_seqlens"),
    "cu_seqlens-device": ({}, dict(cu_seqlens=torch.tensor([0, 8], device="meta")), "^cu_seqlens"),
    "initial_state-not-tuple": ({}, dict(initial_state=torch.zeros(1, 2, 3, 4)), "^initial_state"),
    "initial_state-length": ({}, dict(initial_state=state_for()[:2]), "^initial_state"),
    "initial_state-S-shape": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 4, 4), *state_for()[1:])),
        r"^initial_state\[0\]",
    ),
    "initial_state-A-shape": (
        {},
        dict(initial_state=(state_for()[0], torch.eye(3).expand(1, 2, 3, 3), state_for()[2])),
        r"^initial_state\[1\]",
    ),
    "initial_state-n-shape": (
        {},
        dict(initial_state=(*state_for()[:2], torch.zeros(1, 2, 3))),
        r"^initial_state\[2\]",
    ),
    "initial_state-n-dtype": (
        {},
        dict(initial_state=(*state_for()[:2], torch.zeros(1, 2, 4, dtype=torch.bfloat16))),
        r"^initial_state\[2\]",
    ),
    "initial_state-S-device": (
        {},
        dict(initial_state=(torch.zeros(1, 2, 3, 4, device="meta"), *state_for()[1:])),
        r"^initial_state\[0\]",
    ),
    "initial_state-A-not-spd": (
        {},
        dict(initial_state=(state_for()[0], -torch.eye(4).expand(1, 2, 4, 4), state_for()[2])),
        r"^initial_state\[1\]",
    ),
    "initial_state-N-vs-cu_seqlens": (
        {},
        dict(initial_state=state_for(N=1), cu_seqlens=torch.tensor([0, 3, 8])),
        r"^initial_state\[0\]",
    ),
    "backend-unknown": ({}, dict(backend="cuda"), "^backend"),
}


@pytest.mark.parametrize("overrides, kwargs, match", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises(overrides, kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(good(**overrides), **kwargs)
