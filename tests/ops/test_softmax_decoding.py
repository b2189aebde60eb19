"""softmax_decode_step: prefill + one-token steps over a left-padded cache == softmax / FoX attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.ops.baselines.softmax import softmax_attention, softmax_decode_step
from tests.helpers import assert_close


@pytest.mark.parametrize("gated", [False, True], ids=["softmax", "fox"])
@pytest.mark.parametrize("prefill", [0, 1, 9])
def test_steps_match_full_forward(gated, prefill):
    B, T, HQ, H, K, V = 2, 20, 4, 2, 16, 8
    q = torch.randn(B, T, HQ, K, dtype=torch.float64)
    k = torch.randn(B, T, H, K, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, HQ, dtype=torch.float64) + 2) if gated else None
    full = softmax_attention(q, k, v, g)
    G = None if g is None else g.cumsum(1)
    # the cache starts with padding slots filled with junk: the mask alone must keep them out
    pad = 3
    junk = [torch.randn(B, pad, *x.shape[2:], dtype=x.dtype) for x in (k, v)]
    k_cache, v_cache = torch.cat([junk[0], k[:, :prefill]], 1), torch.cat([junk[1], v[:, :prefill]], 1)
    mask = torch.ones(B, pad + prefill, dtype=torch.bool)
    mask[:, :pad] = False
    g_cache = None if G is None else torch.cat([torch.randn(B, pad, HQ, dtype=G.dtype), G[:, :prefill]], 1)
    outs = []
    for t in range(prefill, T):
        k_cache, v_cache = torch.cat([k_cache, k[:, t : t + 1]], 1), torch.cat([v_cache, v[:, t : t + 1]], 1)
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        g_t = None
        if G is not None:
            g_t = G[:, t]
            g_cache = torch.cat([g_cache, g_t[:, None]], 1)
        outs.append(softmax_decode_step(q[:, t : t + 1], k_cache, v_cache, mask, g_cache, g_t))
    assert_close("decode", torch.cat(outs, 1), full[:, prefill:], 1e-12)


def test_no_mask_means_all_real():
    q, k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 5, 1, 8), torch.randn(2, 5, 1, 4)
    expected = softmax_decode_step(q, k, v, torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(softmax_decode_step(q, k, v, None), expected)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.randn(2, 2, 2, 8)), "^q"),
        (dict(k_cache=torch.randn(2, 5, 1, 7)), "^k_cache"),
        (dict(v_cache=torch.randn(2, 4, 1, 4)), "^v_cache"),
        (dict(cache_mask=torch.ones(2, 5)), "^cache_mask"),
        (dict(cache_mask=torch.ones(2, 4, dtype=torch.bool)), "^cache_mask"),
        (dict(g_cache=torch.zeros(2, 5, 2)), "^g_cache"),
        (dict(g_cache=torch.zeros(2, 5, 1), g_t=torch.zeros(2, 2)), "^g_cache"),
        (dict(k_cache=torch.randn(2, 5, 3, 8), v_cache=torch.randn(2, 5, 3, 4)), "^q"),
    ],
    ids=["q-two-tokens", "k-dim", "v-length", "mask-float", "mask-shape", "g-alone", "g-shape", "heads"],
)
def test_bad_input(change, match):
    args = dict(
        q=torch.randn(2, 1, 2, 8), k_cache=torch.randn(2, 5, 1, 8), v_cache=torch.randn(2, 5, 1, 4),
        cache_mask=torch.ones(2, 5, dtype=torch.bool),
    )  # fmt: skip
    with pytest.raises(ValueError, match=match):
        softmax_decode_step(**{**args, **change})
