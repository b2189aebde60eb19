"""``AttnKitCache``: the decoding state of every layer, as a Hugging Face ``Cache``.

Each layer's state is the plain dict its mixer returns (``attnkit.layers.base``): a KV cache for
softmax layers, keys carried forward for PaTH, raw keys with positions for TAPA, ``(S, A, n)`` for VLA,
the recurrent state for linear attention and DeltaNet. Every entry has the batch first, so beam search
and batch selection work the same way for all of them.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..layers.base import State


class AttnKitCacheLayer(CacheLayerMixin):
    """One layer's state. Its length counts the columns of the attention mask seen so far."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.state: State | None = None

    def lazy_initialization(self, *args: object, **kwargs: object) -> None:
        pass

    def update(self, *args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("attnkit layers keep their own state: read and write AttnKitCacheLayer.state")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self.state is None else self.state["mask"].shape[1]

    def get_max_length(self) -> int:
        return -1

    def _map(self, fn) -> None:
        if self.state is not None:
            self.state = {name: fn(t) for name, t in self.state.items()}

    def reset(self) -> None:
        self.state = None

    def offload(self) -> None:
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices.to(t.device)])


class AttnKitCache(Cache):
    """The cache of an ``AttnKitForCausalLM``: one ``AttnKitCacheLayer`` per layer."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[AttnKitCacheLayer() for _ in range(num_layers)])
