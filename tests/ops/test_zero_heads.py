"""HQ = 0 (no query heads) is refused by every op and decode step with a ValueError naming q (issue 18: it passed
validation, since 0 is a multiple of any number of key/value heads); so is H = 0."""

from __future__ import annotations

import pytest
import torch

from attnkit.ops import delta_rule, linear_attention, path_attention, softmax_attention, tapa_attention, vla_attention
from attnkit.ops.path import path_decode_step

B, T, H, K = 2, 5, 2, 8


def qkv(HQ, heads=H):
    return torch.randn(B, T, HQ, K), torch.randn(B, T, heads, K), torch.randn(B, T, heads, K)


OPS = {
    "softmax": lambda q, k, v: softmax_attention(q, k, v),
    "tapa": lambda q, k, v: tapa_attention(q, k, v),
    "linear": lambda q, k, v: linear_attention(q, k, v),
    "path": lambda q, k, v: path_attention(q, k, v, torch.randn(B, T, k.shape[2], K), torch.rand(B, T, k.shape[2])),
    "vla": lambda q, k, v: vla_attention(q, k, v, torch.randn(*k.shape)),
    "delta_rule": lambda q, k, v: delta_rule(q, k, v, torch.rand(B, T, k.shape[2])),
}


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("HQ, heads", [(0, H), (0, 0)], ids=["HQ0", "HQ0-H0"])
def test_no_query_heads_is_refused(op, HQ, heads):
    with pytest.raises(ValueError, match="^q:"):
        OPS[op](*qkv(HQ, heads))


def test_path_decode_step_without_query_heads():
    q = torch.randn(B, 1, 0, K)
    k, v, w = torch.randn(B, 1, H, K), torch.randn(B, 1, H, K), torch.randn(B, 1, H, K)
    with pytest.raises(ValueError, match="^q:"):
        path_decode_step(q, k, v, w, torch.rand(B, 1, H), torch.zeros(B, 3, H, K), torch.zeros(B, 3, H, K))
