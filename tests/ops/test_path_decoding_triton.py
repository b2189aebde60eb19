"""The in-place fused PaTH decode step against the PyTorch step (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit.ops.common.triton.decode_merge as decode_merge
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


@pytest.mark.parametrize("split", [None, 16], ids=["one-split", "splits-and-merge"])
@pytest.mark.parametrize("gate", [False, True], ids=["path", "fox"])
@pytest.mark.parametrize("B, HQ, H, K, V", [(2, 4, 2, 16, 16), (1, 2, 1, 24, 12), (1, 2, 1, 256, 16)], ids=str)
def test_steps_match_torch(B, HQ, H, K, V, gate, split, monkeypatch):
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
        o = path_decode_step_(q, k, v, w, beta, k_buf, v_buf, t, g, g_buf, cache_mask=mask)
        assert_close("o", o, o_ref, 1e-5)
    assert_close("k_cache", k_buf[:, : prompt + steps], k_ref, 1e-5)
    assert_close("v_cache", v_buf[:, : prompt + steps], v_ref, 0.0)
    assert k_buf[:, prompt + steps :].abs().max() == 0, "slots past the cache's length stay untouched"


def test_bad_input():
    q, k, v, w, beta, _ = token(1, 2, 1, 16, 16, False)
    k_buf, v_buf = torch.zeros(1, 4, 1, 16, device=DEVICE), torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="^t:"):
        path_decode_step_(q, k, v, w, beta, k_buf, v_buf, 4)
    with pytest.raises(ValueError, match="^k_cache: expected a contiguous"):
        path_decode_step_(q, k, v, w, beta, torch.zeros(1, 4, 2, 16, device=DEVICE)[:, :, :1], v_buf, 1)
    with pytest.raises(ValueError, match="^backend: .*float64"):
        path_decode_step_(q.double(), k.double(), v.double(), w, beta, k_buf.double(), v_buf.double(), 1)
    with pytest.raises(ValueError, match="^g_cache"):
        path_decode_step_(q, k, v, w, beta, k_buf, v_buf, 1, g_cache=torch.zeros(1, 4, 2, device=DEVICE))


def test_opcheck():
    from attnkit.ops.path.parallel import path_decode_op

    q, k, v, w, beta, g = token(2, 4, 2, 16, 16, True)
    k_buf, v_buf = torch.randn(2, 9, 2, 16, device=DEVICE), torch.randn(2, 9, 2, 16, device=DEVICE)
    g_buf = torch.randn(2, 9, 4, device=DEVICE).cumsum(1)
    mask = torch.ones(2, 9, dtype=torch.bool, device=DEVICE)
    torch.library.opcheck(path_decode_op, (q, w, beta, k_buf, v_buf, 5, g_buf, mask, 0.25))
