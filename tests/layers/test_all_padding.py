"""Every layer takes a batch whose attention_mask is all padding (issue 18's empty inputs: the PaTH layers raised a
reshape error): the output is zeros on the input's graph, and the cache it returns decodes as an empty one."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_close
from tests.layers.test_attention_layers import LAYERS as ATTENTION_LAYERS
from tests.layers.test_recurrent_layers import LAYERS as RECURRENT_LAYERS

LAYERS = {**ATTENTION_LAYERS, **RECURRENT_LAYERS}


@pytest.mark.parametrize("name", LAYERS)
def test_all_padding_batch(name):
    torch.manual_seed(0)
    layer = LAYERS[name]().eval()
    x = torch.randn(2, 5, layer.hidden_size, requires_grad=True)
    out, state = layer(x, attention_mask=torch.zeros(2, 5, dtype=torch.long), use_cache=True)
    assert out.shape == x.shape and not out.any()
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    token = torch.randn(2, 1, layer.hidden_size)
    decoded, _ = layer(token, past_state=state)
    assert_close("decoded", decoded, layer(token)[0], 1e-5)
