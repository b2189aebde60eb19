"""The in-place PaTH decode step (fused kernel, under the interpreter on CPU, and its PyTorch form) against the
copying PyTorch step, and the layers' in-place decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit.ops.common.triton.decode_merge as decode_merge
from attnkit.layers.path import PaTHAttention
from attnkit.ops.path import path_carry_keys, path_decode_step, path_decode_step_
from tests.helpers import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def token(B, HQ, H, K, V, gate):
    q = torch.randn(B, 1, HQ, K, device=DEVICE)
    k = torch.randn(B, 1, H, K, device=DEVICE)
    v = torch.randn(B, 1, H, V, device=DEVICE)
    w = F.normalize(torch.randn(B, 1, H, K, device=DEVICE), dim=-1)
    beta = 1.5 + 0.5 * torch.rand(B, 1, H, device=DEVICE)
    g = F.logsigmoid(torch.randn(B, 1, HQ, device=DEVICE) + 2) if gate else None
    return q, k, v, w, beta, g


@pytest.mark.parametrize(
    "backend, split",
    [("triton", None), ("triton", 16), ("torch", None)],
    ids=["one-split", "splits-and-merge", "torch"],
)
@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
@pytest.mark.parametrize("B, HQ, H, K, V", [(2, 4, 2, 16, 16), (1, 2, 1, 24, 12), (1, 2, 1, 256, 16)], ids=str)
def test_steps_match_torch(B, HQ, H, K, V, gate, backend, split, monkeypatch):
    if split is not None:
        monkeypatch.setattr(decode_merge, "decode_split_size", lambda *args: split)
    prompt, steps, cap = 21, 6, 40
    kp = torch.randn(B, prompt, H, K, device=DEVICE)
    vp = torch.randn(B, prompt, H, V, device=DEVICE)
    wp = F.normalize(torch.randn(B, prompt, H, K, device=DEVICE), dim=-1)
    bp = 1.5 + 0.5 * torch.rand(B, prompt, H, device=DEVICE)
    gp = F.logsigmoid(torch.randn(B, prompt, HQ, device=DEVICE) + 2) if gate else None

    k_ref, v_ref = path_carry_keys(kp, wp, bp), vp
    g_ref = gp.cumsum(1) if gate else None
    k_buf = torch.zeros(B, cap, H, K, device=DEVICE)
    v_buf = torch.zeros(B, cap, H, V, device=DEVICE)
    k_buf[:, :prompt], v_buf[:, :prompt] = k_ref, v_ref
    g_buf = None
    if gate:
        g_buf = torch.zeros(B, cap, HQ, device=DEVICE)
        g_buf[:, :prompt] = g_ref
    mask = torch.ones(B, cap, dtype=torch.bool, device=DEVICE)
    mask[1:, :3] = False  # left padding of the later rows
    for i in range(steps):
        t = prompt + i
        q, k, v, w, beta, g = token(B, HQ, H, K, V, gate)
        o_ref, k_ref, v_ref, g_ref = path_decode_step(
            q, k, v, w, beta, k_ref, v_ref, g, g_ref, cache_mask=mask[:, : t + 1]
        )
        # the mask may be the cache's width or end at the new token: slots past t are never read
        m = mask if i % 2 else mask[:, : t + 1]
        o = path_decode_step_(q, k, v, w, beta, k_buf, v_buf, t, g, g_buf, cache_mask=m, backend=backend)
        assert_close("o", o, o_ref, 1e-5)
    assert_close("k_cache", k_buf[:, : prompt + steps], k_ref, 1e-5)
    assert_close("v_cache", v_buf[:, : prompt + steps], v_ref, 0.0)
    assert k_buf[:, prompt + steps :].abs().max() == 0, "slots past the cache's length stay untouched"


@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
def test_functional_step_on_the_fused_kernel(gate):
    """``path_decode_step(backend="triton")``: the PyTorch step's outputs and new caches over several steps with
    left padding, and the caches passed in unchanged."""
    B, HQ, H, K, V, prompt = 2, 4, 2, 16, 16, 19
    k_ref = torch.randn(B, prompt, H, K, device=DEVICE)
    v_ref = torch.randn(B, prompt, H, V, device=DEVICE)
    g_ref = F.logsigmoid(torch.randn(B, prompt, HQ, device=DEVICE) + 2).cumsum(1) if gate else None
    k_ref[1, :3] = 0  # left padding of the second row (zero keys, as the layers' caches hold)
    mask = torch.ones(B, prompt + 4, dtype=torch.bool, device=DEVICE)
    mask[1, :3] = False
    k_fused, v_fused, g_fused = k_ref, v_ref, g_ref
    for i in range(4):
        step = token(B, HQ, H, K, V, gate)
        before = [x.clone() for x in (k_fused, v_fused)]
        real = mask[:, : prompt + i + 1]
        o_ref, k_ref, v_ref, g_ref = path_decode_step(
            *step[:5], k_ref, v_ref, step[5], g_ref, cache_mask=real, backend="torch"
        )
        o, k_new, v_new, g_new = path_decode_step(
            *step[:5], k_fused, v_fused, step[5], g_fused, cache_mask=real, backend="triton"
        )
        assert torch.equal(k_fused, before[0]) and torch.equal(v_fused, before[1]), "the caches passed in changed"
        k_fused, v_fused, g_fused = k_new, v_new, g_new
        assert_close("o", o, o_ref, 1e-5)
        assert_close("k_cache", k_fused, k_ref, 1e-5)
        assert_close("v_cache", v_fused, v_ref, 0.0)
        if gate:
            assert_close("g_cache", g_fused, g_ref, 1e-6)


@pytest.mark.parametrize("grad", [False, True], ids=["in-place", "under-autograd"])
def test_layer_decodes_on_the_kernels(grad, monkeypatch):
    """A PaTH-FoX layer on the Triton backend (prefill kernels, carried keys, fused decode steps) decodes what the
    same layer on the PyTorch backend does, from a left-padded prompt: in place on its preallocated cache outside
    autograd, through the copying step under it."""
    from attnkit.layers import path as path_layer
    from attnkit.ops.path import decoding

    fused = []

    def counted(*args, **kwargs):
        fused.append(kwargs["backend"])
        return path_decode_step_(*args, **kwargs)

    monkeypatch.setattr(decoding, "path_decode_step_", counted)
    monkeypatch.setattr(path_layer, "path_decode_step_", counted)

    torch.manual_seed(0)
    layers = {b: PaTHAttention(64, 4, num_kv_heads=2, use_forget_gate=True, backend=b) for b in ("torch", "triton")}
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    x = torch.randn(2, 23, 64, device=DEVICE)
    mask = torch.ones(2, 20, dtype=torch.long, device=DEVICE)
    mask[1, :5] = 0
    outs = {}
    with torch.set_grad_enabled(grad):
        for name, layer in layers.items():
            layer.to(DEVICE)
            o, state = layer(x[:, :20], attention_mask=mask, use_cache=True)
            steps = [o]
            for t in range(20, 23):
                o, state = layer(x[:, t : t + 1], past_state=state, use_cache=True)
                steps.append(o)
            outs[name] = torch.cat(steps, dim=1)
    assert fused.count("triton") == 3, "the Triton layer's steps run the fused kernel"
    assert fused.count("torch") == (0 if grad else 3), "outside autograd the PyTorch layer steps in place too"
    assert_close("o", outs["triton"], outs["torch"], 1e-5)


@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
def test_layer_cache_is_preallocated(gate):
    """Outside autograd the layer's steps write into its cache in place: the tensors keep their storage from one
    step to the next until they are full, then grow with spare slots; the outputs equal the copying steps'."""
    torch.manual_seed(0)
    layer = PaTHAttention(32, 2, use_forget_gate=gate, backend="torch").to(DEVICE)
    x = torch.randn(2, 12, 32, device=DEVICE)
    names = ("k", "v", "g") if gate else ("k", "v")
    o_ref, ref = layer(x[:, :5], use_cache=True)
    with torch.no_grad():
        o, state = layer(x[:, :5], use_cache=True)
        outs, ptrs = [o], []
        for t in range(5, 12):
            o, state = layer(x[:, t : t + 1], past_state=state, use_cache=True)
            outs.append(o)
            ptrs.append(tuple(state[n].data_ptr() for n in names))
            assert all(state[n].shape[1] > t for n in names), "the cache holds the new token"
    assert len(set(ptrs)) == 1, "after the first step grew the prompt's cache, no step copies it"
    assert state["k"].shape[1] >= 5 + 256, "the cache grew with spare capacity"
    refs = [o_ref]
    for t in range(5, 12):
        o_ref, ref = layer(x[:, t : t + 1], past_state=ref, use_cache=True)
        refs.append(o_ref)
    assert_close("o", torch.cat(outs, 1), torch.cat(refs, 1).detach(), 1e-6)
    for n in names:
        assert_close(n, state[n][:, :12], ref[n].detach(), 1e-6)


def test_bad_input():
    q, k, v, w, beta, _ = token(1, 2, 1, 16, 16, False)
    k_buf, v_buf = torch.zeros(1, 4, 1, 16, device=DEVICE), torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="^t:"):
        path_decode_step_(q, k, v, w, beta, k_buf, v_buf, 4)
    with pytest.raises(ValueError, match="^cache_mask: expected shape"):
        path_decode_step_(q, k, v, w, beta, k_buf, v_buf, 2, cache_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="^k_cache: expected a contiguous"):
        path_decode_step_(q, k, v, w, beta, torch.zeros(1, 4, 2, 16, device=DEVICE)[:, :, :1], v_buf, 1)
    with pytest.raises(ValueError, match="^backend: .*float64"):
        path_decode_step_(
            q.double(), k.double(), v.double(), w, beta, k_buf.double(), v_buf.double(), 1, backend="triton"
        )
    with pytest.raises(ValueError, match="^g_cache"):
        path_decode_step_(q, k, v, w, beta, k_buf, v_buf, 1, g_cache=torch.zeros(1, 4, 2, device=DEVICE))


def test_opcheck():
    from attnkit.ops.path.parallel import path_decode_op

    q, k, v, w, beta, g = token(2, 4, 2, 16, 16, True)
    k_buf, v_buf = torch.randn(2, 9, 2, 16, device=DEVICE), torch.randn(2, 9, 2, 16, device=DEVICE)
    g_buf = torch.randn(2, 9, 4, device=DEVICE).cumsum(1)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    torch.library.opcheck(path_decode_op, (q, w, beta, k_buf, v_buf, 5, g_buf, mask, 0.25))


def bad_step_inputs():
    """``(name, inputs)``: one decode step's inputs (B = 2, HQ = 4, H = 2, K = 16, V = 8) with one of them wrong."""
    cases = []
    for name, bad in [
        ("q", torch.randn(2, 2, 4, 16)),  # two tokens
        ("k", torch.randn(2, 1, 2, 8)),  # the wrong head dim
        ("v", torch.randn(2, 1, 2, 8).to(torch.int64)),  # not floating
        ("v", torch.randn(2, 1, 2, 8).double()),  # not q's dtype
        ("w", torch.randn(2, 1, 1, 16)),  # one head: it would broadcast
        ("beta", torch.rand(2, 1, 1)),
        ("g", torch.randn(2, 1, 2)),  # the key/value heads, not the query heads'
        ("q", torch.randn(2, 1, 3, 16)),  # 3 query heads over 2 key/value heads
    ]:
        inputs = dict(zip(("q", "k", "v", "w", "beta", "g"), [x.cpu() for x in token(2, 4, 2, 16, 8, True)]))
        inputs[name] = bad
        cases.append((name, {key: x.to(DEVICE) for key, x in inputs.items()}))
    return cases


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("in_place", [False, True], ids=["copying", "in-place"])
def test_step_inputs_are_checked(case, in_place):
    """A bad input of either decode step is a ``ValueError`` that names it (before: ``w [B, 1, 1, K]`` and
    ``beta [B, 1, 1]`` broadcast silently, an int64 ``v`` gave an int64 output)."""
    name, x = bad_step_inputs()[case]
    k_cache, v_cache = torch.zeros(2, 6, 2, 16, device=DEVICE), torch.zeros(2, 6, 2, 8, device=DEVICE)
    g_cache = torch.zeros(2, 6, 4, device=DEVICE)
    args = (x["q"], x["k"], x["v"], x["w"], x["beta"])
    with pytest.raises(ValueError, match=f"^{name}:"):
        if in_place:
            path_decode_step_(*args, k_cache, v_cache, 3, x["g"], g_cache)
        else:
            path_decode_step(*args, k_cache[:, :3], v_cache[:, :3], x["g"], g_cache[:, :3], backend="torch")
