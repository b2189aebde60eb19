"""tapa_decode_step: one-token steps over a left-padded cache of raw keys and positions == tapa_attention."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops.tapa import tapa_attention, tapa_decode_step
from tests.helpers import assert_close


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.7], ids=lambda a: f"alpha{a}")
@pytest.mark.parametrize("prefill", [0, 1, 70])
def test_steps_match_full_forward(prefill, alpha):
    """Prefill 70 crosses the op's 64-row block; sequence 1 sits behind junk-filled padding slots whose
    recorded positions are garbage, so both the mask and the positions are exercised."""
    B, T, HQ, H, D, V, theta = 2, 80, 4, 2, 16, 8, 0.5
    q = torch.randn(B, T, HQ, D, dtype=torch.float64)
    k = torch.randn(B, T, H, D, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    full = tapa_attention(q, k, v, theta=theta, alpha=alpha)
    pad = 2
    k_cache = torch.cat([torch.randn(B, pad, H, D, dtype=k.dtype), k[:, :prefill]], 1)
    v_cache = torch.cat([torch.randn(B, pad, H, V, dtype=v.dtype), v[:, :prefill]], 1)
    positions = torch.cat([torch.tensor([[0, 0], [5, -3]]), torch.arange(prefill).expand(B, prefill)], 1)
    mask = torch.ones(B, pad + prefill, dtype=torch.bool)
    mask[:, :pad] = False
    outs = []
    for t in range(prefill, T):
        k_cache, v_cache = torch.cat([k_cache, k[:, t : t + 1]], 1), torch.cat([v_cache, v[:, t : t + 1]], 1)
        positions = torch.cat([positions, positions.new_full((B, 1), t)], 1)
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        q_position = torch.full((B,), t)
        outs.append(
            tapa_decode_step(q[:, t : t + 1], k_cache, v_cache, q_position, positions, mask, theta=theta, alpha=alpha)
        )
    assert_close("decode", torch.cat(outs, 1), full[:, prefill:], 1e-10)


def test_float32_and_per_row_positions():
    """Rows at different positions in one batch (as after left-padded prefill) in float32."""
    D, V = 8, 4
    seqs = [torch.randn(1, n, 2, D) for n in (7, 3)]
    vals = [torch.randn(1, n, 1, V) for n in (7, 3)]
    keys = [torch.randn(1, n, 1, D) for n in (7, 3)]
    full = [tapa_attention(q, k, v, theta=0.25, alpha=0.3) for q, k, v in zip(seqs, keys, vals)]
    k_cache = torch.cat([keys[0], torch.cat([torch.zeros(1, 4, 1, D), keys[1]], 1)])
    v_cache = torch.cat([vals[0], torch.cat([torch.zeros(1, 4, 1, V), vals[1]], 1)])
    positions = torch.stack([torch.arange(7), torch.tensor([0, 0, 0, 0, 0, 1, 2])])
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :4] = False
    q = torch.cat([seqs[0][:, -1:], seqs[1][:, -1:]])
    o = tapa_decode_step(q, k_cache, v_cache, torch.tensor([6, 2]), positions, mask, theta=0.25, alpha=0.3)
    assert_close("row0", o[0], full[0][0, -1:], 1e-6)
    assert_close("row1", o[1], full[1][0, -1:], 1e-6)


def good():
    return dict(
        q=torch.randn(2, 1, 2, 8), k_cache=torch.randn(2, 5, 1, 8), v_cache=torch.randn(2, 5, 1, 4),
        q_position=torch.tensor([4, 4]), k_positions=torch.arange(5).expand(2, 5),
        cache_mask=torch.ones(2, 5, dtype=torch.bool),
    )  # fmt: skip


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=torch.randn(2, 2, 2, 8)), "^q"),
        (dict(k_cache=torch.randn(2, 5, 1, 7)), "^k_cache"),
        (dict(v_cache=torch.randn(2, 4, 1, 4)), "^v_cache"),
        (dict(q_position=torch.tensor([4.0, 4.0])), "^q_position"),
        (dict(k_positions=torch.arange(4).expand(2, 4)), "^k_positions"),
        (dict(cache_mask=torch.ones(2, 5)), "^cache_mask"),
        (dict(theta=0.0), "^theta"),
        (dict(theta=0.99), "^theta"),
        (dict(alpha=-0.5), "^alpha"),
        (dict(alpha=float("nan")), "^alpha"),
    ],
    ids=[
        "q-two-tokens",
        "k-dim",
        "v-length",
        "qpos-float",
        "kpos-shape",
        "mask-float",
        "theta-0",
        "theta-empty-phase",
        "alpha-negative",
        "alpha-nan",
    ],
)
def test_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        tapa_decode_step(**{**good(), **change})
