"""The stick-breaking attention layer (Tan et al., arXiv 2410.17980) around ``attnkit.ops.stickbreaking``.

No position encoding: the stick-breaking weights are ordered by themselves (the nearest key breaks first). The
decoding cache holds the raw keys and values per token, as a NoPE softmax layer's does.
"""

from __future__ import annotations

import torch

from attnkit.ops.stickbreaking import (
    BLOCK_SIZE,
    check_attend_current,
    stickbreaking_attention,
    stickbreaking_decode_step,
)

from .base import State, TokenMixer, check_int

__all__ = ["StickBreakingAttention"]


class StickBreakingAttention(TokenMixer):
    """Causal stick-breaking attention with GQA: bias-free ``q, k, v, o`` projections, no position encoding.

    The head layout, ``layer_idx`` and ``backend`` are :class:`TokenMixer`'s (the op has a PyTorch backend only).
    ``attend_current`` lets a token read its own key too (off in the paper: keys ``j < i`` only); ``block_size`` is
    the op's (positions per query and key block: larger blocks mean fewer, larger steps, fewer launches on a GPU).
    """

    cache_keys = ("k", "v")

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        attend_current: bool = False,
        block_size: int = BLOCK_SIZE,
        layer_idx: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, layer_idx, backend)
        self.attend_current = check_attend_current(attend_current)
        self.block_size = check_int("block_size", block_size)
        self.init_qkvo()

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        q, k, v = self.qkv(x)
        o = stickbreaking_attention(
            q,
            k,
            v,
            attend_current=self.attend_current,
            cu_seqlens=cu_seqlens,
            block_size=self.block_size,
            backend=self.backend,
        )
        return self.o_proj(o.flatten(2)), {"k": k, "v": v}, {}

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        q, k, v = self.qkv(x)
        state = dict(state)
        state["k"] = torch.cat([state["k"], k], dim=1)
        state["v"] = torch.cat([state["v"], v], dim=1)
        o = stickbreaking_decode_step(q, state["k"], state["v"], state["mask"], attend_current=self.attend_current)
        return self.o_proj(o.flatten(2)), state
